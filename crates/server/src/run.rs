//! Running Tidemark: [`serve`] runs the gateway and the materializers against Redis
//! instances it did not start; [`up`] starts its own redis-server processes (AOF on, data under
//! a directory), then serves. Both stop cleanly on cancellation and join every task.
//!
//! Every long-running task is supervised ([`crate::supervise`]): a materializer worker that
//! panics (or returns) is logged with its shards, counted, reported in `/healthz` (its shards
//! have no running owner) and started again, which re-claims its shards (safe: replays are
//! no-ops). The gateway cannot be restarted in place: if it panics or stops on its own, the
//! whole service stops with an error, so the process exits non-zero and its own supervisor
//! (systemd, Kubernetes) restarts it — never a process that is up with a dead gateway.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tidemark_protocol::secret::{SecretError, TokenSecret};
use tidemark_redis_proc::{RedisOptions, RedisProcess};
use tidemark_store::redis::store::Store;
use tidemark_store::redis::watermark::Layout;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::gateway::{self, GatewayError, GatewayOptions};
use crate::health::HealthBoard;
use crate::materializer::{self, MaterializerOptions, Worker};
use tidemark_store::topology::{ShardMap, Topology, TopologyError};

// what `serve` and `up` refuse before anything starts (unsafe --dev-auth, no token secret)
mod guard;
pub use guard::{check_dev_auth, serve_secret};

/// Errors of running the service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] TopologyError),
    /// Storage failure.
    #[error(transparent)]
    Store(#[from] tidemark_store::Error),
    /// Materializer failure.
    #[error(transparent)]
    Materializer(#[from] materializer::Error),
    /// Gateway failure.
    #[error(transparent)]
    Gateway(#[from] GatewayError),
    /// redis-server could not be started.
    #[error(transparent)]
    Redis(#[from] tidemark_redis_proc::Error),
    /// Files, sockets.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The token secret is missing, unreadable or too short.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// The gateway's listen address could not be bound (nothing was claimed).
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// A Redis instance of the topology did not answer at start (nothing was claimed).
    #[error("{role} Redis {url}: {source}")]
    Connect {
        role: &'static str,
        url: String,
        source: tidemark_store::Error,
    },
    /// The Redis instances belong to a deployment with another shard count or other tables.
    #[error("deployment mismatch: {0}")]
    Deployment(String),
    /// A task that cannot be restarted in place (the gateway) panicked or stopped.
    #[error("{task} {ended}")]
    TaskEnded {
        task: &'static str,
        ended: crate::supervise::Ended,
    },
}

impl Error {
    /// Stable code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Config(_) => "config",
            Error::Store(e) => e.code(),
            Error::Materializer(e) => e.code(),
            Error::Gateway(_) => "gateway",
            Error::Redis(e) => e.code(),
            Error::Io(_) => "io",
            Error::Secret(e) => e.code(),
            Error::Listen { .. } => "listen",
            Error::Deployment(_) => "deployment_mismatch",
            Error::Connect { .. } => "connect",
            Error::TaskEnded { .. } => "task_ended",
        }
    }
}

/// What `serve` runs.
#[derive(Clone)]
pub struct ServeOptions {
    /// Instances and tables.
    pub topology: Topology,
    /// Gateway listen address.
    pub listen: SocketAddr,
    /// Gateway settings.
    pub gateway: GatewayOptions,
    /// Materializer settings.
    pub materializer: MaterializerOptions,
    /// Shards this process owns (None: all). Each shard must have exactly one owner.
    pub owned_shards: Option<Vec<u32>>,
}

/// A running service: its addresses and its health board.
pub struct Running {
    /// The gateway's bound address.
    pub addr: SocketAddr,
    /// The admin listener's bound address (`/metrics`, `/healthz`), when there is one.
    pub admin_addr: Option<SocketAddr>,
    /// The gateway serves TLS (`wss://`, `https://`).
    pub tls: bool,
    /// Shard health, shared with `/healthz`.
    pub health: Arc<HealthBoard>,
    tracker: TaskTracker,
    cancel: CancellationToken,
    errors: tokio::sync::mpsc::UnboundedReceiver<Error>,
}

impl Running {
    /// The WebSocket URL of the gateway (`wss://` with TLS).
    pub fn ws_url(&self) -> String {
        let scheme = if self.tls { "wss" } else { "ws" };
        format!("{scheme}://{}/v1/ws", self.addr)
    }

    /// Where `/metrics` and `/healthz` are served: the admin listener when there is one, else
    /// the gateway (`https://` with TLS).
    pub fn admin_url(&self) -> String {
        match self.admin_addr {
            Some(a) => format!("http://{a}"),
            None if self.tls => format!("https://{}", self.addr),
            None => format!("http://{}", self.addr),
        }
    }

    /// Waits until `cancel` fires (or a task fails), then stops and joins every task.
    pub async fn wait(mut self) -> Result<(), Error> {
        let first = tokio::select! {
            _ = self.cancel.cancelled() => None,
            e = self.errors.recv() => e,
        };
        self.cancel.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Stops and joins every task.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.cancel.cancel();
        self.wait().await
    }
}

/// Initialises the watermark of every shard that has none (never overwrites one).
pub async fn init_missing(map: &ShardMap) -> Result<u32, Error> {
    let mut created = 0;
    for (i, url) in map.mailbox_urls().iter().enumerate() {
        let mut store = Store::connect(url, map.layout()).await?;
        for s in map.shards_on_mailbox(i) {
            match store.init_watermark(s, map.layout(), 1, 0, false).await {
                Ok(()) => created += 1,
                Err(tidemark_store::Error::AlreadyExists { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(created)
}

/// Checks the deployment identity recorded in every instance against `topology` and records
/// it where it is missing (see `tidemark_store::deployment`). Every instance is checked before
/// any is written, so a refused start writes nothing.
pub async fn check_identity(map: &ShardMap) -> Result<(), Error> {
    use tidemark_store::deployment::{self, Identity, Role};
    let tables = deployment::tables_fingerprint(map.core_table(), map.mailbox_table());
    let mut missing = Vec::new();
    for (role, urls) in [
        (Role::Core, map.core_urls()),
        (Role::Mailbox, map.mailbox_urls()),
    ] {
        for (index, url) in urls.iter().enumerate() {
            let want = Identity {
                shards: map.shards(),
                role,
                index,
                holds: match role {
                    Role::Core => map.shards_on_core(index),
                    Role::Mailbox => map.shards_on_mailbox(index),
                },
                tables: tables.clone(),
            };
            let connect_err = |source| Error::Connect {
                role: role.as_str(),
                url: redact_url(url),
                source,
            };
            let client = redis::Client::open(url.as_str())
                .map_err(|e| connect_err(tidemark_store::Error::from(e)))?;
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| connect_err(tidemark_store::Error::from(e)))?;
            let refuse = |what: String| {
                Error::Deployment(format!(
                    "{} Redis {} (instance {index}): {what}; refusing to start, nothing was \
                     written (start with the shard count and instance lists this deployment \
                     was created with)",
                    role.as_str(),
                    redact_url(url)
                ))
            };
            match deployment::read(&mut conn).await.map_err(connect_err)? {
                Some(have) => {
                    let d = have.differences(&want);
                    if !d.is_empty() {
                        return Err(refuse(d.join("; ")));
                    }
                }
                None => {
                    // created before identities: what it holds must agree with the topology
                    if role == Role::Mailbox {
                        let foreign: Vec<u32> = deployment::watermark_shards(&mut conn)
                            .await
                            .map_err(connect_err)?
                            .into_iter()
                            .filter(|s| !want.holds.contains(s))
                            .collect();
                        if !foreign.is_empty() {
                            return Err(refuse(format!(
                                "it holds watermarks of shards {} which a {}-shard deployment \
                                 with these tables places elsewhere or does not have",
                                deployment::format_ranges(&foreign),
                                map.shards()
                            )));
                        }
                    }
                    missing.push((conn, want));
                }
            }
        }
    }
    for (mut conn, want) in missing {
        let have = deployment::record_if_absent(&mut conn, &want).await?;
        let d = have.differences(&want);
        if !d.is_empty() {
            return Err(Error::Deployment(format!(
                "another process recorded a different identity at the same time: {}",
                d.join("; ")
            )));
        }
    }
    Ok(())
}

/// `url` without its password (`redis://:secret@host` → `redis://:***@host`), for messages.
pub use tidemark_store::redact_url;

/// Starts the materializers and the gateway. Returns once the gateway is listening.
///
/// Start-up never hurts a running deployment: everything that can fail is checked before the
/// first shard is claimed (claiming raises the epoch, which fences the current owner):
/// the topology and the owned shards are validated, the listeners are bound, every core and
/// mailbox Redis must answer, and every owned shard's watermark must be one this code can own.
///
/// A token secret shorter than [`tidemark_protocol::secret::MIN_SECRET_BYTES`] is refused
/// before anything starts.
pub async fn serve(opts: ServeOptions, cancel: CancellationToken) -> Result<Running, Error> {
    if let Some(secret) = &opts.gateway.token_secret {
        TokenSecret::new(secret, "the gateway options")?;
    }
    // before any worker counts anything
    let _ = crate::telemetry::metrics_handle();
    let map = opts.topology.validate()?;
    let owned: Vec<u32> = match &opts.owned_shards {
        Some(owned) => owned
            .iter()
            .map(|&s| map.check_shard(s))
            .collect::<Result<_, _>>()?,
        None => map.all_shards().collect(),
    };
    let listener = tokio::net::TcpListener::bind(opts.listen)
        .await
        .map_err(|source| Error::Listen {
            addr: opts.listen,
            source,
        })?;
    let admin = match opts.gateway.admin_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Listen { addr, source })?,
        ),
        None => None,
    };
    let mut mailboxes = Vec::new();
    for url in map.mailbox_urls() {
        mailboxes.push(Store::connect(url, map.layout()).await.map_err(|source| {
            Error::Connect {
                role: "mailbox",
                url: redact_url(url),
                source,
            }
        })?);
    }
    check_identity(&map).await?;
    init_missing(&map).await?;
    let health = Arc::new(HealthBoard::default());
    // every owned shard must be ownable by this code before any is claimed: a refusal (old
    // code on newer data) then fences nobody. New code starts with a corrupt shard: only that
    // shard stays stopped and is reported (the worker does not claim it).
    let mut cores = Vec::new();
    for url in map.core_urls() {
        cores.push(
            tidemark_store::redis::dlog::CoreStore::connect(url)
                .await
                .map_err(|source| Error::Connect {
                    role: "core",
                    url: redact_url(url),
                    source,
                })?,
        );
    }
    for &s in &owned {
        match mailboxes[map.mailbox_of(s)].check_claimable(s).await {
            Ok(wm) => {
                // a core instance restored behind the mailbox side: its head is below W, and
                // a new commit there would reuse a delivered offset (a replay, never
                // delivered). Raise the head before anything is served.
                let max_w = wm.lanes.max_present_w().unwrap_or(0);
                let core = &mut cores[map.core_of(s)];
                if let Some(old) = core.raise_head(s, max_w).await? {
                    tracing::error!(
                        shard = s,
                        head = old,
                        w = max_w,
                        "core log head was below W (core restored to an earlier point?); \
                         head raised to W so new commits follow it"
                    );
                    metrics::counter!("tidemark_head_raised_total").increment(1);
                }
            }
            Err(e) if e.is_corrupt() && map.layout() == Layout::PackedV2 => {}
            Err(e) => return Err(Error::Store(e)),
        }
    }
    let tracker = TaskTracker::new();
    let (err_tx, errors) = tokio::sync::mpsc::unbounded_channel();
    for core in 0..map.core_urls().len() {
        let shards: Vec<u32> = owned
            .iter()
            .copied()
            .filter(|&s| map.core_of(s) == core)
            .collect();
        if shards.is_empty() {
            continue;
        }
        // The first start is part of start-up (its errors stop `serve`); restarts are
        // supervised and retried.
        let worker = Worker::start(
            map.clone(),
            core,
            mailboxes.clone(),
            &shards,
            opts.materializer.clone(),
            health.clone(),
        )
        .await?;
        tracker.spawn(supervise_worker(
            worker,
            WorkerSpec {
                map: map.clone(),
                core,
                mailboxes: mailboxes.clone(),
                shards,
                opts: opts.materializer.clone(),
            },
            health.clone(),
            cancel.clone(),
        ));
    }
    let addr = listener.local_addr()?;
    let admin_addr = admin.as_ref().map(|a| a.local_addr()).transpose()?;
    let tls = opts.gateway.tls.is_some();
    let (c, tx, h, topo, gw) = (
        cancel.clone(),
        err_tx.clone(),
        health.clone(),
        map.clone(),
        opts.gateway.clone(),
    );
    tracker.spawn(async move {
        let outcome = tokio::spawn(gateway::serve_listeners(
            listener,
            admin,
            topo,
            gw,
            h,
            c.clone(),
        ))
        .await;
        if c.is_cancelled() {
            return;
        }
        // the gateway ended on its own: stop the whole service (the process exits non-zero)
        let ended = match outcome {
            Ok(Err(e)) => {
                let _ = tx.send(e.into());
                return;
            }
            Ok(Ok(())) => crate::supervise::Ended::Exited("returned".into()),
            Err(je) if je.is_panic() => crate::supervise::Ended::Panicked(
                crate::supervise::panic_message(je.into_panic().as_ref()),
            ),
            Err(je) => crate::supervise::Ended::Exited(je.to_string()),
        };
        tracing::error!(%ended, "gateway ended; stopping the service");
        let _ = tx.send(Error::TaskEnded {
            task: "gateway",
            ended,
        });
    });
    Ok(Running {
        addr,
        admin_addr,
        tls,
        health,
        tracker,
        cancel,
        errors,
    })
}

/// What a materializer worker is started from (again, after a panic).
struct WorkerSpec {
    map: ShardMap,
    /// The core instance (index in the map) whose logs the worker reads.
    core: usize,
    mailboxes: Vec<Store>,
    /// The owned shards of that core instance.
    shards: Vec<u32>,
    opts: MaterializerOptions,
}

/// Runs `first` and, whenever a worker panics or returns before `cancel`, reports its shards
/// down and starts a new one from `spec` (which re-claims the shards).
async fn supervise_worker(
    first: Worker,
    spec: WorkerSpec,
    health: Arc<HealthBoard>,
    cancel: CancellationToken,
) {
    let ids: Vec<u32> = spec.shards.clone();
    let mut first = Some(first);
    let spec = Arc::new(spec);
    let (h, c) = (health.clone(), cancel.clone());
    crate::supervise::supervise(
        "materializer",
        cancel.clone(),
        move || {
            let first = first.take();
            let (spec, health, cancel) = (spec.clone(), h.clone(), c.clone());
            async move {
                let worker = match first {
                    Some(w) => w,
                    None => {
                        Worker::start(
                            spec.map.clone(),
                            spec.core,
                            spec.mailboxes.clone(),
                            &spec.shards,
                            spec.opts.clone(),
                            health,
                        )
                        .await?
                    }
                };
                worker.run(cancel).await
            }
        },
        move |ended| {
            tracing::error!(shards = ?ids, %ended, "materializer worker down");
            health.mark_down(&ids, &format!("materializer worker {ended}; restarting"));
        },
    )
    .await;
}

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
}

/// A local deployment: its redis-server processes (killed with it) and the running service.
pub struct Up {
    /// The core instances.
    pub core: Vec<RedisProcess>,
    /// The mailbox instances.
    pub mailbox: Vec<RedisProcess>,
    /// The service.
    pub running: Running,
    /// The topology in use (its URLs carry the Redis password).
    pub topology: Topology,
    /// The file holding the password every instance requires.
    pub password_file: PathBuf,
}

impl Up {
    /// One line per endpoint: the gateway URL, then every Redis instance (without its
    /// password), then how to connect to them with `redis-cli` and `tidemark` tools — naming
    /// the password file, never printing the password.
    pub fn endpoint_lines(&self) -> Vec<String> {
        let mut v = vec![format!("gateway  {}", self.running.ws_url())];
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

/// The token secret's file name in a data dir.
pub const TOKEN_SECRET_FILE: &str = "token.secret";

/// The deployment file in a data dir: shards and instance counts are fixed at creation.
#[derive(serde::Serialize, serde::Deserialize, PartialEq, Eq, Debug)]
struct Deployment {
    shards: u32,
    core: usize,
    mailbox: usize,
    layout: Layout,
}

/// One path whose mode [`prepare_data_dir`] tightened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tightened {
    /// The file or directory.
    pub path: PathBuf,
    /// Its permission bits before.
    pub from: u32,
    /// Its permission bits now (group and other bits cleared).
    pub to: u32,
}

impl std::fmt::Display for Tightened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:04o} -> {:04o}",
            self.path.display(),
            self.from,
            self.to
        )
    }
}

/// Makes `data_dir` private: creates it with mode 0700 when missing; when it exists, removes
/// every group and other permission bit from it and from everything inside it (the secrets,
/// the deployment file, each instance's directory, AOF files and logs), without following
/// symbolic links. Returns what it changed (empty for a dir that was already private) so the
/// caller can say so; each change is also logged. A path that cannot be changed (another
/// owner) is an error naming the command that fixes it.
pub fn prepare_data_dir(data_dir: &Path) -> Result<Vec<Tightened>, Error> {
    use std::os::unix::fs::PermissionsExt;
    if !data_dir.exists() {
        tidemark_redis_proc::create_private_dir(data_dir)?;
        return Ok(Vec::new());
    }
    let mut changed = Vec::new();
    let mut stack = vec![data_dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path)?;
        if meta.file_type().is_symlink() {
            continue;
        }
        if meta.is_dir() {
            for e in std::fs::read_dir(&path)? {
                stack.push(e?.path());
            }
        }
        let from = meta.permissions().mode() & 0o7777;
        if from & 0o077 == 0 {
            continue;
        }
        let to = from & !0o077;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(to)).map_err(|e| {
            TopologyError::Invalid(format!(
                "{} is mode {from:04o} and cannot be made private ({e}); fix it with: \
                 chmod -R go-rwx {}",
                path.display(),
                data_dir.display()
            ))
        })?;
        let t = Tightened { path, from, to };
        tracing::warn!(change = %t, "data dir: removed group/other access");
        changed.push(t);
    }
    changed.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(changed)
}

/// Writes `contents` to a new or existing file with mode 0600.
fn write_private(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(contents)?;
    f.sync_all()
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

/// Makes `data_dir` private ([`prepare_data_dir`]), starts `core + mailbox` redis-server
/// processes under it, each requiring the data dir's password
/// ([`load_or_create_redis_password`]), initialises the shards and serves. Must be called from the thread that will outlive the processes (the
/// parent-death signal is bound to the spawning thread): call it from `main`'s `block_on`.
pub async fn up(opts: UpOptions, cancel: CancellationToken) -> Result<Up, Error> {
    prepare_data_dir(&opts.data_dir)?;
    check_deployment(
        &opts.data_dir,
        &Deployment {
            shards: opts.shards,
            core: opts.core,
            mailbox: opts.mailbox,
            layout: opts.layout,
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
    let core: Vec<RedisProcess> = (0..opts.core)
        .map(|i| start(format!("core-{i}")))
        .collect::<Result<_, _>>()?;
    let mailbox: Vec<RedisProcess> = (0..opts.mailbox)
        .map(|i| start(format!("mailbox-{i}")))
        .collect::<Result<_, _>>()?;
    let topology = Topology::new(
        opts.shards,
        opts.layout,
        core.iter().map(|p| p.url()).collect(),
        mailbox.iter().map(|p| p.url()).collect(),
    );
    // for read-only tools: `tidemark trace --config <data dir>/tidemark.toml` (0600: the URLs
    // carry the Redis password)
    let text = toml::to_string(&topology).map_err(|e| TopologyError::Invalid(e.to_string()))?;
    write_private(
        &opts.data_dir.join(UP_TOPOLOGY_FILE),
        format!(
            "# written by `tidemark up` at every start (ports change): for read-only tools\n\
             # such as `tidemark trace --config`. Do not `serve --config` it while `up` runs.\n{text}"
        )
        .as_bytes(),
    )?;
    let running = serve(
        ServeOptions {
            topology: topology.clone(),
            listen: opts.listen,
            gateway: opts.gateway.clone(),
            materializer: opts.materializer.clone(),
            owned_shards: None,
        },
        cancel,
    )
    .await?;
    Ok(Up {
        core,
        mailbox,
        running,
        topology,
        password_file: opts.data_dir.join(REDIS_PASSWORD_FILE),
    })
}

/// The password file's name in a data dir.
pub const REDIS_PASSWORD_FILE: &str = "redis.pass";

/// The password of `up`'s redis-servers: `<data_dir>/redis.pass` (whitespace trimmed),
/// created when missing (mode 0600, 32 random bytes as 64 hex digits) and reused by every
/// later `up` of the data dir. A file that holds no usable password (1..=512 of
/// `A-Z a-z 0-9 - . _ ~`) is refused.
pub fn load_or_create_redis_password(data_dir: &Path) -> Result<String, Error> {
    use std::io::Read;
    let path = data_dir.join(REDIS_PASSWORD_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let p = text.trim();
            if !tidemark_redis_proc::valid_password(p) {
                return Err(TopologyError::Invalid(format!(
                    "{} holds no usable redis password (1..=512 characters of A-Z a-z 0-9 - . _ \
                     ~); remove it and the next `up` creates a new one",
                    path.display()
                ))
                .into());
            }
            Ok(p.to_string())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tidemark_redis_proc::create_private_dir(data_dir)?;
            let mut raw = [0u8; 32];
            std::fs::File::open("/dev/urandom")?.read_exact(&mut raw)?;
            let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
            write_private(&path, hex.as_bytes())?;
            Ok(hex)
        }
        Err(e) => Err(e.into()),
    }
}

/// The token secret of a data dir: `<data_dir>/token.secret`, read under the loader's rule
/// (at least 32 bytes after trimming; an empty or short file is refused, never rewritten) or
/// created (mode 0600, 32 random bytes in hex) when missing.
pub fn load_or_create_secret(data_dir: &Path) -> Result<TokenSecret, Error> {
    tidemark_redis_proc::create_private_dir(data_dir)?;
    Ok(tidemark_protocol::secret::load_or_create(
        &data_dir.join(TOKEN_SECRET_FILE),
    )?)
}
