//! `tidemark up` (a local deployment with its own redis-servers) and `tidemark serve` (against
//! Redis started elsewhere): their flags, including the gateway's listeners and limits shared by
//! both, the refusals made before anything starts, and the lines printed once it runs. The
//! service itself is `tidemark_server::run`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Args;
use tidemark_server::gateway::{GatewayOptions, TlsConfig};
use tidemark_server::materializer::{ChunkFault, MaterializerOptions, RandomChunkFault};
use tidemark_server::ownership::{NodeOptions, Role};
use tidemark_server::run;
use tidemark_store::redis::watermark::Layout;
use tokio_util::sync::CancellationToken;

use super::args::{InstancesArgs, LocalSizeArgs};
use super::exit::refuse;
use super::logs::notice;
use tidemark_store::redis::dlog::WaitPolicy;

#[derive(Args)]
pub struct UpArgs {
    #[command(flatten)]
    size: LocalSizeArgs,
    /// Gateway listen address.
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: std::net::SocketAddr,
    /// Data directory (AOF files, deployment file, token secret).
    #[arg(long, default_value = "./data")]
    data_dir: std::path::PathBuf,
    /// Accept `?user=NAME` without a token (development only; loopback --listen only).
    #[arg(long)]
    dev_auth: bool,
    /// Allow --dev-auth on a non-loopback --listen address (anyone who reaches it can act as
    /// any user).
    #[arg(long, requires = "dev_auth")]
    dev_auth_public: bool,
    /// Watermark layout to write.
    #[arg(long, default_value = "packed-v2", value_parser = tidemark_ops::parse_layout)]
    layout: Layout,
    /// appendfsync of every instance: always (default: nothing acknowledged is lost), everysec.
    #[arg(long, default_value = "always")]
    appendfsync: String,
    /// Nodes: 1 (default) runs one static owner; N > 1 runs N nodes in leases mode, the first
    /// in this process on --listen, the others as child processes on the next ports (kill
    /// one to watch its shards fail over; `tidemark status --config DIR/tidemark.toml`). Every
    /// node serves TLS with --tls-cert/--tls-key; with --admin-listen, node i's admin listener
    /// is on that port + i.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    nodes: u16,
    /// Run both pools on a local Redis Cluster (3 primaries, 3 replicas, under
    /// DATA_DIR/cluster; `redis-cli --cluster create` on the first start) instead of
    /// --core/--mailbox instances. Commits then wait for one replica (ADR-0032).
    #[arg(long, conflicts_with_all = ["core", "mailbox"])]
    cluster: bool,
    /// Raise the data dir's deployment from identity version 2 to 3 before serving, so that
    /// it writes packed log records (ADR-0056; a data dir created before ADR-0055). `up`
    /// started its redis-servers itself, so no other process can be using them.
    #[arg(long)]
    upgrade: bool,
    #[command(flatten)]
    replication: ReplicationArgs,
    #[command(flatten)]
    materializer: MaterializerArgs,
    #[command(flatten)]
    listeners: ListenerArgs,
    #[command(flatten)]
    limits: GatewayLimitArgs,
    #[command(flatten)]
    stop: StopArgs,
}

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    instances: InstancesArgs,
    /// Gateway listen address.
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: std::net::SocketAddr,
    /// Accept `?user=NAME` without a token (development only; loopback --listen only).
    #[arg(long)]
    dev_auth: bool,
    /// Allow --dev-auth on a non-loopback --listen address (anyone who reaches it can act as
    /// any user).
    #[arg(long, requires = "dev_auth")]
    dev_auth_public: bool,
    /// Watermark layout to write (without --config; with it, the file's `layout` decides).
    #[arg(long, default_value = "packed-v2", value_parser = tidemark_ops::parse_layout, conflicts_with = "config")]
    layout: Layout,
    /// File holding the token secret (else env TIDEMARK_TOKEN_SECRET).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// Own only these shards (comma-separated): static ownership of exactly these.
    #[arg(long, value_delimiter = ',')]
    own_shards: Option<Vec<u32>>,
    /// This node's id in the deployment's registry (default: a random id, printed at start);
    /// 1..=128 characters of A-Z a-z 0-9 - _ .
    #[arg(long)]
    node_id: Option<String>,
    /// The client URL `tidemark status` shows for this node (default: ws://<--listen>/v1/ws).
    #[arg(long)]
    advertise: Option<String>,
    /// What this node runs: `all` (gateway and materializers), `gateway` (the client protocol;
    /// owns no shard) or `materializer` (owns shards; its listener answers only `/metrics` and
    /// `/healthz`).
    #[arg(long, default_value = "all", value_parser = ["all", "gateway", "materializer"])]
    role: String,
    /// How shards are owned: `leases` (balanced over the live nodes with automatic
    /// failover; ADR-0030) or `static` (every shard, --own-shards, or the config's
    /// owner_of_shard; ADR-0015). Default: static with --own-shards or an owner table, else
    /// leases.
    #[arg(long, value_parser = ["static", "leases"])]
    ownership: Option<String>,
    /// Lease TTL in leases mode, also the registry record's lifetime (renewed every third).
    #[arg(long, default_value = "3s", value_parser = tidemark_client::parse_ttl)]
    lease_ttl: std::time::Duration,
    /// Fault injection for fault runs: fail this percentage of lane chunk writes.
    #[arg(long, hide = true, default_value_t = 0)]
    fault_chunk_fail_pct: u8,
    #[command(flatten)]
    replication: ReplicationArgs,
    #[command(flatten)]
    materializer: MaterializerArgs,
    #[command(flatten)]
    listeners: ListenerArgs,
    #[command(flatten)]
    limits: GatewayLimitArgs,
    #[command(flatten)]
    stop: StopArgs,
}

/// How `serve` and `up` stop (ADR-0122).
#[derive(Args)]
struct StopArgs {
    /// How long a stop (the first Ctrl-C or SIGTERM) may take before the process exits anyway,
    /// with status 1 (leases it did not release expire after their TTL); a second Ctrl-C or
    /// SIGTERM exits at once.
    #[arg(long, default_value = "30s", value_parser = tidemark_client::parse_ttl)]
    shutdown_timeout: std::time::Duration,
}

/// What must be on replicas before it counts (ADR-0032; docs/cluster.md).
#[derive(Args)]
struct ReplicationArgs {
    /// Replicas a commit must reach (`WAIT`) before `send_ack`, and a log record before it is
    /// materialised; 0: acknowledged and delivered once on the primary. Default: 1 on a Redis
    /// Cluster with replicas, else 0.
    #[arg(long)]
    core_wait_replicas: Option<u32>,
    /// Replicas the mailbox side's W must reach before the core log below it is trimmed.
    /// Default: 1 on a Redis Cluster with replicas, else 0.
    #[arg(long)]
    mailbox_wait_replicas: Option<u32>,
    /// How long one `WAIT` may block; a commit not confirmed in time is refused (retry with
    /// the same id), a trim is deferred.
    #[arg(long, default_value = "1s", value_parser = tidemark_client::parse_ttl)]
    wait_timeout: std::time::Duration,
}

impl ReplicationArgs {
    fn core_policy(&self) -> WaitPolicy {
        WaitPolicy {
            replicas: self.core_wait_replicas,
            timeout: self.wait_timeout,
        }
    }

    fn mailbox_policy(&self) -> WaitPolicy {
        WaitPolicy {
            replicas: self.mailbox_wait_replicas,
            timeout: self.wait_timeout,
        }
    }
}

/// Batching against latency, and the materializers' hand-over to the gateway (`serve` and
/// `up`).
#[derive(Args)]
struct MaterializerArgs {
    /// Shortest time, in microseconds, from one commit round of a core instance to the next
    /// (group commit, ADR-0045, ADR-0090): under steady traffic each round carries more sends,
    /// so core Redis makes fewer passes and fsyncs per message; a send waits at most this much
    /// longer for its `send_ack`; 128 sends waiting start a round at once. 0: a round starts as
    /// soon as the previous one is answered.
    #[arg(long, default_value_t = tidemark_server::gateway::DEFAULT_COMMIT_LINGER.as_micros() as u64)]
    commit_linger_us: u64,
    /// Shortest time, in milliseconds, between two log reads of a materializer when the last
    /// one found no backlog (ADR-0042): fewer, larger reads of live traffic for at most this
    /// much more latency. 0: read again at once.
    #[arg(long, default_value_t = tidemark_server::materializer::DEFAULT_READ_LINGER.as_millis() as u64)]
    read_linger_ms: u64,
    /// How long, in milliseconds, WebSocket acks gather before they are written to their
    /// mailbox instance (ADR-0074): a connection's cursor is written at most once per
    /// interval. A crashed gateway's clients get at most this much of what they acked again;
    /// a closing connection writes its last ack at once.
    #[arg(long, default_value_t = tidemark_server::gateway::DEFAULT_ACK_INTERVAL.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    ack_interval_ms: u64,
    /// Do not hand fresh entries from this process's materializers straight to its
    /// connections (ADR-0041): every delivery is read from the mailbox after its wake hint,
    /// as on a gateway-only node.
    #[arg(long)]
    no_local_delivery: bool,
    /// Do not hand the records this process's gateway commits to its materializers
    /// (ADR-0049): they read every record back from the logs with `XREAD`, as a
    /// materializer-only node does.
    #[arg(long)]
    no_commit_feed: bool,
    /// Most recipients (in one shard) of a message whose mailbox entries and watermark move
    /// in one atomic call on packed-v2 (ADR-0048), 1..=128; a record of more takes the
    /// chunked path. 1: only one-recipient records (ADR-0015's hot path). Default: 128, or 1
    /// with `--fault-chunk-fail-pct` (chunk faults are injected on the chunked path).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=128))]
    hot_recipients: Option<u16>,
}

impl MaterializerArgs {
    /// `--hot-recipients`, or its default (1 when chunk faults are injected).
    fn hot_recipients(&self, fault_chunk_fail_pct: u8) -> usize {
        match self.hot_recipients {
            Some(n) => usize::from(n),
            None if fault_chunk_fail_pct > 0 => 1,
            None => tidemark_store::redis::store::MAX_HOT_RECIPIENTS,
        }
    }
}

/// TLS and the admin listener (`serve` and `up`; docs/operations.md, ADR-0027).
#[derive(Args)]
struct ListenerArgs {
    /// Serve wss:// and https:// with this PEM certificate chain (leaf first).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Serve /metrics and /healthz here instead (plain HTTP, no auth: loopback or a private
    /// network); the --listen address then answers them 404.
    #[arg(long)]
    admin_listen: Option<std::net::SocketAddr>,
}

impl ListenerArgs {
    /// Loads the certificate and key (if given): a file that cannot be used is refused (exit
    /// 2) before anything starts.
    fn tls(&self) -> Result<Option<TlsConfig>, ExitCode> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => TlsConfig::from_pem_files(cert, key)
                .map(Some)
                .map_err(refuse),
            _ => Ok(None),
        }
    }
}

/// Limits on slow, idle and greedy clients (`serve` and `up`; docs/operations.md, ADR-0025).
#[derive(Args)]
struct GatewayLimitArgs {
    /// Most open client connections (WebSockets included); beyond: HTTP 503 `overloaded`.
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// A request head (or body) must arrive within this time, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = tidemark_client::parse_ttl)]
    header_read_timeout: std::time::Duration,
    /// Ping a WebSocket client after this much silence.
    #[arg(long, default_value = "20s", value_parser = tidemark_client::parse_ttl)]
    ws_ping_interval: std::time::Duration,
    /// Close a WebSocket (4002) from which nothing, not even a pong, arrived for this long.
    #[arg(long, default_value = "60s", value_parser = tidemark_client::parse_ttl)]
    ws_idle_timeout: std::time::Duration,
    /// Bytes of outbound frames one WebSocket may have queued (e.g. 65536, 64k, 1m).
    #[arg(long, default_value = "64k", value_parser = parse_bytes)]
    max_queued_bytes: usize,
    /// Close a WebSocket (4003) whose frames waited this long for room; drop an HTTP
    /// response whose writes made no progress for this long.
    #[arg(long, default_value = "30s", value_parser = tidemark_client::parse_ttl)]
    slow_client_grace: std::time::Duration,
    /// Bytes of mailbox entries in one `GET /v1/mailbox` page (e.g. 1m).
    #[arg(long, default_value = "1m", value_parser = parse_bytes)]
    max_page_bytes: usize,
    /// Most open WebSockets of one user; beyond: HTTP 429 `too_many_connections`.
    #[arg(long, default_value_t = 16)]
    max_connections_per_user: usize,
    /// Most commits in flight for one user (0: an eighth of the gateway's 4096).
    #[arg(long, default_value_t = 0)]
    max_inflight_commits_per_user: usize,
    /// Sends per second one user may make (0: no limit); beyond: `rate_limited`.
    #[arg(long, default_value_t = 0.0)]
    send_rate_per_user: f64,
    /// Sends one user may make at once before the rate applies (0: one second's worth).
    #[arg(long, default_value_t = 0)]
    send_burst_per_user: u32,
}

/// A byte count: a number, optionally followed by k or m (KiB, MiB).
fn parse_bytes(s: &str) -> Result<usize, String> {
    let lower = s.to_ascii_lowercase();
    let (num, mul) = match lower.strip_suffix('k') {
        Some(n) => (n, 1024),
        None => match lower.strip_suffix('m') {
            Some(n) => (n, 1024 * 1024),
            None => (lower.as_str(), 1),
        },
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("bad byte count {s:?} (e.g. 262144, 256k, 1m)"))
}

impl GatewayLimitArgs {
    /// Gateway options with these limits (and defaults for everything else).
    fn options(&self) -> GatewayOptions {
        GatewayOptions {
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            ping_interval: self.ws_ping_interval,
            idle_timeout: self.ws_idle_timeout,
            max_queued_bytes: self.max_queued_bytes,
            slow_client_grace: self.slow_client_grace,
            max_page_bytes: self.max_page_bytes,
            max_connections_per_user: self.max_connections_per_user,
            max_inflight_commits_per_user: self.max_inflight_commits_per_user,
            send_rate_per_user: self.send_rate_per_user,
            send_burst_per_user: self.send_burst_per_user,
            ..GatewayOptions::default()
        }
    }
}

/// What `serve` and `up` check first: `--dev-auth` only where it is safe (else refused, or a
/// warning with `--dev-auth-public`), then the TLS files loaded.
fn preflight(
    dev_auth: bool,
    dev_auth_public: bool,
    listen: SocketAddr,
    listeners: &ListenerArgs,
) -> Result<Option<TlsConfig>, ExitCode> {
    match run::check_dev_auth(dev_auth, dev_auth_public, listen) {
        Err(why) => return Err(refuse(why)),
        Ok(Some(warning)) => eprintln!("{warning}"),
        Ok(None) => {}
    }
    if listeners.admin_listen.is_none() && !listen.ip().is_loopback() {
        // ADR-0027 serves them there when no admin listener is given; ADR-0115: said aloud
        eprintln!(
            "warning: /metrics and /healthz answer on {listen}, the client listener, to anyone \
             who reaches it (shard heads, lag, node names); give them their own listener with \
             --admin-listen 127.0.0.1:PORT"
        );
    }
    listeners.tls()
}

/// The gateway's options from the flags `serve` and `up` share.
fn gateway_options(
    listeners: &ListenerArgs,
    limits: &GatewayLimitArgs,
    (dev_auth, dev_auth_public): (bool, bool),
    token_secret: Option<Vec<u8>>,
    tls: Option<TlsConfig>,
) -> GatewayOptions {
    GatewayOptions {
        dev_auth,
        dev_auth_public,
        token_secret,
        tls,
        admin_listen: listeners.admin_listen,
        ..limits.options()
    }
}

/// How long the command has to end by itself once its stop is cut short ([`Shutdown::force`])
/// before the process is ended from a thread of its own (the runtime's shutdown could wait on
/// a task that does not end).
const FORCED_EXIT_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// The stop of `serve` and `up` on signals (ADR-0122).
///
/// The first Ctrl-C or SIGTERM cancels `stop`: the service stops in order (workers, leases,
/// the registry record). A second one, or `--shutdown-timeout` after the first, cancels
/// `force`: the command gives up the stop and exits with status 1 (a third signal, or
/// [`FORCED_EXIT_WITHIN`], ends the process at once). Before, the signal task ended after
/// the first signal, and since tokio keeps its handlers installed for good, every later
/// Ctrl-C or SIGTERM was swallowed: a stuck stop could only be ended with `kill -9`.
struct Shutdown {
    /// Cancelled on the first Ctrl-C or SIGTERM.
    stop: CancellationToken,
    /// Cancelled when the stop is cut short.
    force: CancellationToken,
}

/// Listens for Ctrl-C and SIGTERM for as long as the process runs (see [`Shutdown`]).
fn shutdown_signals(timeout: std::time::Duration) -> Shutdown {
    use tokio::signal::unix::{signal, SignalKind};
    let (stop, force) = (CancellationToken::new(), CancellationToken::new());
    let (s, f) = (stop.clone(), force.clone());
    // installed now, so that no signal between here and the task's first poll is missed
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        notice(&format!(
            "stopping... (Ctrl-C or SIGTERM again exits at once; the stop is given up after \
             {}s)",
            timeout.as_secs()
        ));
        s.cancel();
        let why = tokio::select! {
            _ = int.recv() => "a second signal (SIGINT)".to_string(),
            _ = term.recv() => "a second signal (SIGTERM)".to_string(),
            _ = tokio::time::sleep(timeout) => {
                format!("--shutdown-timeout {}s passed", timeout.as_secs())
            }
        };
        super::logs::fatal(&anyhow::anyhow!(
            "stop not finished: {why}; exiting without it (leases not released expire after \
             their TTL)"
        ));
        f.cancel();
        // the command returns at once; should anything hold it (or the runtime's shutdown),
        // the process ends anyway
        std::thread::spawn(|| {
            std::thread::sleep(FORCED_EXIT_WITHIN);
            std::process::exit(1);
        });
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        std::process::exit(1);
    });
    Shutdown { stop, force }
}

/// Runs `tidemark up`.
pub async fn up(a: UpArgs) -> anyhow::Result<ExitCode> {
    let tls = match preflight(a.dev_auth, a.dev_auth_public, a.listen, &a.listeners) {
        Ok(t) => t,
        Err(code) => return Ok(code),
    };
    if let Err(why) = check_node_ports(a.nodes, a.listen, a.listeners.admin_listen) {
        return Ok(refuse(why));
    }
    if !tidemark_redis_proc::redis_server_available() {
        eprintln!("error: {}", tidemark_redis_proc::Error::NotInstalled);
        return Ok(ExitCode::FAILURE);
    }
    if a.cluster && !tidemark_redis_proc::redis_cli_available() {
        eprintln!("error: {}", tidemark_redis_proc::Error::CliNotInstalled);
        return Ok(ExitCode::FAILURE);
    }
    // first: one `up` per data dir (ADR-0109); a second is refused before it writes anything
    let lock = match run::lock_data_dir(&a.data_dir) {
        Ok(l) => l,
        Err(e @ run::Error::DataDirLocked { .. }) => return Ok(refuse(e)),
        Err(e) => return Err(e.into()),
    };
    // the data dir holds the secrets: private (0700 / 0600), tightened when it was not
    let tightened = match run::prepare_data_dir(&a.data_dir) {
        Ok(t) => t,
        Err(e) => return Ok(refuse(e)),
    };
    if !tightened.is_empty() {
        eprintln!(
            "note: {} was readable by other users; removed group/other access from {} path(s):",
            a.data_dir.display(),
            tightened.len()
        );
        for t in tightened.iter().take(8) {
            eprintln!("  {t}");
        }
        if tightened.len() > 8 {
            eprintln!("  … and {} more", tightened.len() - 8);
        }
    }
    let secret = match run::load_or_create_secret(&a.data_dir) {
        Ok(s) => s,
        Err(run::Error::Secret(e)) => return Ok(refuse(e)),
        Err(e) => return Err(e.into()),
    };
    let scheme = if tls.is_some() { "wss" } else { "ws" };
    let node = (a.nodes > 1).then(|| NodeOptions {
        id: "up-0".into(),
        advertise: format!("{scheme}://{}/v1/ws", a.listen),
        role: Role::All,
        lease_ttl: tidemark_server::ownership::DEFAULT_LEASE_TTL,
        leases: true,
    });
    let shutdown = shutdown_signals(a.stop.shutdown_timeout);
    let cancel = shutdown.stop.clone();
    // from Ctrl-C (or SIGTERM) on, a child node's exit is expected: the terminal's SIGINT
    // reaches the children too (same process group), and they may stop before this node
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tokio::spawn({
        let (cancel, stopping) = (cancel.clone(), stopping.clone());
        async move {
            cancel.cancelled().await;
            stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let up = run::up_locked(
        run::UpOptions {
            mailbox: a.size.mailbox,
            core: a.size.core,
            shards: a.size.shards,
            layout: a.layout,
            listen: a.listen,
            data_dir: a.data_dir.clone(),
            gateway: GatewayOptions {
                core_wait: a.replication.core_policy(),
                local_delivery: !a.materializer.no_local_delivery,
                commit_feed: !a.materializer.no_commit_feed,
                commit_linger: std::time::Duration::from_micros(a.materializer.commit_linger_us),
                ack_interval: std::time::Duration::from_millis(a.materializer.ack_interval_ms),
                ..gateway_options(
                    &a.listeners,
                    &a.limits,
                    (a.dev_auth, a.dev_auth_public),
                    Some(secret.into_bytes()),
                    tls,
                )
            },
            materializer: MaterializerOptions {
                mailbox_wait: a.replication.mailbox_policy(),
                core_wait: a.replication.core_policy(),
                read_linger: std::time::Duration::from_millis(a.materializer.read_linger_ms),
                hot_recipients: a.materializer.hot_recipients(0),
                ..Default::default()
            },
            cluster: a.cluster,
            appendfsync: a.appendfsync,
            node,
            upgrade: a.upgrade,
        },
        lock,
        cancel,
    )
    .await?;
    for line in up.endpoint_lines() {
        println!("{line}");
    }
    println!(
        "token secret in {}; mint a token with: tidemark token --user NAME --secret-file {}",
        a.data_dir.join("token.secret").display(),
        a.data_dir.join("token.secret").display()
    );
    let mut children = Vec::new();
    // the other nodes serve what this one serves: the same certificate, an admin listener each
    let tls_files = match (&a.listeners.tls_cert, &a.listeners.tls_key) {
        (Some(cert), Some(key)) => Some((std::path::absolute(cert)?, std::path::absolute(key)?)),
        _ => None,
    };
    for i in 1..a.nodes {
        let listen = node_addr(a.listen, i);
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.arg("serve")
            .arg("--config")
            .arg(a.data_dir.join(run::UP_TOPOLOGY_FILE))
            .args([
                "--node-id",
                &format!("up-{i}"),
                "--listen",
                &listen.to_string(),
            ])
            .arg("--secret-file")
            .arg(a.data_dir.join(run::TOKEN_SECRET_FILE));
        // its endpoint lines would repeat ours (and outlive a reader of our stdout); its logs
        // go to our stderr
        cmd.stdout(std::process::Stdio::null());
        // the same batching against latency as this node
        cmd.arg("--read-linger-ms")
            .arg(a.materializer.read_linger_ms.to_string())
            .arg("--commit-linger-us")
            .arg(a.materializer.commit_linger_us.to_string())
            .arg("--ack-interval-ms")
            .arg(a.materializer.ack_interval_ms.to_string());
        if a.materializer.no_local_delivery {
            cmd.arg("--no-local-delivery");
        }
        if a.materializer.no_commit_feed {
            cmd.arg("--no-commit-feed");
        }
        if let Some(n) = a.materializer.hot_recipients {
            cmd.arg("--hot-recipients").arg(n.to_string());
        }
        if a.dev_auth {
            cmd.arg("--dev-auth");
        }
        if a.dev_auth_public {
            cmd.arg("--dev-auth-public");
        }
        if let Some((cert, key)) = &tls_files {
            cmd.arg("--tls-cert").arg(cert).arg("--tls-key").arg(key);
        }
        let admin = a.listeners.admin_listen.map(|addr| node_addr(addr, i));
        if let Some(admin) = admin {
            cmd.arg("--admin-listen").arg(admin.to_string());
        }
        let child = spawn_killed_with_us(&mut cmd)?;
        println!(
            "node     up-{i} {scheme}://{listen}/v1/ws (pid {})",
            child.id()
        );
        let child = NodeChild::watch(format!("up-{i}"), child, stopping.clone());
        if let Some(admin) = admin {
            println!("admin    up-{i} http://{admin} (GET /metrics, GET /healthz)");
        }
        children.push(child);
    }
    if a.nodes > 1 {
        println!(
            "node     up-0 {scheme}://{}/v1/ws (this process); leases: kill a node to watch its \
             shards move (tidemark status --config {})",
            a.listen,
            a.data_dir.join(run::UP_TOPOLOGY_FILE).display()
        );
    }
    println!("Ctrl-C stops Tidemark and its redis-servers.");
    // `up`'s other fields (the cluster, the data dir's lock) are dropped at the end of this
    // function, after the nodes and the Redis servers below
    let run::Up {
        core,
        mailbox,
        running,
        ..
    } = up;
    // ADR-0122: a stop cut short (a second signal, --shutdown-timeout) does not wait for
    // the service; the nodes and the Redis servers are still stopped, in that order
    let force = shutdown.force;
    let res = tokio::select! {
        r = running.wait() => Some(r),
        _ = force.cancelled() => None,
    };
    // the other nodes stop first (SIGTERM: they release their leases; SIGKILL when the stop
    // is cut short), then the Redis servers
    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
    let sig = if res.is_some() {
        libc::SIGTERM
    } else {
        libc::SIGKILL
    };
    for child in &children {
        child.signal(sig);
    }
    for child in children {
        let force = force.clone();
        let _ = tokio::task::spawn_blocking(move || child.stop(&force)).await;
    }
    drop(core);
    drop(mailbox);
    match res {
        Some(r) => {
            r?;
            Ok(ExitCode::SUCCESS)
        }
        None => Ok(ExitCode::FAILURE),
    }
}

/// Node `i` of `up --nodes N`: the port `i` after `first`'s (checked by [`check_node_ports`]).
fn node_addr(first: SocketAddr, i: u16) -> SocketAddr {
    SocketAddr::new(first.ip(), first.port() + i)
}

/// `up --nodes N` puts its nodes on `N` consecutive ports from `--listen`'s, and their admin
/// listeners on `N` consecutive ports from `--admin-listen`'s: both must name a port (not 0),
/// the ranges must fit below 65536 and must not overlap on one address.
fn check_node_ports(
    nodes: u16,
    listen: SocketAddr,
    admin: Option<SocketAddr>,
) -> Result<(), String> {
    if nodes <= 1 {
        return Ok(());
    }
    let range = |flag: &str, a: SocketAddr| {
        if a.port() == 0 {
            return Err(format!(
                "--nodes {nodes} puts the nodes on consecutive ports from {flag}'s: give a \
                 port, not 0"
            ));
        }
        let last = u32::from(a.port()) + u32::from(nodes) - 1;
        if last > u32::from(u16::MAX) {
            return Err(format!(
                "--nodes {nodes} from {flag} {a} needs ports up to {last}"
            ));
        }
        Ok(u32::from(a.port())..=last)
    };
    let gateways = range("--listen", listen)?;
    if let Some(admin) = admin {
        let admins = range("--admin-listen", admin)?;
        let same_address = admin.ip() == listen.ip()
            || admin.ip().is_unspecified()
            || listen.ip().is_unspecified();
        if same_address && gateways.start() <= admins.end() && admins.start() <= gateways.end() {
            return Err(format!(
                "--nodes {nodes}: the gateways take ports {}-{} and the admin listeners {}-{}: \
                 they overlap; pick an --admin-listen port outside the gateways' range",
                gateways.start(),
                gateways.end(),
                admins.start(),
                admins.end()
            ));
        }
    }
    Ok(())
}

/// Runs `tidemark serve`.
pub async fn serve(a: ServeArgs) -> anyhow::Result<ExitCode> {
    let tls = match preflight(a.dev_auth, a.dev_auth_public, a.listen, &a.listeners) {
        Ok(t) => t,
        Err(code) => return Ok(code),
    };
    let topology = a.instances.topology(a.layout)?;
    let secret = match run::serve_secret(a.secret_file.as_deref(), a.dev_auth) {
        Ok(s) => s,
        Err(why) => return Ok(refuse(why)),
    };
    let static_given = a.own_shards.is_some() || topology.owner_of_shard.is_some();
    let ownership = match a.ownership.as_deref() {
        Some("leases") if static_given => {
            return Ok(refuse(
                "--ownership leases with --own-shards or an owner table (owner_of_shard): \
                 leases assign the shards themselves",
            ))
        }
        Some(o) => o,
        None if static_given => "static",
        None => "leases",
    };
    let node_id = match a.node_id.clone() {
        Some(id) => id,
        None => tidemark_server::ownership::random_node_id()?,
    };
    if let Err(e) = tidemark_store::redis::lease::check_node_id(&node_id) {
        return Ok(refuse(e));
    }
    if a.lease_ttl < std::time::Duration::from_millis(300) {
        return Ok(refuse("--lease-ttl must be at least 300ms"));
    }
    let scheme = if tls.is_some() { "wss" } else { "ws" };
    let node = NodeOptions {
        id: node_id.clone(),
        advertise: a
            .advertise
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{}/v1/ws", a.listen)),
        role: match a.role.as_str() {
            "gateway" => Role::Gateway,
            "materializer" => Role::Materializer,
            _ => Role::All,
        },
        lease_ttl: a.lease_ttl,
        leases: ownership == "leases",
    };
    let shutdown = shutdown_signals(a.stop.shutdown_timeout);
    let cancel = shutdown.stop.clone();
    let running = run::serve(
        run::ServeOptions {
            topology: topology.clone(),
            listen: a.listen,
            gateway: GatewayOptions {
                clients: a.role != "materializer",
                core_wait: a.replication.core_policy(),
                local_delivery: !a.materializer.no_local_delivery,
                commit_feed: !a.materializer.no_commit_feed,
                commit_linger: std::time::Duration::from_micros(a.materializer.commit_linger_us),
                ack_interval: std::time::Duration::from_millis(a.materializer.ack_interval_ms),
                ..gateway_options(
                    &a.listeners,
                    &a.limits,
                    (a.dev_auth, a.dev_auth_public),
                    secret,
                    tls,
                )
            },
            materializer: MaterializerOptions {
                mailbox_wait: a.replication.mailbox_policy(),
                core_wait: a.replication.core_policy(),
                read_linger: std::time::Duration::from_millis(a.materializer.read_linger_ms),
                hot_recipients: a.materializer.hot_recipients(a.fault_chunk_fail_pct),
                fault: (a.fault_chunk_fail_pct > 0).then(|| {
                    Arc::new(RandomChunkFault {
                        percent: a.fault_chunk_fail_pct,
                    }) as Arc<dyn ChunkFault>
                }),
                ..Default::default()
            },
            owned_shards: a.own_shards,
            node: Some(node),
        },
        cancel,
    )
    .await?;
    println!("gateway  {}", running.ws_url());
    println!("node     {node_id} ({ownership} ownership)");
    if running.admin_addr.is_some() {
        println!(
            "admin    {} (GET /metrics, GET /healthz)",
            running.admin_url()
        );
    }
    for (i, u) in topology.core.iter().enumerate() {
        println!("core     {i} {}", tidemark_store::redact_url(u));
    }
    for (i, u) in topology.mailbox.iter().enumerate() {
        println!("mailbox  {i} {}", tidemark_store::redact_url(u));
    }
    // ADR-0122: a stop cut short (a second signal, --shutdown-timeout) is not waited for
    tokio::select! {
        r = running.wait() => r?,
        _ = shutdown.force.cancelled() => return Ok(ExitCode::FAILURE),
    }
    Ok(ExitCode::SUCCESS)
}

/// A node process of `up --nodes N`, watched by a thread of its own: if it exits while `up`
/// runs, that is logged at once with its exit status (ADR-0065). It is not restarted: its
/// shards move to the other nodes once their leases expire, which is what killing a node
/// here is for.
/// How long `up` waits for a child node to stop after its SIGTERM (it releases its leases)
/// before it kills it.
const NODE_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

struct NodeChild {
    pid: u32,
    /// Set once the process has exited (before it is reaped: until then `pid` is still ours).
    exited: Arc<std::sync::Mutex<bool>>,
    waiter: std::thread::JoinHandle<()>,
}

impl NodeChild {
    fn watch(
        name: String,
        mut child: std::process::Child,
        stopping: Arc<std::sync::atomic::AtomicBool>,
    ) -> NodeChild {
        let pid = child.id();
        let exited = Arc::new(std::sync::Mutex::new(false));
        let e = exited.clone();
        let waiter = std::thread::spawn(move || {
            // wait without reaping, so `signal` never reaches a pid reused by another process
            let waited = loop {
                // SAFETY: waitid on our own child, into a zeroed siginfo_t it fills.
                let r = unsafe {
                    let mut info: libc::siginfo_t = std::mem::zeroed();
                    libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT)
                };
                if r == 0 {
                    break true;
                }
                if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                    break false;
                }
            };
            let status = if waited {
                *e.lock().expect("exited lock") = true;
                child.wait()
            } else {
                // waitid failed (not expected for our own child): reap it under the lock, so
                // that no signal goes out between the reaping and the note
                loop {
                    let mut exited = e.lock().expect("exited lock");
                    match child.try_wait() {
                        Ok(None) => {}
                        done => {
                            *exited = true;
                            break done.map(|s| s.expect("checked"));
                        }
                    }
                    drop(exited);
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
            };
            if !stopping.load(std::sync::atomic::Ordering::SeqCst) {
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                tracing::error!(
                    node = %name,
                    pid,
                    %status,
                    "node process exited; not restarted: its shards move to the other nodes \
                     when their leases expire (tidemark status --config …)"
                );
            }
        });
        NodeChild {
            pid,
            exited,
            waiter,
        }
    }

    /// Sends `sig`, unless the process has exited already.
    fn signal(&self, sig: libc::c_int) {
        let exited = self.exited.lock().expect("exited lock");
        if !*exited {
            // SAFETY: a signal to our own child process, not yet reaped (checked under the
            // lock the watcher sets before reaping it)
            unsafe { libc::kill(self.pid as i32, sig) };
        }
    }

    /// Waits for the process to end after a SIGTERM: [`NODE_STOP_GRACE`], then SIGKILL (a
    /// node that hangs in its shutdown must not keep `up` from stopping); SIGKILL at once
    /// once `force` is cancelled (`up`'s own stop cut short, ADR-0122).
    fn stop(self, force: &CancellationToken) {
        let until = std::time::Instant::now() + NODE_STOP_GRACE;
        while !self.waiter.is_finished()
            && std::time::Instant::now() < until
            && !force.is_cancelled()
        {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if !self.waiter.is_finished() {
            if !force.is_cancelled() {
                tracing::warn!(pid = self.pid, "node did not stop after SIGTERM; SIGKILL");
            }
            self.signal(libc::SIGKILL);
        }
        let _ = self.waiter.join();
    }
}

/// Spawns `cmd` so that it is SIGKILLed when this process dies (PR_SET_PDEATHSIG): the nodes
/// of `up --nodes N` never outlive the redis-servers they use.
fn spawn_killed_with_us(cmd: &mut std::process::Command) -> std::io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl is async-signal-safe; the closure touches nothing else.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn()
}

#[cfg(test)]
mod tests {
    use super::check_node_ports;

    #[test]
    fn node_port_ranges() {
        let a = |s: &str| s.parse().unwrap();
        // one node: anything goes (port 0 included)
        assert!(check_node_ports(1, a("127.0.0.1:0"), Some(a("127.0.0.1:0"))).is_ok());
        assert!(check_node_ports(3, a("127.0.0.1:7400"), None).is_ok());
        assert!(check_node_ports(3, a("127.0.0.1:7400"), Some(a("127.0.0.1:9400"))).is_ok());
        // adjacent ranges do not overlap
        assert!(check_node_ports(3, a("127.0.0.1:7400"), Some(a("127.0.0.1:7403"))).is_ok());
        // the same ports on another address
        assert!(check_node_ports(3, a("10.0.0.1:7400"), Some(a("127.0.0.1:7400"))).is_ok());
        for (listen, admin, says) in [
            ("127.0.0.1:0", None, "not 0"),
            ("127.0.0.1:7400", Some("127.0.0.1:0"), "not 0"),
            ("127.0.0.1:65534", None, "65536"),
            ("127.0.0.1:7400", Some("127.0.0.1:7402"), "overlap"),
            ("0.0.0.0:7400", Some("127.0.0.1:7399"), "overlap"),
        ] {
            let e = check_node_ports(3, a(listen), admin.map(a)).unwrap_err();
            assert!(e.contains(says), "{listen} {admin:?}: {e}");
        }
    }
}
