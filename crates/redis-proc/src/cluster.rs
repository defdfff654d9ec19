//! A local Redis Cluster of real `redis-server` processes, owned by one Rust value.
//!
//! [`RedisCluster::start`] starts `primaries × (1 + replicas_per_primary)` servers with
//! `--cluster-enabled yes` (each a [`RedisProcess`] in its own directory `node-<i>` under the
//! base directory), joins them with `redis-cli --cluster create`, and returns only once the
//! cluster is *consistent* (see [`RedisCluster::wait_consistent`]): every node says
//! `cluster_state:ok` with all 16384 slots assigned, all nodes agree on who owns which slot and
//! who replicates whom, no slot is half-migrated, and every replica finished its initial sync.
//!
//! Two users:
//!
//! * `tidemark up --cluster`: a newcomer's local cluster, kept in a directory across restarts.
//!   Once a cluster was created, its base directory holds [`CLUSTER_LAYOUT_FILE`] (size and
//!   ports); a later [`RedisCluster::start`] on that directory starts the same nodes again on
//!   the same ports (each reloads its `nodes.conf`, and its AOF with `appendonly`) instead of
//!   creating a new cluster.
//! * tests (issue 14: Redis Cluster, resharding, losing a primary): throw-away clusters in a
//!   temporary directory, with faults ([`kill9`](RedisCluster::kill9),
//!   [`restart`](RedisCluster::restart), [`pause`](RedisCluster::pause),
//!   [`wait_failover`](RedisCluster::wait_failover)) and slot moves
//!   ([`reshard`](RedisCluster::reshard) through `redis-cli`, [`move_slot`](RedisCluster::move_slot)
//!   step by step, so a test can move the slot of one shard key while traffic flows).
//!
//! Ports: client ports are picked in [`CLUSTER_PORT_RANGE`] (12000..22000), so the cluster bus
//! port (`port + 10000`, 22000..32000) can never be another node's client port, and neither
//! lies in Linux' ephemeral range (32768..60999 by default), where outgoing connections and
//! every [`free_port`](crate::free_port) of other tests land; both are
//! checked free before a node starts (see [`free_cluster_ports`]), and a node that loses the
//! race for its port is started again on another one.
//!
//! Passwords: with [`ClusterOptions::requirepass`], every node requires it and also uses it as
//! `masterauth` (replicas authenticate to their primary). It never appears on a command line:
//! redis-server reads it from stdin (as for every [`RedisProcess`]) and `redis-cli` gets it in
//! `REDISCLI_AUTH`; `MIGRATE` sends it with `AUTH`.
//!
//! Roles are never cached: failovers change them, so [`RedisCluster::role`],
//! [`primaries`](RedisCluster::primaries), [`primary_of_slot`](RedisCluster::primary_of_slot)…
//! ask the running nodes (`ROLE`, `CLUSTER NODES`) each time. Node indices are stable: node `i`
//! keeps its port, directory and cluster node id for the life of the value (and of its base
//! directory).
//!
//! Dropping the value SIGKILLs and reaps every node (also while a test unwinds from a panic,
//! also a paused node), then removes a temporary base directory. As for every
//! [`RedisProcess`], the nodes also get a parent-death signal bound to the *thread* that
//! started them (or last restarted them): start a cluster from a thread that outlives it.

use std::collections::{BTreeSet, HashSet};
use std::net::{SocketAddr, TcpListener};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::resp::{Conn, Value};
use crate::{
    create_private_dir, redis_server_available, valid_password, Error, RedisOptions, RedisProcess,
};

/// Number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// Written into the base directory once a cluster was created there: its size and ports. Its
/// presence is what makes [`RedisCluster::start`] restart that cluster instead of creating one.
pub const CLUSTER_LAYOUT_FILE: &str = "cluster.layout";

/// Each node's cluster configuration file, in its own directory (written by redis-server).
pub const NODES_CONF: &str = "nodes.conf";

/// Where [`free_cluster_ports`] picks client ports; the bus ports are 10000 higher
/// (22000..32000). Both stay below Linux' default ephemeral range (32768..60999).
pub const CLUSTER_PORT_RANGE: Range<u16> = 12000..22000;

/// The offset of the cluster bus port from the client port (Redis' default).
const BUS_OFFSET: u16 = 10000;

/// Read and write timeout of the harness' own connections to a node.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// Keys per `MIGRATE` in [`RedisCluster::move_slot`].
const MIGRATE_BATCH: usize = 100;

/// How to start a [`RedisCluster`].
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Number of primaries (at least 3, as `redis-cli --cluster create` requires).
    pub primaries: usize,
    /// Replicas of each primary.
    pub replicas_per_primary: usize,
    /// Where the nodes live (`node-<i>/` each, plus [`CLUSTER_LAYOUT_FILE`]); `None` uses a
    /// private temporary directory removed on drop. A directory that already holds a cluster
    /// is restarted, not re-created.
    pub base_dir: Option<PathBuf>,
    /// The nodes' client ports (one per node, each below 55536: the bus port is 10000
    /// higher); `None` picks free ones in [`CLUSTER_PORT_RANGE`]. When `base_dir` holds a
    /// cluster already, its stored ports are used, and ports given here must equal them.
    pub ports: Option<Vec<u16>>,
    /// Password of every node (`requirepass`, and `masterauth` for the replicas).
    pub requirepass: Option<String>,
    /// `cluster-node-timeout` in milliseconds: how long a node may be unreachable before a
    /// failover starts. Tests use small values (1000).
    pub node_timeout_ms: u64,
    /// Turn on each node's append-only file.
    pub appendonly: bool,
    /// `appendfsync` policy when `appendonly` is on.
    pub appendfsync: String,
    /// Extra `--name value` arguments for every node (after the harness' own, so they win).
    pub extra: Vec<(String, String)>,
    /// Deadline of every wait: start, restart of a node, failover, resharding.
    pub timeout: Duration,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            primaries: 3,
            replicas_per_primary: 1,
            base_dir: None,
            ports: None,
            requirepass: None,
            node_timeout_ms: 5000,
            appendonly: false,
            appendfsync: "everysec".into(),
            extra: Vec::new(),
            timeout: Duration::from_secs(30),
        }
    }
}

impl ClusterOptions {
    /// Number of nodes: `primaries * (1 + replicas_per_primary)`.
    pub fn node_count(&self) -> usize {
        self.primaries * (1 + self.replicas_per_primary)
    }
}

/// A node's current role, as the node itself says (`ROLE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    /// `primary` is the index of the node it replicates, `None` when that is not one of ours.
    Replica {
        primary: Option<usize>,
    },
    /// Killed, paused, or not answering.
    Down,
}

/// One node, as [`RedisCluster::nodes`] sees it now.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub index: usize,
    /// Cluster node id (40 hex characters; stable across restarts).
    pub id: String,
    pub port: u16,
    /// With the password (see [`RedisProcess::url`]).
    pub url: String,
    /// Without the password.
    pub display_url: String,
    pub role: Role,
}

struct Node {
    proc: RedisProcess,
    id: String,
    /// Not killed by [`RedisCluster::kill9`] (and not yet restarted).
    running: bool,
    paused: bool,
    /// Its replicas when it was killed or paused: the candidates of [`RedisCluster::wait_failover`].
    replicas_when_stopped: Vec<usize>,
}

/// A running local Redis Cluster; every node is killed and reaped on drop.
pub struct RedisCluster {
    nodes: Vec<Node>,
    opts: ClusterOptions,
    base: PathBuf,
    reused: bool,
    /// Declared after `nodes`: removed after every process is gone.
    _tmp: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for RedisCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCluster")
            .field("base", &self.base)
            .field(
                "nodes",
                &self
                    .nodes
                    .iter()
                    .map(|n| (n.proc.port(), &n.id, n.running, n.paused))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// True when `redis-cli` can be started from `PATH`.
pub fn redis_cli_available() -> bool {
    Command::new("redis-cli")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The hash slot of `key`: CRC16 (XMODEM) of the key, or of its hash tag — the bytes between
/// the first `{` and the first `}` after it, when there are any — modulo 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16_xmodem(hashed) % SLOTS
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// True when both `port` and `port + 10000` can be bound on 127.0.0.1 right now.
fn cluster_port_free(port: u16) -> bool {
    let Some(bus) = port.checked_add(BUS_OFFSET) else {
        return false;
    };
    TcpListener::bind(("127.0.0.1", port)).is_ok() && TcpListener::bind(("127.0.0.1", bus)).is_ok()
}

/// `n` distinct client ports in [`CLUSTER_PORT_RANGE`], tried at random, each free on
/// 127.0.0.1 together with its bus port (`port + 10000`) at the time of the check.
pub fn free_cluster_ports(n: usize) -> std::io::Result<Vec<u16>> {
    free_cluster_ports_except(n, &HashSet::new())
}

fn free_cluster_ports_except(n: usize, taken: &HashSet<u16>) -> std::io::Result<Vec<u16>> {
    let span = (CLUSTER_PORT_RANGE.end - CLUSTER_PORT_RANGE.start) as u64;
    let mut out: Vec<u16> = Vec::with_capacity(n);
    let mut tries = 0;
    while out.len() < n {
        tries += 1;
        if tries > 5000 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                format!("no {n} free port pairs (port, port+10000) in {CLUSTER_PORT_RANGE:?}"),
            ));
        }
        let p = CLUSTER_PORT_RANGE.start + (random_u64() % span) as u16;
        if !out.contains(&p) && !taken.contains(&p) && cluster_port_free(p) {
            out.push(p);
        }
    }
    Ok(out)
}

/// One free client port for a cluster node (see [`free_cluster_ports`]).
pub fn free_cluster_port() -> std::io::Result<u16> {
    Ok(free_cluster_ports(1)?[0])
}

/// What [`CLUSTER_LAYOUT_FILE`] records.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Layout {
    primaries: usize,
    replicas_per_primary: usize,
    ports: Vec<u16>,
}

impl Layout {
    fn render(&self) -> String {
        format!(
            "# A local Redis Cluster created by tidemark (crates/redis-proc/src/cluster.rs).\n\
             # Its nodes live in node-<i>/ and are restarted on these ports.\n\
             primaries {}\nreplicas_per_primary {}\nports {}\n",
            self.primaries,
            self.replicas_per_primary,
            self.ports
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        )
    }

    fn parse(text: &str) -> Option<Layout> {
        let (mut primaries, mut replicas, mut ports) = (None, None, None);
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (k, v) = line.split_once(' ')?;
            match k {
                "primaries" => primaries = Some(v.trim().parse().ok()?),
                "replicas_per_primary" => replicas = Some(v.trim().parse().ok()?),
                "ports" => {
                    ports = Some(
                        v.split_whitespace()
                            .map(|p| p.parse().ok())
                            .collect::<Option<Vec<u16>>>()?,
                    )
                }
                _ => return None,
            }
        }
        let l = Layout {
            primaries: primaries?,
            replicas_per_primary: replicas?,
            ports: ports?,
        };
        (l.ports.len() == l.primaries * (1 + l.replicas_per_primary)).then_some(l)
    }
}

fn check_ports(ports: &[u16], n: usize) -> Result<(), Error> {
    if ports.len() != n {
        return Err(Error::BadClusterOptions(format!(
            "{} ports given for {n} nodes",
            ports.len()
        )));
    }
    for &p in ports {
        if p == 0 || p > u16::MAX - BUS_OFFSET {
            return Err(Error::BadClusterOptions(format!(
                "port {p}: a cluster node's port must be 1..=55535 (its bus port is port+10000)"
            )));
        }
        if ports.iter().filter(|&&q| q == p).count() > 1 {
            return Err(Error::BadClusterOptions(format!("port {p} given twice")));
        }
        if ports.contains(&(p + BUS_OFFSET)) {
            return Err(Error::BadClusterOptions(format!(
                "port {} is the bus port of port {p}",
                p + BUS_OFFSET
            )));
        }
    }
    Ok(())
}

fn validate(opts: &ClusterOptions) -> Result<(), Error> {
    if opts.primaries < 3 {
        return Err(Error::BadClusterOptions(format!(
            "{} primaries: Redis Cluster needs at least 3",
            opts.primaries
        )));
    }
    if opts.node_timeout_ms == 0 {
        return Err(Error::BadClusterOptions(
            "node_timeout_ms must be positive".into(),
        ));
    }
    if opts
        .requirepass
        .as_deref()
        .is_some_and(|p| !valid_password(p))
    {
        return Err(Error::BadPassword);
    }
    if let Some(ports) = &opts.ports {
        check_ports(ports, opts.node_count())?;
    }
    Ok(())
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
struct NodeLine {
    id: String,
    port: u16,
    flags: Vec<String>,
    master: Option<String>,
    epoch: u64,
    slots: Vec<(u16, u16)>,
    /// Migrating/importing slots (`[slot->-id]`, `[slot-<-id]`).
    open: Vec<String>,
}

impl NodeLine {
    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
    fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
    }
}

fn parse_cluster_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            // ip:port@cport[,hostname]
            let hostport = f[1].split(['@', ',']).next().unwrap_or("");
            let port = hostport.rsplit(':').next()?.parse().unwrap_or(0);
            let mut slots = Vec::new();
            let mut open = Vec::new();
            for s in &f[8..] {
                if s.starts_with('[') {
                    open.push(s.to_string());
                } else if let Some((a, b)) = s.split_once('-') {
                    slots.push((a.parse().ok()?, b.parse().ok()?));
                } else {
                    let x = s.parse().ok()?;
                    slots.push((x, x));
                }
            }
            Some(NodeLine {
                id: f[0].to_string(),
                port,
                flags: f[2].split(',').map(str::to_string).collect(),
                master: (f[3] != "-").then(|| f[3].to_string()),
                epoch: f[6].parse().unwrap_or(0),
                slots,
                open,
            })
        })
        .collect()
}

/// `name:value` of an `INFO`-style reply.
fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// How many times [`RedisCluster::start`] starts a new cluster that does not form.
pub const START_ATTEMPTS: u32 = 3;

/// `redis-cli ARGS`, the password (if any) in `REDISCLI_AUTH`, its output captured.
fn cli_command(password: Option<&str>, args: &[String]) -> Command {
    let mut cmd = Command::new("redis-cli");
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match password {
        Some(p) => cmd.env("REDISCLI_AUTH", p),
        None => cmd.env_remove("REDISCLI_AUTH"),
    };
    cmd
}

/// `redis-cli ARGS` judged as [`cli_result`] does, killed and failed with
/// [`Error::ClusterCli`] if it has not exited within `limit` (`--cluster create` waits for
/// ever for a cluster that does not join).
fn cli_within(
    password: Option<&str>,
    step: &'static str,
    args: &[String],
    limit: Duration,
) -> Result<String, Error> {
    let mut child = cli_command(password, args).spawn()?;
    let deadline = std::time::Instant::now() + limit;
    while child.try_wait()?.is_none() {
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output()?;
            return Err(Error::ClusterCli {
                step,
                output: format!(
                    "timed out after {limit:?}: {}",
                    tail(&String::from_utf8_lossy(&out.stdout), 4)
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    cli_result(step, child.wait_with_output()?)
}

/// `redis-cli`'s output as [`RedisCluster::redis_cli`] judges it: its text, or
/// [`Error::ClusterCli`] unless it exited 0 with no `[ERR]` line.
fn cli_result(step: &'static str, out: std::process::Output) -> Result<String, Error> {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // redis-cli --cluster reports some failures ("[ERR] …") with exit code 0
    let err_line = text.lines().any(|l| l.starts_with("[ERR]"));
    if !out.status.success() || err_line {
        return Err(Error::ClusterCli {
            step,
            output: format!("{}: {}", out.status, tail(&text, 8)),
        });
    }
    Ok(text)
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(lines)..].join(" | ")
}

impl RedisCluster {
    /// Starts the cluster (or restarts the one in `opts.base_dir`) and waits until it is
    /// consistent ([`wait_consistent`](Self::wait_consistent)), at most `opts.timeout`.
    ///
    /// A new cluster on ports of its own choosing (no `base_dir`, no `ports`) that does not
    /// form (`redis-cli --cluster create` failing or timing out, or no consistent view in
    /// time) is started again from scratch on other ports, up to [`START_ATTEMPTS`] times:
    /// nodes of another cluster on the same box that were stopped a moment ago (another
    /// test's, on ports picked again here) can still gossip to ports now ours, and a node
    /// that learns of them never lets `--cluster create` finish. That hung a CI-like run
    /// for minutes; each attempt is now bounded by `opts.timeout`.
    pub fn start(opts: ClusterOptions) -> Result<RedisCluster, Error> {
        if opts.base_dir.is_some() || opts.ports.is_some() {
            return RedisCluster::start_once(opts);
        }
        let mut attempt = 1;
        loop {
            match RedisCluster::start_once(opts.clone()) {
                Err(e @ (Error::ClusterCli { .. } | Error::ClusterNotReady { .. }))
                    if attempt < START_ATTEMPTS =>
                {
                    eprintln!("redis cluster did not form ({e}); starting again on other ports");
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    fn start_once(opts: ClusterOptions) -> Result<RedisCluster, Error> {
        validate(&opts)?;
        if !redis_server_available() {
            return Err(Error::NotInstalled);
        }
        if !redis_cli_available() {
            return Err(Error::CliNotInstalled);
        }
        let n = opts.node_count();
        let (base, tmp) = match &opts.base_dir {
            Some(d) => {
                create_private_dir(d)?;
                (std::fs::canonicalize(d)?, None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("tidemark-cluster-")
                    .tempdir()?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let layout_path = base.join(CLUSTER_LAYOUT_FILE);
        let stored = match std::fs::read_to_string(&layout_path) {
            Ok(text) => Some(Layout::parse(&text).ok_or_else(|| {
                Error::BadClusterOptions(format!("{} is not readable", layout_path.display()))
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e.into()),
        };
        let (ports, reused) = match stored {
            Some(l) => {
                if l.primaries != opts.primaries
                    || l.replicas_per_primary != opts.replicas_per_primary
                {
                    return Err(Error::BadClusterOptions(format!(
                        "{} holds a cluster of {} primaries with {} replicas each, not {} with {} \
                         (use another directory)",
                        base.display(),
                        l.primaries,
                        l.replicas_per_primary,
                        opts.primaries,
                        opts.replicas_per_primary
                    )));
                }
                if opts.ports.as_ref().is_some_and(|p| *p != l.ports) {
                    return Err(Error::BadClusterOptions(format!(
                        "{} holds a cluster on ports {:?}, not {:?}",
                        base.display(),
                        l.ports,
                        opts.ports.as_ref().unwrap()
                    )));
                }
                check_ports(&l.ports, n)?;
                (l.ports, true)
            }
            None => {
                // No cluster was completed here: a nodes.conf left by an aborted start would
                // make the node refuse to join a new cluster.
                for i in 0..n {
                    match std::fs::remove_file(base.join(node_dir_name(i)).join(NODES_CONF)) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
                        _ => {}
                    }
                }
                let ports = match &opts.ports {
                    Some(p) => p.clone(),
                    None => free_cluster_ports(n)?,
                };
                (ports, false)
            }
        };
        let fixed_ports = reused || opts.ports.is_some();
        let mut procs: Vec<RedisProcess> = Vec::with_capacity(n);
        let mut used: HashSet<u16> = ports.iter().copied().collect();
        for (i, &port) in ports.iter().enumerate() {
            let mut port = port;
            let mut attempt = 0;
            let p = loop {
                attempt += 1;
                match RedisProcess::start_with(node_options(&opts, &base, i, port)) {
                    Ok(p) => break p,
                    // lost the race for a port we picked: pick another
                    Err(Error::NotReady { .. }) if !fixed_ports && attempt < 5 => {
                        port = free_cluster_ports_except(1, &used)?[0];
                        used.insert(port);
                    }
                    Err(e) => return Err(e),
                }
            };
            procs.push(p);
        }
        let ports: Vec<u16> = procs.iter().map(|p| p.port()).collect();
        let mut nodes = Vec::with_capacity(n);
        for proc in procs {
            let mut c = Conn::connect(proc.addr(), opts.requirepass.as_deref(), IO_TIMEOUT)?;
            let id = expect_text(&mut c, &["CLUSTER", "MYID"])?;
            nodes.push(Node {
                proc,
                id,
                running: true,
                paused: false,
                replicas_when_stopped: Vec::new(),
            });
        }
        let cluster = RedisCluster {
            nodes,
            opts,
            base,
            reused,
            _tmp: tmp,
        };
        if !reused {
            let mut args: Vec<String> = vec!["--cluster".into(), "create".into()];
            args.extend(ports.iter().map(|p| format!("127.0.0.1:{p}")));
            args.extend([
                "--cluster-replicas".into(),
                cluster.opts.replicas_per_primary.to_string(),
                "--cluster-yes".into(),
            ]);
            cluster.redis_cli_within("create", &args, cluster.opts.timeout)?;
        }
        let what = if reused {
            "restarted cluster consistent"
        } else {
            "new cluster consistent"
        };
        cluster.wait_consistent_for(what, cluster.opts.timeout)?;
        if !reused {
            let layout = Layout {
                primaries: cluster.opts.primaries,
                replicas_per_primary: cluster.opts.replicas_per_primary,
                ports,
            };
            let tmp_path = cluster.base.join(format!("{CLUSTER_LAYOUT_FILE}.tmp"));
            std::fs::write(&tmp_path, layout.render())?;
            std::fs::rename(&tmp_path, &layout_path)?;
        }
        Ok(cluster)
    }

    /// [`cli_within`] with this cluster's password.
    fn redis_cli_within(
        &self,
        step: &'static str,
        args: &[String],
        limit: Duration,
    ) -> Result<String, Error> {
        cli_within(self.opts.requirepass.as_deref(), step, args, limit)
    }

    /// Runs `redis-cli ARGS` (password in `REDISCLI_AUTH`), failing with
    /// [`Error::ClusterCli`] unless it exits 0.
    fn redis_cli(&self, step: &'static str, args: &[String]) -> Result<String, Error> {
        let out = cli_command(self.opts.requirepass.as_deref(), args).output()?;
        cli_result(step, out)
    }

    /// Number of nodes.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// The options the cluster was started with.
    pub fn options(&self) -> &ClusterOptions {
        &self.opts
    }

    /// The base directory (`node-<i>/` and [`CLUSTER_LAYOUT_FILE`]).
    pub fn base_dir(&self) -> &Path {
        &self.base
    }

    /// True when [`start`](Self::start) restarted a cluster found in the base directory.
    pub fn reused_existing(&self) -> bool {
        self.reused
    }

    /// The password of every node, if any.
    pub fn password(&self) -> Option<&str> {
        self.opts.requirepass.as_deref()
    }

    fn node(&self, i: usize) -> Result<&Node, Error> {
        self.nodes.get(i).ok_or_else(|| {
            Error::ClusterUsage(format!("no node {i}: the cluster has {}", self.nodes.len()))
        })
    }

    fn node_mut(&mut self, i: usize) -> Result<&mut Node, Error> {
        let len = self.nodes.len();
        self.nodes
            .get_mut(i)
            .ok_or_else(|| Error::ClusterUsage(format!("no node {i}: the cluster has {len}")))
    }

    /// Node `i`'s process (port, directory, log, pid). Panics when `i` is out of range, as do
    /// the other per-node accessors.
    pub fn process(&self, i: usize) -> &RedisProcess {
        &self.nodes[i].proc
    }

    /// Node `i`'s client port.
    pub fn port(&self, i: usize) -> u16 {
        self.nodes[i].proc.port()
    }

    /// Node `i`'s address.
    pub fn addr(&self, i: usize) -> SocketAddr {
        self.nodes[i].proc.addr()
    }

    /// Node `i`'s URL, with the password (see [`RedisProcess::url`]).
    pub fn url(&self, i: usize) -> String {
        self.nodes[i].proc.url()
    }

    /// Node `i`'s cluster node id.
    pub fn node_id(&self, i: usize) -> &str {
        &self.nodes[i].id
    }

    /// The index of the node with this cluster node id.
    pub fn index_of_id(&self, id: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    /// The index of the node listening on this port.
    pub fn index_of_port(&self, port: u16) -> Option<usize> {
        self.nodes.iter().position(|n| n.proc.port() == port)
    }

    /// Whether node `i` runs and is not paused (it may still be failing for another reason).
    pub fn is_up(&self, i: usize) -> bool {
        self.nodes[i].running && !self.nodes[i].paused
    }

    /// The URL of every node, with the password: seeds for a cluster client (any one is
    /// enough to discover the others). Killed nodes are included: the list is for a
    /// client's configuration, which outlives a fault.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.proc.url()).collect()
    }

    /// [`seeds`](Self::seeds) without the password (for output and logs).
    pub fn display_seeds(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.proc.display_url()).collect()
    }

    /// A connection to node `i` (authenticated when the cluster has a password).
    pub fn conn(&self, i: usize) -> Result<Conn, Error> {
        let n = self.node(i)?;
        Ok(Conn::connect(n.proc.addr(), self.password(), IO_TIMEOUT)?)
    }

    /// One command on node `i`, on a fresh connection. An error reply (such as `MOVED`) is a
    /// [`Value::Error`], not an `Err`.
    pub fn call<A: AsRef<[u8]>>(&self, i: usize, args: &[A]) -> Result<Value, Error> {
        Ok(self.conn(i)?.call(args)?)
    }

    /// One command sent to the cluster like a cluster client would: to a running node first,
    /// then following `MOVED` and `ASK` redirects (and retrying `TRYAGAIN`, `CLUSTERDOWN`,
    /// `LOADING` for a while). Returns the final reply, which may be an error reply.
    pub fn call_routed<A: AsRef<[u8]>>(&self, args: &[A]) -> Result<Value, Error> {
        let first = (0..self.nodes.len())
            .find(|&i| self.is_up(i))
            .ok_or_else(|| Error::ClusterUsage("no node is running".into()))?;
        let mut addr = self.addr(first);
        let mut asking = false;
        let mut last = Value::Nil;
        for _ in 0..40 {
            let mut c = Conn::connect(addr, self.password(), IO_TIMEOUT)?;
            if asking {
                c.call(&["ASKING"])?;
            }
            last = c.call(args)?;
            let Value::Error(e) = &last else {
                return Ok(last);
            };
            let mut words = e.split_whitespace();
            match words.next() {
                Some("MOVED") | Some("ASK") => {
                    asking = e.starts_with("ASK");
                    addr = words.nth(1).and_then(|a| a.parse().ok()).ok_or_else(|| {
                        Error::ClusterCommand {
                            addr,
                            command: command_text(args),
                            reply: e.clone(),
                        }
                    })?;
                }
                Some("TRYAGAIN") | Some("CLUSTERDOWN") | Some("LOADING") => {
                    asking = false;
                    std::thread::sleep(Duration::from_millis(50));
                }
                _ => return Ok(last),
            }
        }
        Ok(last)
    }

    /// Node `i`'s role now (`ROLE`); [`Role::Down`] when it is killed, paused or not answering.
    pub fn role(&self, i: usize) -> Role {
        if !self.is_up(i) {
            return Role::Down;
        }
        let Ok(Value::Array(items)) = self.call(i, &["ROLE"]) else {
            return Role::Down;
        };
        match items.first().and_then(Value::text).as_deref() {
            Some("master") => Role::Primary,
            Some("slave") => Role::Replica {
                primary: items
                    .get(2)
                    .and_then(Value::int)
                    .and_then(|p| u16::try_from(p).ok())
                    .and_then(|p| self.index_of_port(p)),
            },
            _ => Role::Down,
        }
    }

    /// Every node with its current role.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        (0..self.nodes.len())
            .map(|i| NodeInfo {
                index: i,
                id: self.nodes[i].id.clone(),
                port: self.port(i),
                url: self.url(i),
                display_url: self.nodes[i].proc.display_url(),
                role: self.role(i),
            })
            .collect()
    }

    /// The nodes that are primaries now.
    pub fn primaries(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.role(i) == Role::Primary)
            .collect()
    }

    /// The nodes that are replicas now.
    pub fn replicas(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| matches!(self.role(i), Role::Replica { .. }))
            .collect()
    }

    /// The nodes that replicate node `primary` now.
    pub fn replicas_of(&self, primary: usize) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| {
                self.role(i)
                    == Role::Replica {
                        primary: Some(primary),
                    }
            })
            .collect()
    }

    /// Node `i`'s own `CLUSTER NODES` line (`myself`).
    fn myself(&self, i: usize) -> Option<NodeLine> {
        if !self.is_up(i) {
            return None;
        }
        let text = self.call(i, &["CLUSTER", "NODES"]).ok()?.text()?;
        parse_cluster_nodes(&text)
            .into_iter()
            .find(|l| l.has("myself"))
    }

    /// The slots node `i` says it serves now (empty for a replica or a node that is down).
    pub fn slots_of(&self, i: usize) -> Vec<u16> {
        match self.myself(i) {
            Some(l) if l.has("master") => l.slots.iter().flat_map(|&(a, b)| a..=b).collect(),
            _ => Vec::new(),
        }
    }

    /// The running primary that serves `slot` now, by the primaries' own claims (when two
    /// claim it during a transition, the one with the higher config epoch, as Redis decides).
    pub fn primary_of_slot(&self, slot: u16) -> Option<usize> {
        (0..self.nodes.len())
            .filter_map(|i| Some((i, self.myself(i)?)))
            .filter(|(_, l)| l.has("master") && l.owns(slot))
            .max_by_key(|(_, l)| l.epoch)
            .map(|(i, _)| i)
    }

    /// Why the cluster is not consistent now, or `Ok` (see [`wait_consistent`](Self::wait_consistent)).
    fn check_consistent(&self) -> Result<(), String> {
        let n = self.nodes.len();
        let up: Vec<usize> = (0..n).filter(|&i| self.is_up(i)).collect();
        if up.is_empty() {
            return Err("no node is running".into());
        }
        let up_ids: HashSet<&str> = up.iter().map(|&i| self.nodes[i].id.as_str()).collect();
        type View = (Vec<(u16, u16, String)>, Vec<(String, bool, Option<String>)>);
        let mut views: Vec<(usize, View)> = Vec::new();
        for &i in &up {
            let who = format!("node {i} (port {})", self.port(i));
            let mut c = self.conn(i).map_err(|e| format!("{who}: {e}"))?;
            let mut text = |args: &[&str]| -> Result<String, String> {
                match c.call(args) {
                    Ok(v) => v
                        .text()
                        .ok_or_else(|| format!("{who}: {} replied {v:?}", args.join(" "))),
                    Err(e) => Err(format!("{who}: {}: {e}", args.join(" "))),
                }
            };
            let info = text(&["CLUSTER", "INFO"])?;
            let field = |name| info_field(&info, name).unwrap_or("?");
            if field("cluster_state") != "ok" {
                return Err(format!(
                    "{who} says cluster_state:{}",
                    field("cluster_state")
                ));
            }
            if field("cluster_slots_assigned") != "16384" {
                return Err(format!(
                    "{who} says cluster_slots_assigned:{}",
                    field("cluster_slots_assigned")
                ));
            }
            if field("cluster_known_nodes") != n.to_string() {
                return Err(format!(
                    "{who} knows {} nodes of {n}",
                    field("cluster_known_nodes")
                ));
            }
            let lines = parse_cluster_nodes(&text(&["CLUSTER", "NODES"])?);
            for l in &lines {
                if let Some(open) = l.open.first() {
                    return Err(format!("{who} has an open slot: {open}"));
                }
                if up_ids.contains(l.id.as_str()) {
                    if let Some(f) = l
                        .flags
                        .iter()
                        .find(|f| matches!(f.as_str(), "fail" | "fail?" | "handshake" | "noaddr"))
                    {
                        return Err(format!(
                            "{who} sees the running node on port {} as {f}",
                            l.port
                        ));
                    }
                }
            }
            let me = lines
                .iter()
                .find(|l| l.has("myself"))
                .ok_or_else(|| format!("{who}: no 'myself' line in CLUSTER NODES"))?;
            if me.has("slave") {
                let repl = text(&["INFO", "replication"])?;
                let link = info_field(&repl, "master_link_status").unwrap_or("?");
                let syncing = info_field(&repl, "master_sync_in_progress").unwrap_or("?");
                if link != "up" || syncing != "0" {
                    return Err(format!(
                        "replica {who}: master_link_status:{link} master_sync_in_progress:{syncing}"
                    ));
                }
            }
            let mut slots: Vec<(u16, u16, String)> = lines
                .iter()
                .filter(|l| l.has("master"))
                .flat_map(|l| l.slots.iter().map(|&(a, b)| (a, b, l.id.clone())))
                .collect();
            slots.sort();
            let mut roles: Vec<(String, bool, Option<String>)> = lines
                .iter()
                .filter(|l| up_ids.contains(l.id.as_str()))
                .map(|l| (l.id.clone(), l.has("master"), l.master.clone()))
                .collect();
            roles.sort();
            views.push((i, (slots, roles)));
        }
        let (first, view) = &views[0];
        if let Some((other, _)) = views.iter().find(|(_, v)| v != view) {
            return Err(format!(
                "nodes {first} and {other} disagree about slots or roles"
            ));
        }
        Ok(())
    }

    /// Waits (at most the `timeout` of the options) until the cluster is consistent, judged by
    /// the running, unpaused nodes: each says `cluster_state:ok`, all 16384 slots assigned and
    /// knows every node; none sees another running node as failing; all agree on the slot
    /// owners and on the roles of the running nodes; no slot is migrating or importing; every
    /// replica has its link to its primary up and no sync in progress.
    pub fn wait_consistent(&self) -> Result<(), Error> {
        self.wait_consistent_for("cluster consistent", self.opts.timeout)
    }

    fn wait_consistent_for(&self, what: &str, limit: Duration) -> Result<(), Error> {
        let start = Instant::now();
        loop {
            match self.check_consistent() {
                Ok(()) => return Ok(()),
                Err(why) => {
                    if start.elapsed() > limit {
                        return Err(Error::ClusterNotReady {
                            what: format!("{what}: {why}"),
                            waited: start.elapsed(),
                        });
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The running nodes that replicate node `i` now (before it is stopped).
    fn note_replicas(&mut self, i: usize) {
        let replicas = self.replicas_of(i);
        self.nodes[i].replicas_when_stopped = replicas;
    }

    /// SIGKILLs node `i` and reaps it (no shutdown, no final AOF write). Its replicas at that
    /// moment are remembered for [`wait_failover`](Self::wait_failover).
    pub fn kill9(&mut self, i: usize) -> Result<(), Error> {
        self.node(i)?;
        if self.is_up(i) {
            self.note_replicas(i);
        }
        let n = self.node_mut(i)?;
        n.proc.kill();
        n.running = false;
        n.paused = false;
        Ok(())
    }

    /// Starts node `i` again (killing it first if it runs) on the same port and directory: it
    /// reloads its `nodes.conf` (and its AOF with `appendonly`) and rejoins, as a replica when
    /// a failover replaced it meanwhile. Waits until the cluster is consistent again.
    ///
    /// Without `appendonly`, a restarted node comes back empty: when it is still a primary
    /// (no failover happened), its keys are gone, as in production.
    pub fn restart(&mut self, i: usize) -> Result<(), Error> {
        let n = self.node_mut(i)?;
        n.proc.restart()?;
        n.running = true;
        n.paused = false;
        self.wait_consistent_for(&format!("node {i} rejoined"), self.opts.timeout)
    }

    /// Waits until a replica of `old_primary` (killed or paused before) is promoted, and the
    /// cluster is consistent again; returns the new primary's index. Fails at once when
    /// `old_primary` had no replica, and with [`Error::ClusterNotReady`] after the timeout.
    pub fn wait_failover(&self, old_primary: usize) -> Result<usize, Error> {
        let node = self.node(old_primary)?;
        if self.is_up(old_primary) {
            return Err(Error::ClusterUsage(format!(
                "wait_failover({old_primary}): the node is running; kill9 or pause it first"
            )));
        }
        let candidates = &node.replicas_when_stopped;
        if candidates.is_empty() {
            return Err(Error::ClusterUsage(format!(
                "wait_failover({old_primary}): it had no replica when it was stopped"
            )));
        }
        let start = Instant::now();
        let limit = self.opts.timeout;
        let promoted = loop {
            if let Some(&p) = candidates
                .iter()
                .find(|&&r| self.is_up(r) && self.role(r) == Role::Primary)
            {
                break p;
            }
            if start.elapsed() > limit {
                return Err(Error::ClusterNotReady {
                    what: format!(
                        "failover of node {old_primary}: none of its replicas {candidates:?} \
                         was promoted"
                    ),
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        self.wait_consistent_for(
            &format!("cluster consistent after node {promoted} replaced node {old_primary}"),
            limit.saturating_sub(start.elapsed()),
        )?;
        Ok(promoted)
    }

    fn signal(&self, i: usize, sig: libc::c_int) -> Result<(), Error> {
        let pid = self
            .node(i)?
            .proc
            .pid()
            .ok_or_else(|| Error::ClusterUsage(format!("node {i} is not running")))?;
        // SAFETY: kill(2) on the pid of our own, not yet reaped, child.
        if unsafe { libc::kill(pid as libc::pid_t, sig) } != 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        Ok(())
    }

    /// SIGSTOPs node `i`: it holds its connections but answers nothing (a hung server; after
    /// the node timeout the cluster fails it over like a dead one). Its replicas at that
    /// moment are remembered for [`wait_failover`](Self::wait_failover).
    pub fn pause(&mut self, i: usize) -> Result<(), Error> {
        if self.is_up(i) {
            self.note_replicas(i);
        }
        self.signal(i, libc::SIGSTOP)?;
        self.nodes[i].paused = true;
        Ok(())
    }

    /// SIGCONTs a paused node. Does not wait: call [`wait_consistent`](Self::wait_consistent)
    /// to wait until it has rejoined.
    pub fn resume(&mut self, i: usize) -> Result<(), Error> {
        self.signal(i, libc::SIGCONT)?;
        self.nodes[i].paused = false;
        Ok(())
    }

    fn expect_primary(&self, i: usize, what: &str) -> Result<(), Error> {
        self.node(i)?;
        match self.role(i) {
            Role::Primary => Ok(()),
            r => Err(Error::ClusterUsage(format!(
                "{what}: node {i} is not a primary ({r:?})"
            ))),
        }
    }

    /// Moves `slots` slots (those `redis-cli` picks, with their keys) from primary `from` to
    /// primary `to` with `redis-cli --cluster reshard`, then waits until the cluster is
    /// consistent. Returns the slots that moved.
    pub fn reshard(&self, from: usize, to: usize, slots: usize) -> Result<Vec<u16>, Error> {
        self.expect_primary(from, "reshard")?;
        self.expect_primary(to, "reshard")?;
        if from == to || slots == 0 {
            return Ok(Vec::new());
        }
        self.wait_consistent_for("cluster consistent before reshard", self.opts.timeout)?;
        let before: BTreeSet<u16> = self.slots_of(from).into_iter().collect();
        let args: Vec<String> = vec![
            "--cluster".into(),
            "reshard".into(),
            format!("127.0.0.1:{}", self.port(from)),
            "--cluster-from".into(),
            self.node_id(from).into(),
            "--cluster-to".into(),
            self.node_id(to).into(),
            "--cluster-slots".into(),
            slots.to_string(),
            "--cluster-yes".into(),
        ];
        self.redis_cli("reshard", &args)?;
        self.wait_consistent_for(
            &format!("cluster consistent after resharding {slots} slots from node {from} to {to}"),
            self.opts.timeout,
        )?;
        let after: BTreeSet<u16> = self.slots_of(from).into_iter().collect();
        Ok(before.difference(&after).copied().collect())
    }

    /// Moves one slot, with its keys, to primary `to`, step by step as the Redis Cluster
    /// specification describes: `CLUSTER SETSLOT IMPORTING` on the target, `MIGRATING` on the
    /// source, `MIGRATE` of the slot's keys in batches of 100 (with `AUTH`), then
    /// `CLUSTER SETSLOT NODE` on the target, the source and every other running primary.
    /// Clients keep working meanwhile (they get `ASK` redirects for keys already moved). Waits
    /// until the cluster is consistent; returns how many keys moved.
    ///
    /// A failure half-way leaves the slot migrating (the error says which step failed).
    pub fn move_slot(&self, slot: u16, to: usize) -> Result<usize, Error> {
        if slot >= SLOTS {
            return Err(Error::ClusterUsage(format!(
                "slot {slot} is not below 16384"
            )));
        }
        self.expect_primary(to, "move_slot")?;
        self.wait_consistent_for("cluster consistent before move_slot", self.opts.timeout)?;
        let from = self.primary_of_slot(slot).ok_or_else(|| {
            Error::ClusterUsage(format!("move_slot: no running primary serves slot {slot}"))
        })?;
        if from == to {
            return Ok(0);
        }
        let slot_s = slot.to_string();
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        let mut dst = self.conn(to)?;
        let mut src = self.conn(from)?;
        expect_ok(
            &mut dst,
            &["CLUSTER", "SETSLOT", &slot_s, "IMPORTING", from_id],
        )?;
        expect_ok(
            &mut src,
            &["CLUSTER", "SETSLOT", &slot_s, "MIGRATING", to_id],
        )?;
        let batch = MIGRATE_BATCH.to_string();
        let to_port = self.port(to).to_string();
        let timeout_ms = IO_TIMEOUT.as_millis().to_string();
        let mut moved = 0;
        loop {
            let args = ["CLUSTER", "GETKEYSINSLOT", &slot_s, &batch];
            let keys: Vec<Vec<u8>> = match src.call(&args)? {
                Value::Array(items) => items
                    .into_iter()
                    .filter_map(|v| match v {
                        Value::Bulk(b) => Some(b),
                        _ => None,
                    })
                    .collect(),
                other => return Err(command_error(&src, &args, &other)),
            };
            if keys.is_empty() {
                break;
            }
            let mut migrate: Vec<Vec<u8>> = ["MIGRATE", "127.0.0.1", &to_port, "", "0"]
                .iter()
                .map(|s| s.as_bytes().to_vec())
                .collect();
            migrate.push(timeout_ms.as_bytes().to_vec());
            if let Some(p) = self.password() {
                migrate.push(b"AUTH".to_vec());
                migrate.push(p.as_bytes().to_vec());
            }
            migrate.push(b"KEYS".to_vec());
            let n = keys.len();
            migrate.extend(keys);
            match src.call(&migrate)? {
                // NOKEY: the keys expired or were deleted meanwhile
                v if v.is_ok() || v == Value::Status("NOKEY".into()) => moved += n,
                other => return Err(command_error(&src, &["MIGRATE", "…"], &other)),
            }
        }
        // the target first (it then serves the slot), then the source (which stops
        // redirecting with ASK), then the others (they would learn it by gossip as well)
        let setslot = ["CLUSTER", "SETSLOT", &slot_s, "NODE", to_id];
        expect_ok(&mut dst, &setslot)?;
        expect_ok(&mut src, &setslot)?;
        for i in 0..self.nodes.len() {
            if i != from && i != to && self.role(i) == Role::Primary {
                expect_ok(&mut self.conn(i)?, &setslot)?;
            }
        }
        self.wait_consistent_for(
            &format!("cluster consistent after moving slot {slot} from node {from} to {to}"),
            self.opts.timeout,
        )?;
        Ok(moved)
    }
}

fn node_dir_name(i: usize) -> String {
    format!("node-{i}")
}

fn node_options(opts: &ClusterOptions, base: &Path, i: usize, port: u16) -> RedisOptions {
    let mut extra: Vec<(String, String)> = [
        ("cluster-enabled", "yes"),
        ("cluster-config-file", NODES_CONF),
        ("cluster-node-timeout", &opts.node_timeout_ms.to_string()),
        // a replica's (re)sync starts at once instead of after 5 s (Redis' default)
        ("repl-diskless-sync-delay", "0"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    extra.extend(opts.extra.iter().cloned());
    RedisOptions {
        port: Some(port),
        data_dir: Some(base.join(node_dir_name(i))),
        appendonly: opts.appendonly,
        appendfsync: opts.appendfsync.clone(),
        extra,
        requirepass: opts.requirepass.clone(),
    }
}

fn command_text<A: AsRef<[u8]>>(args: &[A]) -> String {
    args.iter()
        .take(3)
        .map(|a| String::from_utf8_lossy(a.as_ref()).into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

fn command_error<A: AsRef<[u8]>>(c: &Conn, args: &[A], reply: &Value) -> Error {
    Error::ClusterCommand {
        addr: c.addr(),
        command: command_text(args),
        reply: format!("{reply:?}"),
    }
}

fn expect_ok(c: &mut Conn, args: &[&str]) -> Result<(), Error> {
    match c.call(args)? {
        v if v.is_ok() => Ok(()),
        other => Err(command_error(c, args, &other)),
    }
}

fn expect_text(c: &mut Conn, args: &[&str]) -> Result<String, Error> {
    match c.call(args)? {
        v @ (Value::Status(_) | Value::Bulk(_)) => Ok(v.text().unwrap_or_default()),
        other => Err(command_error(c, args, &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `redis-cli` that never exits (here a `BLPOP` with no timeout, as `--cluster create`
    /// waiting for a cluster that does not join) is killed at the limit and reported.
    #[test]
    fn a_redis_cli_that_never_exits_is_killed_at_its_limit() {
        if !redis_server_available() || !redis_cli_available() {
            eprintln!("SKIPPED: needs redis-server and redis-cli (scripts/install-redis.sh)");
            return;
        }
        let r = RedisProcess::start().unwrap();
        let port = r.port().to_string();
        let args = |a: &[&str]| -> Vec<String> { a.iter().map(|a| a.to_string()).collect() };
        let t = std::time::Instant::now();
        let blpop = args(&["-p", &port, "BLPOP", "nothing", "0"]);
        let e = cli_within(None, "blpop", &blpop, Duration::from_millis(300)).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        assert!(
            matches!(&e, Error::ClusterCli { step: "blpop", output } if output.contains("timed out")),
            "{e:?}"
        );
        // one that exits is judged as before
        let ping = args(&["-p", &port, "PING"]);
        let out = cli_within(None, "ping", &ping, Duration::from_secs(10)).unwrap();
        assert!(out.contains("PONG"), "{out}");
    }

    #[test]
    fn key_slot_follows_the_cluster_spec() {
        // the specification's CRC16 check value: "123456789" -> 0x31C3
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        // 0x31C3 = 12739 < 16384
        assert_eq!(key_slot(b"123456789"), 12739);
        // hash tags (examples of the Redis Cluster specification)
        assert_eq!(
            key_slot(b"{user1000}.following"),
            key_slot(b"{user1000}.followers")
        );
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16_xmodem(b"foo{}{bar}") % 16384);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"wm:{7}"), key_slot(b"7"));
        assert_eq!(
            key_slot(b"no close {brace"),
            crc16_xmodem(b"no close {brace") % 16384
        );
        assert_eq!(key_slot(b""), 0);
    }

    #[test]
    fn layout_file_round_trips_and_rejects_garbage() {
        let l = Layout {
            primaries: 3,
            replicas_per_primary: 1,
            ports: vec![20001, 20002, 20003, 20004, 20005, 20006],
        };
        assert_eq!(Layout::parse(&l.render()), Some(l));
        assert_eq!(
            Layout::parse("primaries 3\nreplicas_per_primary 0\nports 1 2"),
            None
        );
        assert_eq!(Layout::parse("what 3"), None);
    }

    #[test]
    fn cluster_nodes_lines_parse() {
        let text = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460 5462 [5461-<-292f8b365bb7edb5e285caf0b7e6ddc7265a2f4f]
292f8b365bb7edb5e285caf0b7e6ddc7265a2f4f 127.0.0.1:30002@31002 master,fail? - 0 1426238316232 2 connected 5461-10922
";
        let l = parse_cluster_nodes(text);
        assert_eq!(l.len(), 3);
        assert_eq!(l[0].port, 30004);
        assert!(l[0].has("slave"));
        assert_eq!(
            l[0].master.as_deref(),
            Some("e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca")
        );
        assert!(l[1].has("myself") && l[1].owns(5460) && l[1].owns(5462) && !l[1].owns(5461));
        assert_eq!(l[1].open.len(), 1);
        assert_eq!(l[2].epoch, 2);
        assert!(l[2].has("fail?"));
    }

    #[test]
    fn options_are_checked_before_anything_starts() {
        let bad = |o: ClusterOptions| RedisCluster::start(o).err().unwrap().code();
        assert_eq!(
            bad(ClusterOptions {
                primaries: 2,
                ..Default::default()
            }),
            "bad_cluster_options"
        );
        assert_eq!(
            bad(ClusterOptions {
                ports: Some(vec![20001, 20002, 20003]),
                ..Default::default()
            }),
            "bad_cluster_options"
        );
        assert_eq!(
            bad(ClusterOptions {
                replicas_per_primary: 0,
                ports: Some(vec![20001, 20002, 55536]),
                ..Default::default()
            }),
            "bad_cluster_options"
        );
        assert_eq!(
            bad(ClusterOptions {
                replicas_per_primary: 0,
                ports: Some(vec![20001, 20002, 30001]),
                ..Default::default()
            }),
            "bad_cluster_options"
        );
        assert_eq!(
            bad(ClusterOptions {
                requirepass: Some("has space".into()),
                ..Default::default()
            }),
            "bad_password"
        );
    }

    #[test]
    fn free_cluster_ports_leave_room_for_the_bus() {
        let ports = free_cluster_ports(6).unwrap();
        assert_eq!(ports.len(), 6);
        assert_eq!(ports.iter().collect::<HashSet<_>>().len(), 6);
        for p in ports {
            assert!(CLUSTER_PORT_RANGE.contains(&p));
            assert!(p <= 55535);
        }
    }
}
