//! `tidemark bench idle`: what connected clients that send nothing cost the service.
//!
//! [`run_idle`] connects `clients` WebSocket clients (dev auth, or bearer tokens minted from
//! a secret, like [`crate::load`]), lets them sit for `settle`, then measures an idle window
//! of `duration` in which no client sends anything:
//!
//! - **server CPU %** = Δ`process_cpu_seconds_total` / Δwall × 100 (100 % = one core) and
//!   **RSS** (`process_resident_memory_bytes`), from each gateway's `/metrics`; for a local
//!   target (the service in this process), this process's own `/proc/self` — which then
//!   includes the generator's side of every connection. RSS is read before the first client
//!   connects, after they all have (and settled) and at the end of the window;
//!   `rss_per_connection_bytes` = (end − before) / connected.
//! - **Redis commands/s** of every instance: Δ`total_commands_processed` / Δwall, and by
//!   command (Δ`calls` of each `cmdstat_<name>` line of `INFO commandstats`); the window's
//!   own closing `INFO` is one of them.
//! - this process (the generator) too, from `/proc/self`.
//!
//! # Many connections from one machine
//!
//! A client socket is bound to a source address before it connects, round-robin over
//! `source_addrs` (by default, for a loopback target, 127.0.0.2, 127.0.0.3, … — one per
//! 10,000 clients): every local address has its own ephemeral port range, so one generator
//! can open more connections to one gateway than that range holds. The open-file limit is
//! raised to the hard limit first (one descriptor per client; a local target holds both
//! ends). Each connection is one task reading its socket (answering the server's pings),
//! with a 4 KiB read buffer and no other state: the generator stays small next to what it
//! measures.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};
use tidemark_client::client::{handshake_on, Handshaken};
use tidemark_client::Auth;
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::run::{up, Up, UpOptions};
use tidemark_store::redis::watermark::Layout;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::{sleep, Instant};

use crate::engine::{Sample, Watched};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;
use tokio_util::sync::CancellationToken;

use crate::load::{Error, Target};

/// Clients per source address when they are chosen automatically.
pub const CLIENTS_PER_SOURCE_ADDR: usize = 10_000;
/// Descriptors kept for everything but client sockets (Redis, `/metrics`, the runtime).
const FD_RESERVE: usize = 64;
/// The same with the service in this process (the gateway keeps 288 for itself).
const FD_RESERVE_LOCAL: usize = 320;
/// Attempts per client connection.
const CONNECT_ATTEMPTS: usize = 3;
/// Limit of one connection attempt: TCP connect, upgrade and `ready`.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Read buffer of each idle client's socket.
const CLIENT_READ_BUFFER: usize = 4 * 1024;
/// Limit of one `/metrics` read.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);
/// Progress-bar refresh while idle.
const TICK: Duration = Duration::from_millis(250);

/// What to connect and how long to watch.
#[derive(Debug, Clone)]
pub struct IdleOptions {
    /// WebSocket clients (user `id<run>-<i>`), each sending nothing.
    pub clients: usize,
    /// The measured idle window.
    pub duration: Duration,
    /// Wait after the last client connected before the window starts (each connection's
    /// first mailbox read and registration are not idle cost).
    pub settle: Duration,
    /// The deployment: a fresh local one in this process ([`Target::Local`]), or gateways
    /// and Redis URLs of a running one ([`Target::Remote`]; its `token_secret` mints tokens,
    /// else dev auth).
    pub target: Target,
    /// Local addresses client sockets are bound to, round-robin. `None`: 127.0.0.2, … (one
    /// per [`CLIENTS_PER_SOURCE_ADDR`] clients) when every gateway is on a loopback address,
    /// else the system's choice. `Some(empty)`: the system's choice.
    pub source_addrs: Option<Vec<IpAddr>>,
    /// `/metrics` URLs of the gateways of a remote target (plain HTTP). Empty: each
    /// gateway's `http://HOST:PORT/metrics` from its WebSocket URL.
    pub metrics_urls: Vec<String>,
    /// Clients connecting at once.
    pub concurrency: usize,
    /// Draw progress bars on stderr.
    pub progress: bool,
}

impl Default for IdleOptions {
    /// 1,000 clients idle for 30 s on a local 1 + 1 deployment of 64 shards.
    fn default() -> Self {
        IdleOptions {
            clients: 1000,
            duration: Duration::from_secs(30),
            settle: Duration::from_secs(2),
            target: Target::Local {
                mailbox: 1,
                core: 1,
                shards: 64,
                appendfsync: "everysec".into(),
            },
            source_addrs: None,
            metrics_urls: Vec::new(),
            concurrency: 64,
            progress: false,
        }
    }
}

/// What an idle run measured (`--json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IdleReport {
    /// `local` (the service in this process) or `remote`.
    pub target: String,
    /// Clients asked for.
    pub clients: usize,
    /// Clients that connected (got `ready`).
    pub connected: usize,
    /// Failed connections (after their retries), by error code.
    pub connect_errors: BTreeMap<String, u64>,
    /// Seconds from the first connection attempt to the last `ready`.
    pub connect_s: f64,
    /// Connections by the local address they came from.
    pub source_addrs: BTreeMap<String, usize>,
    /// This process's open-file limit (soft) after raising it to the hard limit.
    pub open_file_limit: Option<u64>,
    /// Length of the measured window, seconds (from the samples' own clock).
    pub duration_s: f64,
    /// Connections that ended before the end of the window, by reason (a close code,
    /// `eof`, `error`).
    pub closed: BTreeMap<String, u64>,
    /// Text frames received during the window (an idle client expects none).
    pub frames_while_idle: u64,
    /// Connections still open at the end of the window.
    pub open_at_end: usize,
    /// Each gateway process (one per `/metrics` URL; one for a local target).
    pub servers: Vec<ServerIdle>,
    /// This process (the generator; for a local target also the service).
    pub generator: ProcIdle,
    /// Every Redis instance watched.
    pub redis: Vec<RedisIdle>,
    /// Commands/s of all instances together.
    pub redis_commands_per_s: f64,
    /// Commands/s by command, all instances together.
    pub redis_by_command_per_s: BTreeMap<String, f64>,
}

/// One gateway process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerIdle {
    /// Where the figures come from: a `/metrics` URL, or `this process`.
    pub source: String,
    /// CPU over the window, % of one core.
    pub cpu_pct: Option<f64>,
    /// RSS before the first client connected, bytes.
    pub rss_before_bytes: Option<u64>,
    /// RSS once every client connected and settled (start of the window), bytes.
    pub rss_connected_bytes: Option<u64>,
    /// RSS at the end of the window, bytes.
    pub rss_bytes: Option<u64>,
    /// (`rss_bytes` − `rss_before_bytes`) / `connected`.
    pub rss_per_connection_bytes: Option<f64>,
    /// `tidemark_connected_clients` at the end of the window (the server's own count).
    pub connected_clients: Option<f64>,
    /// Why a figure is missing (a `/metrics` read that failed).
    pub missing: Vec<String>,
}

/// CPU and memory of this process over the window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcIdle {
    /// % of one core.
    pub cpu_pct: Option<f64>,
    /// RSS at the end of the window, bytes.
    pub rss_bytes: Option<u64>,
}

/// One Redis instance over the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RedisIdle {
    /// `mailbox` or `core`.
    pub pool: String,
    /// Index in its pool.
    pub index: usize,
    /// The URL, without its password.
    pub url: String,
    /// Δ`total_commands_processed` / s.
    pub commands_per_s: f64,
    /// Δ(`used_cpu_sys` + `used_cpu_user`) / Δwall × 100.
    pub cpu_pct: f64,
    /// Δcalls / s of every command called in the window.
    pub by_command_per_s: BTreeMap<String, f64>,
}

/// Connects the clients, waits, measures the idle window, disconnects (and stops a local
/// deployment). A local deployment starts redis-server processes whose parent-death signal
/// is bound to the calling thread: await this from the runtime's top-level future.
pub async fn run_idle(opts: &IdleOptions) -> Result<IdleReport, Error> {
    validate(opts)?;
    let open_file_limit = tidemark_server::gateway::raise_open_file_limit().map(|(soft, _)| soft);
    // one descriptor per client socket; a local target holds the server's end too
    let local = matches!(opts.target, Target::Local { .. });
    let needed = if local {
        2 * opts.clients + FD_RESERVE_LOCAL
    } else {
        opts.clients + FD_RESERVE
    };
    if let Some(limit) = open_file_limit.filter(|&l| (l as usize) < needed) {
        return Err(Error::Invalid(format!(
            "{} clients need about {needed} open files in this process, but its limit is \
             {limit} (the hard limit): raise it (ulimit -Hn as root) or use fewer clients",
            opts.clients
        )));
    }
    match &opts.target {
        Target::Local {
            mailbox,
            core,
            shards,
            appendfsync,
        } => {
            let dir = tempfile::Builder::new()
                .prefix("tidemark-idle-")
                .tempdir()?;
            let cancel = CancellationToken::new();
            let defaults = GatewayOptions::default();
            let up_opts = UpOptions {
                mailbox: *mailbox,
                core: *core,
                shards: *shards,
                layout: Layout::PackedV2,
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                data_dir: dir.path().join("data"),
                gateway: GatewayOptions {
                    dev_auth: true,
                    max_connections: defaults.max_connections.max(opts.clients + 64),
                    ..defaults
                },
                materializer: MaterializerOptions::default(),
                appendfsync: appendfsync.clone(),
                cluster: false,
                node: None,
                upgrade: false,
            };
            let Up {
                core,
                mailbox,
                running,
                ..
            } = up(up_opts, cancel.clone()).await?;
            let setup = Setup {
                target: "local",
                ws_urls: vec![running.ws_url()],
                token_secret: None,
                mailbox_urls: mailbox.iter().map(|p| p.url()).collect(),
                core_urls: core.iter().map(|p| p.url()).collect(),
                servers: vec![ServerSource::ThisProcess],
            };
            let result = measure(opts, &setup, open_file_limit).await;
            let stopped = running.shutdown().await;
            drop(mailbox);
            drop(core);
            drop(dir);
            let report = result?;
            stopped?;
            Ok(report)
        }
        Target::Remote {
            ws_urls,
            token_secret,
            mailbox_urls,
            core_urls,
            ..
        } => {
            let metrics = if opts.metrics_urls.is_empty() {
                ws_urls.iter().map(|u| metrics_url_of(u)).collect()
            } else {
                opts.metrics_urls.clone()
            };
            let setup = Setup {
                target: "remote",
                ws_urls: ws_urls.clone(),
                token_secret: token_secret.clone(),
                mailbox_urls: mailbox_urls.clone(),
                core_urls: core_urls.clone(),
                servers: metrics.into_iter().map(ServerSource::Metrics).collect(),
            };
            measure(opts, &setup, open_file_limit).await
        }
    }
}

fn validate(opts: &IdleOptions) -> Result<(), Error> {
    let bad = |s: &str| Err(Error::Invalid(s.into()));
    if opts.clients == 0 {
        return bad("at least 1 client");
    }
    if opts.duration.is_zero() {
        return bad("duration must be positive");
    }
    if opts.concurrency == 0 {
        return bad("concurrency must be at least 1");
    }
    match &opts.target {
        Target::Remote { ws_urls, .. } if ws_urls.is_empty() => bad("give at least one gateway"),
        Target::Local {
            mailbox,
            core,
            shards,
            ..
        } if *mailbox == 0 || *core == 0 || *shards == 0 => {
            bad("a local deployment needs ≥ 1 mailbox, ≥ 1 core instance and ≥ 1 shard")
        }
        _ => Ok(()),
    }
}

/// Where the gateway's figures are read.
enum ServerSource {
    /// This process's `/proc/self` (the service runs here).
    ThisProcess,
    /// A gateway's `/metrics`.
    Metrics(String),
}

impl ServerSource {
    fn name(&self) -> String {
        match self {
            ServerSource::ThisProcess => "this process".into(),
            ServerSource::Metrics(url) => url.clone(),
        }
    }

    async fn sample(&self) -> Result<ProcSample, String> {
        match self {
            ServerSource::ThisProcess => {
                let mut s = self_sample();
                // the in-process gateway's own count, as its /metrics shows it
                let text = tidemark_server::telemetry::metrics_handle().render();
                s.connected_clients = parse_metrics(&text)
                    .get("tidemark_connected_clients")
                    .copied();
                Ok(s)
            }
            ServerSource::Metrics(url) => {
                let text = scrape(url).await?;
                let values = parse_metrics(&text);
                Ok(ProcSample {
                    at: Instant::now(),
                    cpu_s: values.get("process_cpu_seconds_total").copied(),
                    rss_bytes: values
                        .get("process_resident_memory_bytes")
                        .map(|&b| b as u64),
                    connected_clients: values.get("tidemark_connected_clients").copied(),
                })
            }
        }
    }
}

/// Where a run connects.
struct Setup {
    target: &'static str,
    ws_urls: Vec<String>,
    token_secret: Option<Vec<u8>>,
    mailbox_urls: Vec<String>,
    core_urls: Vec<String>,
    servers: Vec<ServerSource>,
}

/// CPU and memory of a process at one instant.
#[derive(Debug, Clone, Copy)]
struct ProcSample {
    at: Instant,
    cpu_s: Option<f64>,
    rss_bytes: Option<u64>,
    connected_clients: Option<f64>,
}

/// What the connections' tasks count.
#[derive(Default)]
struct Counters {
    open: AtomicUsize,
    frames: AtomicU64,
    closed: Mutex<BTreeMap<String, u64>>,
}

impl Counters {
    fn closed(&self, why: String) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        *self
            .closed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(why)
            .or_default() += 1;
    }
}

async fn measure(
    opts: &IdleOptions,
    setup: &Setup,
    open_file_limit: Option<u64>,
) -> Result<IdleReport, Error> {
    // Redis first: a bad URL fails before any client connects.
    let mut redis = Vec::new();
    for (pool, urls) in [("mailbox", &setup.mailbox_urls), ("core", &setup.core_urls)] {
        for (index, url) in urls.iter().enumerate() {
            redis.push(
                Watched::connect(pool, index, url)
                    .await
                    .map_err(info_error)?,
            );
        }
    }
    let mut missing: Vec<Vec<String>> = setup.servers.iter().map(|_| Vec::new()).collect();
    let before = sample_servers(&setup.servers, &mut missing).await;

    let targets = resolve_targets(&setup.ws_urls).await?;
    let sources = match &opts.source_addrs {
        Some(list) => list.clone(),
        None if targets
            .iter()
            .all(|(_, a)| a.ip().is_loopback() && a.is_ipv4()) =>
        {
            (0..opts.clients.div_ceil(CLIENTS_PER_SOURCE_ADDR))
                .map(|i| IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2 + i as u8)))
                .collect()
        }
        None => Vec::new(),
    };

    let counters = Arc::new(Counters::default());
    let stop = CancellationToken::new();
    let _stop_on_exit = stop.clone().drop_guard();
    let started = Instant::now();
    let (holders, by_source, connect_errors) =
        connect_all(opts, setup, &targets, &sources, &counters, &stop).await;
    let connect_s = started.elapsed().as_secs_f64();
    let connected = holders.len();
    if connected == 0 {
        return Err(Error::Invalid(format!(
            "no client could connect: {connect_errors:?}"
        )));
    }

    sleep(opts.settle).await;
    let closed_before = counters
        .closed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    counters.frames.store(0, Ordering::Relaxed);
    let a_servers = sample_servers(&setup.servers, &mut missing).await;
    let a_self = self_sample();
    let a_redis = sample_redis(&mut redis).await?;

    idle_window(opts, &counters).await;

    let b_redis = sample_redis(&mut redis).await?;
    let b_self = self_sample();
    let b_servers = sample_servers(&setup.servers, &mut missing).await;
    let frames_while_idle = counters.frames.load(Ordering::Relaxed);
    let open_at_end = counters.open.load(Ordering::Relaxed);
    let mut closed = counters
        .closed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    for (why, n) in closed_before {
        if let Some(c) = closed.get_mut(&why) {
            *c -= n.min(*c);
        }
    }
    closed.retain(|_, n| *n > 0);

    stop.cancel();
    for h in holders {
        let _ = h.await;
    }

    let servers = setup
        .servers
        .iter()
        .enumerate()
        .map(|(i, source)| {
            server_idle(
                source.name(),
                before[i],
                a_servers[i],
                b_servers[i],
                connected,
                std::mem::take(&mut missing[i]),
            )
        })
        .collect();
    let mut redis_report = Vec::new();
    let mut total = 0.0;
    let mut by_command: BTreeMap<String, f64> = BTreeMap::new();
    for (i, w) in redis.iter().enumerate() {
        let r = redis_idle(w, &a_redis[i], &b_redis[i]);
        total += r.commands_per_s;
        for (cmd, rate) in &r.by_command_per_s {
            *by_command.entry(cmd.clone()).or_default() += rate;
        }
        redis_report.push(r);
    }
    Ok(IdleReport {
        target: setup.target.to_owned(),
        clients: opts.clients,
        connected,
        connect_errors,
        connect_s,
        source_addrs: by_source,
        open_file_limit,
        duration_s: b_self.at.duration_since(a_self.at).as_secs_f64(),
        closed,
        frames_while_idle,
        open_at_end,
        servers,
        generator: ProcIdle {
            cpu_pct: cpu_pct(&a_self, &b_self),
            rss_bytes: b_self.rss_bytes,
        },
        redis: redis_report,
        redis_commands_per_s: total,
        redis_by_command_per_s: by_command,
    })
}

/// Waits out the window, with a progress bar of the seconds and the connections still open.
async fn idle_window(opts: &IdleOptions, counters: &Counters) {
    let secs = opts.duration.as_secs_f64();
    let pb = bar(
        opts,
        opts.duration.as_secs().max(1),
        "idle {elapsed_precise} [{bar:30}] {pos}/{len} s {msg}",
    );
    let end = Instant::now() + opts.duration;
    let start = Instant::now();
    while Instant::now() < end {
        sleep(TICK.min(end.saturating_duration_since(Instant::now()))).await;
        pb.set_position(start.elapsed().as_secs_f64().min(secs) as u64);
        pb.set_message(format!("{} open", counters.open.load(Ordering::Relaxed)));
    }
    pb.finish_and_clear();
}

fn server_idle(
    source: String,
    before: Option<ProcSample>,
    a: Option<ProcSample>,
    b: Option<ProcSample>,
    connected: usize,
    missing: Vec<String>,
) -> ServerIdle {
    let cpu = match (a, b) {
        (Some(a), Some(b)) => cpu_pct(&a, &b),
        _ => None,
    };
    let rss_before = before.and_then(|s| s.rss_bytes);
    let rss = b.and_then(|s| s.rss_bytes);
    ServerIdle {
        source,
        cpu_pct: cpu,
        rss_before_bytes: rss_before,
        rss_connected_bytes: a.and_then(|s| s.rss_bytes),
        rss_bytes: rss,
        rss_per_connection_bytes: match (rss_before, rss) {
            (Some(x), Some(y)) if connected > 0 => Some((y as f64 - x as f64) / connected as f64),
            _ => None,
        },
        connected_clients: b.and_then(|s| s.connected_clients),
        missing,
    }
}

fn cpu_pct(a: &ProcSample, b: &ProcSample) -> Option<f64> {
    let wall = b.at.duration_since(a.at).as_secs_f64();
    match (a.cpu_s, b.cpu_s) {
        (Some(x), Some(y)) if wall > 0.0 => Some((y - x).max(0.0) / wall * 100.0),
        _ => None,
    }
}

/// One sample of every server; a failed read is `None`, its reason kept in `missing`.
async fn sample_servers(
    servers: &[ServerSource],
    missing: &mut [Vec<String>],
) -> Vec<Option<ProcSample>> {
    let mut out = Vec::new();
    for (i, s) in servers.iter().enumerate() {
        match s.sample().await {
            Ok(v) => out.push(Some(v)),
            Err(e) => {
                missing[i].push(e);
                out.push(None);
            }
        }
    }
    out
}

/// `(ws_url, address)` of every gateway.
async fn resolve_targets(ws_urls: &[String]) -> Result<Vec<(String, SocketAddr)>, Error> {
    let mut out = Vec::new();
    for url in ws_urls {
        let Some(rest) = url.strip_prefix("ws://") else {
            return Err(Error::Invalid(format!(
                "{url}: bench idle connects to ws:// URLs only"
            )));
        };
        let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
        let hostport = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        {
            authority.to_owned()
        } else {
            format!("{authority}:80")
        };
        let addr = tokio::net::lookup_host(hostport.as_str())
            .await?
            .next()
            .ok_or_else(|| Error::Invalid(format!("{url}: the host has no address")))?;
        out.push((url.clone(), addr));
    }
    Ok(out)
}

type Connected = (
    Vec<JoinHandle<()>>,
    BTreeMap<String, usize>,
    BTreeMap<String, u64>,
);

/// Connects every client (`concurrency` at a time; client `i` to gateway `i % len`, from
/// source address `i % len`) and starts its task; returns the tasks, the connections per
/// local address, and the connections that failed by code.
async fn connect_all(
    opts: &IdleOptions,
    setup: &Setup,
    targets: &[(String, SocketAddr)],
    sources: &[IpAddr],
    counters: &Arc<Counters>,
    stop: &CancellationToken,
) -> Connected {
    let tag = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64 & 0xff_ffff)
        .unwrap_or(0);
    let ttl = opts.settle + opts.duration + Duration::from_secs(3600);
    let pb = bar(
        opts,
        opts.clients as u64,
        "connecting [{bar:30}] {pos}/{len} clients {msg}",
    );
    let mut holders = Vec::with_capacity(opts.clients);
    let mut by_source: BTreeMap<String, usize> = BTreeMap::new();
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    let mut stream = futures::stream::iter(0..opts.clients)
        .map(|i| {
            let user = format!("id{tag:06x}-{i}");
            let auth = match &setup.token_secret {
                Some(secret) => tidemark_client::make_token(secret, &user, ttl).map(Auth::Token),
                None => Ok(Auth::DevUser(user)),
            };
            let (url, addr) = &targets[i % targets.len()];
            let source = (!sources.is_empty()).then(|| sources[i % sources.len()]);
            async move {
                match auth {
                    Ok(auth) => connect_one(url, *addr, source, &auth).await,
                    Err(e) => Err(e.code().to_owned()),
                }
            }
        })
        .buffer_unordered(opts.concurrency);
    while let Some(result) = stream.next().await {
        match result {
            Ok((hs, local)) => {
                *by_source.entry(local.ip().to_string()).or_default() += 1;
                counters.open.fetch_add(1, Ordering::Relaxed);
                holders.push(tokio::spawn(hold(hs.ws, counters.clone(), stop.clone())));
            }
            Err(code) => {
                *errors.entry(code).or_default() += 1;
                pb.set_message(format!("failed {errors:?}"));
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    (holders, by_source, errors)
}

/// One client: TCP from `source` (if any), upgrade, `ready`; retried. The error is a code.
async fn connect_one(
    url: &str,
    addr: SocketAddr,
    source: Option<IpAddr>,
    auth: &Auth,
) -> Result<(Handshaken, SocketAddr), String> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let (code, retry) = match tcp_connect(addr, source).await {
            Ok(tcp) => {
                let local = tcp.local_addr().map_err(|e| io_code(&e))?;
                let config = WebSocketConfig::default().read_buffer_size(CLIENT_READ_BUFFER);
                match handshake_on(tcp, url, auth, config, CONNECT_TIMEOUT).await {
                    Ok(hs) => return Ok((hs, local)),
                    Err(e) => (e.code().to_owned(), e.retryable()),
                }
            }
            Err(e) => (io_code(&e), true),
        };
        if !retry || attempt >= CONNECT_ATTEMPTS {
            return Err(code);
        }
        sleep(Duration::from_millis(200 * attempt as u64)).await;
    }
}

fn io_code(e: &std::io::Error) -> String {
    format!("tcp_{:?}", e.kind()).to_lowercase()
}

/// A TCP connection to `addr`, bound to `source` first (its port chosen at connect time).
async fn tcp_connect(addr: SocketAddr, source: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(ip) = source {
        bind_address_no_port(&socket);
        socket.bind(SocketAddr::new(ip, 0))?;
    }
    let tcp = tokio::time::timeout(CONNECT_TIMEOUT, socket.connect(addr))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// `IP_BIND_ADDRESS_NO_PORT` (Linux): a bound socket takes its port when it connects, so a
/// port is only unique per destination and a source address is not limited to one
/// ephemeral range in all. Best effort.
fn bind_address_no_port(socket: &TcpSocket) {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: setsockopt reads `one` for the size given; the fd is the socket's own.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            std::ptr::addr_of!(one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Holds one connection until `stop`: reads (which answers the server's pings), counts text
/// frames, and records how the connection ended if it did.
async fn hold(
    mut ws: WebSocketStream<TcpStream>,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = stop.cancelled() => return,
            m = ws.next() => m,
        };
        match msg {
            Some(Ok(Message::Text(_))) => {
                counters.frames.fetch_add(1, Ordering::Relaxed);
            }
            Some(Ok(Message::Close(frame))) => {
                let why =
                    frame.map_or_else(|| "close".to_owned(), |f| u16::from(f.code).to_string());
                counters.closed(why);
                return;
            }
            Some(Ok(_)) => {}
            Some(Err(_)) => {
                counters.closed("error".into());
                return;
            }
            None => {
                counters.closed("eof".into());
                return;
            }
        }
    }
}

/// A bar of `len` steps drawn with `template`; hidden without `opts.progress`.
fn bar(opts: &IdleOptions, len: u64, template: &str) -> ProgressBar {
    if !opts.progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb
}

/// This process, now (Linux `/proc/self`; `None` figures elsewhere).
fn self_sample() -> ProcSample {
    // the reading of /proc/self that `bench load` uses, plus this report's extra field
    let p = crate::load::self_sample();
    ProcSample {
        at: p.at,
        cpu_s: p.cpu_s,
        rss_bytes: p.rss_bytes,
        connected_clients: None,
    }
}

/// `http://HOST:PORT/metrics` of a gateway's `ws://HOST:PORT/…` URL.
pub fn metrics_url_of(ws_url: &str) -> String {
    let rest = ws_url.split_once("://").map_or(ws_url, |(_, r)| r);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or(rest);
    format!("http://{authority}/metrics")
}

/// The body of `GET url` (plain HTTP/1.0).
async fn scrape(url: &str) -> Result<String, String> {
    let fail = |why: String| format!("{url}: {why}");
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| fail("only http:// is supported".into()))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let hostport = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let read = async {
        let mut tcp = TcpStream::connect(hostport.as_str()).await?;
        let req = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
        tcp.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        tcp.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(SCRAPE_TIMEOUT, read)
        .await
        .map_err(|_| fail(format!("no answer within {SCRAPE_TIMEOUT:?}")))?
        .map_err(|e| fail(e.to_string()))?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| fail("not an HTTP response".into()))?;
    let status = head.split_whitespace().nth(1).unwrap_or_default();
    if status != "200" {
        return Err(fail(format!("HTTP {status}")));
    }
    Ok(body.to_owned())
}

/// Unlabelled samples of a Prometheus text page, by name.
fn parse_metrics(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.split_once(' ')?;
            if name.contains('{') {
                return None;
            }
            Some((name.to_owned(), value.trim().parse().ok()?))
        })
        .collect()
}

/// One instance's `INFO` counters ([`Watched::sample`]) and when they were read.
struct RedisSample {
    at: Instant,
    info: Sample,
}

/// [`Watched`]'s error as this report's (it only fails on Redis).
fn info_error(e: crate::engine::Error) -> Error {
    match e {
        crate::engine::Error::Redis { url, source } => Error::Redis { url, source },
        other => Error::Unreadable(other.to_string()),
    }
}

async fn sample_redis(watched: &mut [Watched]) -> Result<Vec<RedisSample>, Error> {
    futures::future::join_all(watched.iter_mut().map(|w| async {
        let info = w.sample().await.map_err(info_error)?;
        Ok(RedisSample {
            at: Instant::now(),
            info,
        })
    }))
    .await
    .into_iter()
    .collect()
}

fn redis_idle(w: &Watched, a: &RedisSample, b: &RedisSample) -> RedisIdle {
    let wall = b.at.duration_since(a.at).as_secs_f64().max(1e-9);
    let (a, b) = (&a.info, &b.info);
    let by_command_per_s = b
        .by_command
        .iter()
        .filter_map(|(cmd, &(calls, _))| {
            let before = a.by_command.get(cmd).map_or(0, |&(c, _)| c);
            let d = calls.saturating_sub(before);
            (d > 0).then(|| (cmd.clone(), d as f64 / wall))
        })
        .collect();
    RedisIdle {
        pool: w.pool.to_owned(),
        index: w.index,
        url: tidemark_store::redact_url(w.url()),
        commands_per_s: b.commands.saturating_sub(a.commands) as f64 / wall,
        cpu_pct: (b.cpu_s - a.cpu_s).max(0.0) / wall * 100.0,
        by_command_per_s,
    }
}

/// What `tidemark bench idle` prints.
pub fn render(r: &IdleReport) -> String {
    use std::fmt::Write as _;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or_else(|| "—".into(), f);
    let mut out = String::new();
    let sources = if r.source_addrs.is_empty() {
        "—".to_owned()
    } else {
        r.source_addrs
            .iter()
            .map(|(a, n)| format!("{a} ×{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let _ = writeln!(
        out,
        "{} of {} clients connected in {:.1} s (from {sources}; open-file limit {}), idle {:.1} s",
        r.connected,
        r.clients,
        r.connect_s,
        r.open_file_limit
            .map_or_else(|| "unknown".into(), |n| n.to_string()),
        r.duration_s
    );
    if !r.connect_errors.is_empty() {
        let _ = writeln!(out, "connections failed: {:?}", r.connect_errors);
    }
    let _ = writeln!(
        out,
        "while idle: {} closed {:?}, {} text frames received, {} open at the end",
        r.closed.values().sum::<u64>(),
        r.closed,
        r.frames_while_idle,
        r.open_at_end
    );
    out.push('\n');
    out.push_str("| process | CPU (% of a core) | RSS before | RSS connected | RSS at end | RSS per connection | connected (server) |\n|---|---|---|---|---|---|---|\n");
    for s in &r.servers {
        let _ = writeln!(
            out,
            "| server {} | {} | {} | {} | {} | {} | {} |",
            s.source,
            opt(s.cpu_pct, &|v| format!("{v:.2}%")),
            opt(s.rss_before_bytes.map(mib), &|v| format!("{v:.1} MiB")),
            opt(s.rss_connected_bytes.map(mib), &|v| format!("{v:.1} MiB")),
            opt(s.rss_bytes.map(mib), &|v| format!("{v:.1} MiB")),
            opt(s.rss_per_connection_bytes, &|v| format!(
                "{:.1} KiB",
                v / 1024.0
            )),
            opt(s.connected_clients, &|v| format!("{v:.0}")),
        );
    }
    let _ = writeln!(
        out,
        "| generator (this process) | {} | | | {} | | |",
        opt(r.generator.cpu_pct, &|v| format!("{v:.2}%")),
        opt(r.generator.rss_bytes.map(mib), &|v| format!("{v:.1} MiB")),
    );
    for s in &r.servers {
        for m in &s.missing {
            let _ = writeln!(out, "missing: {m}");
        }
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "Redis: {:.1} commands/s in all",
        r.redis_commands_per_s
    );
    out.push_str("| instance | commands/s | CPU % | by command (calls/s) |\n|---|---|---|---|\n");
    for i in &r.redis {
        let mut cmds: Vec<_> = i.by_command_per_s.iter().collect();
        cmds.sort_by(|a, b| b.1.total_cmp(a.1));
        let cmds = cmds
            .iter()
            .map(|(c, v)| format!("{c} {v:.1}"))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            out,
            "| {} {} | {:.1} | {:.2}% | {} |",
            i.pool, i.index, i.commands_per_s, i.cpu_pct, cmds
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_info_and_metrics() {
        let text =
            "# Commandstats\r\ncmdstat_evalsha:calls=1000,usec=186510,usec_per_call=186.51\r\n\
                    cmdstat_client|setinfo:calls=2,usec=1\r\n# CPU\r\nused_cpu_sys:1.5\r\n\
                    used_cpu_user:2.25\r\n# Stats\r\ntotal_commands_processed:4242\r\n";
        let s = crate::engine::parse_info(text);
        assert_eq!(s.commands, 4242);
        assert_eq!(s.by_command["evalsha"].0, 1000);
        assert_eq!(s.by_command["client|setinfo"].0, 2);
        assert!((s.cpu_s - 3.75).abs() < 1e-9);

        let m = parse_metrics(
            "# HELP process_cpu_seconds_total x\n# TYPE process_cpu_seconds_total gauge\n\
             process_cpu_seconds_total 12.5\nprocess_resident_memory_bytes 1048576\n\
             tidemark_ws_closes_total{code=\"1000\"} 3\ntidemark_connected_clients 7\n",
        );
        assert_eq!(m["process_cpu_seconds_total"], 12.5);
        assert_eq!(m["process_resident_memory_bytes"], 1048576.0);
        assert_eq!(m["tidemark_connected_clients"], 7.0);
        assert!(!m.keys().any(|k| k.contains('{')));
        assert_eq!(
            metrics_url_of("ws://127.0.0.1:7400/v1/ws?user=x"),
            "http://127.0.0.1:7400/metrics"
        );
    }
}
