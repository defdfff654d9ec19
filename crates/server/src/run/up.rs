//! `tidemark up`: a local deployment — its own password-protected redis-servers (AOF on)
//! under a data dir, the topology written for read-only tools, then [`super::serve()`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tidemark_redis_proc::{ClusterOptions, RedisCluster, RedisOptions, RedisProcess};
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{Topology, TopologyError};
use tokio_util::sync::CancellationToken;

use super::data_dir::{
    load_or_create_redis_password, lock_data_dir, prepare_data_dir, write_private, DataDirLock,
    REDIS_PASSWORD_FILE,
};
use super::serve::{serve, Running, ServeOptions};
use super::Error;
use crate::gateway::GatewayOptions;
use crate::materializer::MaterializerOptions;

/// What `up` starts.
#[derive(Clone)]
pub struct UpOptions {
    /// Mailbox Redis instances.
    pub mailbox: usize,
    /// Core Redis instances.
    pub core: usize,
    /// Shards (fixed at creation; a later `up` on the same data dir must agree).
    pub shards: u32,
    /// Watermark layout written.
    pub layout: Layout,
    /// Gateway listen address.
    pub listen: SocketAddr,
    /// Where Redis data (AOF) and the deployment file live.
    pub data_dir: PathBuf,
    /// Gateway settings (dev auth, token secret…).
    pub gateway: GatewayOptions,
    /// Materializer settings.
    pub materializer: MaterializerOptions,
    /// `appendfsync` of every instance (`always`: nothing acknowledged is lost on a crash).
    pub appendfsync: String,
    /// Run both pools on one local Redis Cluster (3 primaries, 3 replicas, under
    /// `<data dir>/cluster`) instead of `core` + `mailbox` instances (ADR-0032).
    pub cluster: bool,
    /// The in-process service as a node (`up --nodes N` runs the first node here, in leases
    /// mode, and the others as child processes); `None`: one static owner, unregistered.
    pub node: Option<crate::ownership::NodeOptions>,
    /// `up --upgrade`: raise every instance's identity version from 2 to 3 before serving
    /// (ADR-0056). No process check: `up` started the redis-servers itself a moment ago, and
    /// holds the data dir's lock ([`DataDirLock`], ADR-0109), so no other `up` of the data
    /// dir can be running.
    pub upgrade: bool,
}

/// A local deployment: its redis-server processes (killed with it) and the running service.
pub struct Up {
    /// The core instances.
    pub core: Vec<RedisProcess>,
    /// The mailbox instances.
    pub mailbox: Vec<RedisProcess>,
    /// The local Redis Cluster both pools use (`up --cluster`).
    pub cluster: Option<RedisCluster>,
    /// The service.
    pub running: Running,
    /// The topology in use (its URLs carry the Redis password).
    pub topology: Topology,
    /// The file holding the password every instance requires.
    pub password_file: PathBuf,
    /// The data dir's lock (ADR-0109), released after the fields above are dropped (the
    /// redis-servers killed): keep this value (not only some of its fields) for as long as
    /// the deployment runs.
    pub lock: DataDirLock,
}

impl Up {
    /// One line per endpoint: the gateway URL, then every Redis instance (without its
    /// password), then how to connect to them with `redis-cli` and `tidemark` tools — naming
    /// the password file, never printing the password.
    pub fn endpoint_lines(&self) -> Vec<String> {
        let mut v = vec![
            format!("gateway  {}", self.running.ws_url()),
            format!(
                "console  {} (operations view: {}ops)",
                self.running.console_url(),
                self.running.console_url()
            ),
        ];
        if self.running.admin_addr.is_some() {
            v.push(format!(
                "admin    {} (GET /metrics, GET /healthz)",
                self.running.admin_url()
            ));
        }
        for (i, p) in self.core.iter().enumerate() {
            v.push(format!("core     {i} {}", p.display_url()));
        }
        for (i, p) in self.mailbox.iter().enumerate() {
            v.push(format!("mailbox  {i} {}", p.display_url()));
        }
        if let Some(c) = &self.cluster {
            for n in c.nodes() {
                let role = match n.role {
                    tidemark_redis_proc::Role::Primary => "primary".to_string(),
                    tidemark_redis_proc::Role::Replica { primary } => format!(
                        "replica of {}",
                        primary.map_or("?".to_string(), |p| p.to_string())
                    ),
                    tidemark_redis_proc::Role::Down => "down".to_string(),
                };
                v.push(format!(
                    "cluster  {} {} ({role}; core and mailbox pools)",
                    n.index, n.display_url
                ));
            }
        }
        let file = sh_quote(&self.password_file.display().to_string());
        v.push(format!(
            "redis    every instance requires the password in {file}; for example:"
        ));
        if let Some(p) = self.core.first() {
            v.push(format!(
                "           REDISCLI_AUTH=\"$(cat {file})\" redis-cli -p {}",
                p.port()
            ));
        }
        if let Some(c) = &self.cluster {
            v.push(format!(
                "           REDISCLI_AUTH=\"$(cat {file})\" redis-cli -c -p {}",
                c.port(0)
            ));
        }
        if let Some(p) = self.mailbox.first() {
            v.push(format!(
                "           tidemark wm verify --redis \"redis://:$(cat {file})@{}/\"",
                p.addr()
            ));
        }
        v
    }
}

/// `s` as one word for a POSIX shell: as is when it needs no quoting, else single-quoted.
fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+,:=@%".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The deployment file in a data dir: shards and instance counts are fixed at creation.
#[derive(serde::Serialize, serde::Deserialize, PartialEq, Eq, Debug)]
struct Deployment {
    shards: u32,
    core: usize,
    mailbox: usize,
    layout: Layout,
    /// Both pools on a local Redis Cluster (`up --cluster`); absent in files written before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    cluster: bool,
}

/// `up`'s own record of a data dir (shard and instance counts, layout). Named apart from the
/// topology files that `serve --config` and `trace --config` read (`tidemark.toml`), which
/// have another format.
const UP_STATE_FILE: &str = "up.toml";
/// Its name before (still read, then renamed).
const UP_STATE_FILE_OLD: &str = "deployment.toml";
/// The topology `up` is running, rewritten at every start: `trace --config` reads it.
pub const UP_TOPOLOGY_FILE: &str = "tidemark.toml";

fn check_deployment(dir: &Path, want: &Deployment) -> Result<(), Error> {
    let path = dir.join(UP_STATE_FILE);
    let old = dir.join(UP_STATE_FILE_OLD);
    if !path.exists() && old.exists() {
        std::fs::rename(&old, &path)?;
    }
    if let Ok(text) = std::fs::read_to_string(&path) {
        let have: Deployment = toml::from_str(&text).map_err(TopologyError::from)?;
        if have.layout == Layout::PackedV2 && want.layout == Layout::PackedV1 {
            return Err(TopologyError::Invalid(format!(
                "{} holds packed-v2 data and packed-v1 code cannot read it (ADR-0015); the \
                 downgrade is offline: stop the service, run `tidemark wm downgrade --all \
                 --redis URL` against every mailbox instance, then set layout = \"packed-v1\" \
                 in {}",
                dir.display(),
                path.display()
            ))
            .into());
        }
        if have.cluster != want.cluster {
            return Err(TopologyError::Invalid(format!(
                "{} was created {} --cluster; a data dir keeps its kind of deployment (use \
                 another --data-dir)",
                dir.display(),
                if have.cluster { "with" } else { "without" }
            ))
            .into());
        }
        if have.shards != want.shards || have.core != want.core || have.mailbox != want.mailbox {
            return Err(TopologyError::Invalid(format!(
                "{} was created with --shards {} --core {} --mailbox {}; shards and instance \
                 counts are fixed for a data dir (use another --data-dir)",
                dir.display(),
                have.shards,
                have.core,
                have.mailbox
            ))
            .into());
        }
        if have.layout != want.layout {
            // packed-v1 -> packed-v2: the upgrade (new code converts each shard on its next
            // write); the file records the layout now written
            let text = toml::to_string(want).map_err(|e| TopologyError::Invalid(e.to_string()))?;
            write_private(&path, text.as_bytes())?;
        }
        return Ok(());
    }
    tidemark_redis_proc::create_private_dir(dir)?;
    let text = toml::to_string(want).map_err(|e| TopologyError::Invalid(e.to_string()))?;
    write_private(&path, text.as_bytes())?;
    Ok(())
}

/// Locks `data_dir` ([`lock_data_dir`]: [`Error::DataDirLocked`] when another `up` holds it,
/// before anything is started or written), then [`up_locked`].
pub async fn up(opts: UpOptions, cancel: CancellationToken) -> Result<Up, Error> {
    let lock = lock_data_dir(&opts.data_dir)?;
    up_locked(opts, lock, cancel).await
}

/// With the data dir's lock taken ([`lock_data_dir`], by a caller that locks first and checks
/// more before it starts anything): makes `data_dir` private ([`prepare_data_dir`]), starts
/// `core + mailbox` redis-server processes under it, each requiring the data dir's password
/// ([`load_or_create_redis_password`]), initialises the shards and serves; the lock lives in
/// the [`Up`] returned. Must be called from the thread that will outlive the processes (the
/// parent-death signal is bound to the spawning thread): call it from `main`'s `block_on`.
pub async fn up_locked(
    opts: UpOptions,
    lock: DataDirLock,
    cancel: CancellationToken,
) -> Result<Up, Error> {
    if std::fs::canonicalize(lock.dir())? != std::fs::canonicalize(&opts.data_dir)? {
        return Err(TopologyError::Invalid(format!(
            "the lock taken is on {}, not on the data dir {}",
            lock.dir().display(),
            opts.data_dir.display()
        ))
        .into());
    }
    prepare_data_dir(&opts.data_dir)?;
    check_deployment(
        &opts.data_dir,
        &Deployment {
            shards: opts.shards,
            core: if opts.cluster { 0 } else { opts.core },
            mailbox: if opts.cluster { 0 } else { opts.mailbox },
            layout: opts.layout,
            cluster: opts.cluster,
        },
    )?;
    let password = load_or_create_redis_password(&opts.data_dir)?;
    let start = |name: String| {
        RedisProcess::start_with(RedisOptions {
            data_dir: Some(opts.data_dir.join(name)),
            appendonly: true,
            appendfsync: opts.appendfsync.clone(),
            requirepass: Some(password.clone()),
            ..Default::default()
        })
    };
    let (core, mailbox, cluster, topology) = if opts.cluster {
        // 3 primaries + 3 replicas; the same directory (and ports) at every start
        let c = RedisCluster::start(ClusterOptions {
            base_dir: Some(opts.data_dir.join("cluster")),
            requirepass: Some(password.clone()),
            appendonly: true,
            appendfsync: opts.appendfsync.clone(),
            node_timeout_ms: 2000,
            ..ClusterOptions::default()
        })?;
        let mut t = Topology::new(opts.shards, opts.layout, Vec::new(), Vec::new());
        t.core_cluster = Some(c.seeds());
        t.mailbox_cluster = Some(c.seeds());
        (Vec::new(), Vec::new(), Some(c), t)
    } else {
        let core: Vec<RedisProcess> = (0..opts.core)
            .map(|i| start(format!("core-{i}")))
            .collect::<Result<_, _>>()?;
        let mailbox: Vec<RedisProcess> = (0..opts.mailbox)
            .map(|i| start(format!("mailbox-{i}")))
            .collect::<Result<_, _>>()?;
        let t = Topology::new(
            opts.shards,
            opts.layout,
            core.iter().map(|p| p.url()).collect(),
            mailbox.iter().map(|p| p.url()).collect(),
        );
        (core, mailbox, None, t)
    };
    // for read-only tools: `tidemark trace --config <data dir>/tidemark.toml` (0600: the URLs
    // carry the Redis password)
    let text = toml::to_string(&topology).map_err(|e| TopologyError::Invalid(e.to_string()))?;
    write_private(
        &opts.data_dir.join(UP_TOPOLOGY_FILE),
        format!(
            "# written by `tidemark up` at every start (ports change): for read-only tools\n\
             # such as `tidemark trace --config`, and for the other nodes of `up --nodes N`.\n{text}"
        )
        .as_bytes(),
    )?;
    if opts.upgrade {
        raise_identity_version(&topology).await?;
    }
    let running = serve(
        ServeOptions {
            topology: topology.clone(),
            listen: opts.listen,
            gateway: opts.gateway.clone(),
            materializer: opts.materializer.clone(),
            owned_shards: None,
            node: opts.node.clone(),
        },
        cancel,
    )
    .await?;
    Ok(Up {
        core,
        mailbox,
        cluster,
        running,
        topology,
        password_file: opts.data_dir.join(REDIS_PASSWORD_FILE),
        lock,
    })
}

/// `up --upgrade`: every instance from identity version 2 to 3 (ADR-0056). Instances without
/// an identity (a new data dir) are left to the start, which records the deployment's
/// version; version 1 cannot be raised and is refused.
async fn raise_identity_version(topology: &Topology) -> Result<(), Error> {
    use tidemark_store::deployment::{self, Raise};
    let map = topology.validate()?;
    let found = deployment::raise_every_instance(map.core_urls(), map.mailbox_urls())
        .await
        .map_err(Error::from)?;
    for (role, index, r) in found {
        match r {
            Raise::Raised => tracing::warn!(
                role = role.as_str(),
                index,
                "deployment identity raised from version 2 to 3: log records are packed from now on"
            ),
            Raise::Found(v) if v.is_empty() || v == deployment::VERSION_CURRENT.to_string() => {}
            Raise::Found(v) => {
                return Err(Error::Deployment(format!(
                    "{} instance {index} is of identity version {v}, which --upgrade cannot \
                     raise (only 2 can become {}); nothing was started",
                    role.as_str(),
                    deployment::VERSION_CURRENT
                )))
            }
        }
    }
    Ok(())
}
