//! The gateway: clients' WebSocket and HTTP front door (client protocol v1, `docs/protocol.md`).
//!
//! ```text
//!   GET  /v1/ws             WebSocket: send / ack / sync in, ready / send_ack / deliver / error out
//!   POST /v1/messages       send one message
//!   GET  /v1/mailbox        read a page of the caller's mailbox (never above the lane's W)
//!   POST /v1/mailbox/ack    ack up to a seq
//!   GET  /metrics           Prometheus text
//!   GET  /healthz           200 "ok", or 503 with one problem per line
//!   GET  /v1/admin/status   the deployment's status, JSON (admin token; `/stream`: SSE)
//!   GET  /, /ops            the console and the operations view (static, embedded)
//!   GET  /v1/client.js      the browser client; /v1/openapi.yaml, /v1/ws-frames.schema.json
//! ```
//!
//! With an admin listener (`admin_listen`), `/metrics` and `/healthz` are served there only
//! (plain HTTP, no auth) and the client listener answers them like any unknown path (401
//! without credentials, else 404 `not_found`). The client
//! listener may serve TLS ([`TlsConfig`]: `wss://`, `https://`).
//!
//! - **Send** ([`send`], [`CommitPath`]): recipients are grouped by shard and committed to every shard's core
//!   instance concurrently; `send_ack` once all have committed. At most
//!   `max_inflight_commits` commits are in flight gateway-wide, and at most a per-user share
//!   of them for one user; a send that finds no room within 100 ms is refused with
//!   `overloaded` (retryable, nothing lost). An optional per-user send rate refuses sends
//!   above it with `rate_limited` ([`users`]). A WebSocket
//!   connection commits its sends in the order received (its one-shard sends queued for a
//!   round as they arrive, ADR-0089; a send to several shards after everything before it), so
//!   a client's sends to one mailbox keep their order.
//! - **Delivery** ([`ws`]): each connection has a delivery loop that reads the mailbox after
//!   its cursor, keeps only entries at or below the lane's W, and pushes `deliver` frames in
//!   seq order. It is woken by the [`wake`] hub (Pub/Sub hints naming the user), by a periodic
//!   re-check (missed hints) and by `sync`. Pub/Sub is a hint only, never the data path.
//! - **Writer**: one task per socket owns the sink and drains a bounded channel; the reader,
//!   the sender and the delivery loop feed it (the delivery loop waits for room: backpressure).
//! - **Connections** ([`listener`]): HTTP/1.1 served by hyper with a header-read timeout
//!   (which bounds a TLS handshake too); at most `max_connections` open sockets (WebSockets
//!   and TLS connections included), a small reserve above it for `/healthz` and `/metrics`
//!   (none when they live on the admin listener), and an HTTP 503 `overloaded` beyond. A
//!   WebSocket is pinged every `ping_interval` and closed (4002) when nothing arrives for
//!   `idle_timeout`.
//! - **Memory per client**: a WebSocket's queued outbound frames are bounded in bytes
//!   (`max_queued_bytes`); a connection whose frames wait for room longer than
//!   `slow_client_grace` is closed (4003). Mailbox pages are bounded in bytes
//!   (`max_page_bytes`), and any socket whose writes make no progress for the grace period
//!   (an HTTP response nobody reads) is closed.
//! - **Shutdown**: on `cancel` the listener stops, every socket is closed (1001 going away),
//!   and every task this module spawned is joined before [`serve`] returns.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tidemark_protocol::Limits;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::health::HealthBoard;
use tidemark_store::topology::ShardMap;

mod acks;
pub use acks::DEFAULT_ACK_INTERVAL;
mod admin;
mod auth;
mod batch;
mod commit;
mod group_commit;
mod http;
mod listener;
mod mailbox;
mod send;
mod state;
mod tls;
mod users;
mod wake;
mod web;
mod ws;

pub use commit::{CommitPath, SendFailure};
pub use tls::{TlsConfig, TlsError};
pub use wake::LocalDelivery;

/// Fault injection for tests of a connection's supervision (like the materializer's
/// `ChunkFault`).
pub trait SendFault: Send + Sync + std::fmt::Debug {
    /// True: the commit of `sender`'s send `id` panics before it starts (a connection's
    /// sends are committed by its reader, ADR-0054: the panic must close that connection,
    /// never leave it open and deaf).
    fn panic_commit(&self, sender: &str, id: &str) -> bool;

    /// True: the delivery loop of a connection of `user` panics before it pushes entry
    /// `seq` (the connection must be closed with 1011, never left open and not delivering).
    fn panic_delivery(&self, _user: &str, _seq: u64) -> bool {
        false
    }

    /// True: the writer of a connection of `user` panics before it writes entry `seq` (the
    /// socket's sink goes with it: the connection must end, never stay open and silent).
    fn panic_write(&self, _user: &str, _seq: u64) -> bool {
        false
    }

    /// True: the delivery loop of a connection of `user` ignores this wake, as if it had been
    /// lost between the hub and the loop (whatever could lose one); with nothing else to
    /// wake it, the sweep must find the connection behind and make it read (ADR-0067).
    /// `forced`: the sweep has flagged this connection to read in full (its end-to-end
    /// check), so a test can drop every other wake and still see the sweep's get through.
    fn ignore_wake(&self, _user: &str, _forced: bool) -> bool {
        false
    }

    /// True: the reader of a connection of `user` panics on its `sync` frame (the connection
    /// must close with 1011 and the panic be counted, like the other tasks').
    fn panic_sync(&self, _user: &str, _after: u64) -> bool {
        false
    }
}

/// Most open connections on the admin listener (it serves scrapes and health checks only).
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// Gateway settings.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// Frame/body/recipient limits.
    pub limits: Limits,
    /// HMAC secret for bearer tokens (None: tokens are refused).
    pub token_secret: Option<Vec<u8>>,
    /// Accept `?user=NAME` without a token (development only).
    pub dev_auth: bool,
    /// With dev auth: accept requests for any `Host` (`--dev-auth-public`: the gateway is
    /// reached from other machines by name or address). Otherwise dev auth serves only a
    /// loopback `Host` (`localhost`, `127.0.0.0/8`, `[::1]`), so that a page whose name an
    /// attacker re-points at 127.0.0.1 (DNS rebinding) cannot act as a user (ADR-0115).
    pub dev_auth_public: bool,
    /// Most commits in flight before `send` is refused with `overloaded`.
    pub max_inflight_commits: usize,
    /// Most commits in flight (or queued on its connections) for one user; 0: an eighth of
    /// `max_inflight_commits`. Keeps one user from taking every permit.
    pub max_inflight_commits_per_user: usize,
    /// Most open WebSockets of one user; beyond, the upgrade is refused with 429
    /// `too_many_connections`.
    pub max_connections_per_user: usize,
    /// Sends per second one user may make (WebSocket and HTTP together); 0: no limit. Above
    /// it a send is refused with `rate_limited`.
    pub send_rate_per_user: f64,
    /// Sends a user may make at once before the rate applies; 0: one second's worth.
    pub send_burst_per_user: u32,
    /// Periodic re-read of every connected mailbox; `None` (the default): never. Sequenced
    /// wake hints, a re-check of every connection when a subscriber reconnects and the
    /// watermark sweep leave nothing for it to find (ADR-0035); it costs one mailbox read per
    /// connection per interval.
    pub recheck_interval: Option<Duration>,
    /// How often each mailbox instance's watermarks are swept for moves that no wake hint
    /// announced (one script call per instance).
    pub wake_sweep_interval: Duration,
    /// Most open client connections (sockets, WebSockets included); above it requests are
    /// answered 503 `overloaded`. Lowered at start to fit the open-file limit.
    pub max_connections: usize,
    /// Connections above `max_connections` that are still read, to answer `GET /healthz` and
    /// `GET /metrics` (every other request on them gets 503 `overloaded`).
    pub health_reserve: usize,
    /// A request head (or the next one on an idle keep-alive connection) must arrive within
    /// this time; a request body too.
    pub header_read_timeout: Duration,
    /// A WebSocket is pinged after this long without a frame from the client.
    pub ping_interval: Duration,
    /// A WebSocket from which nothing (not even a pong) arrives for this long is closed (4002).
    pub idle_timeout: Duration,
    /// Bytes of outbound frames a WebSocket may have queued for its writer (one frame larger
    /// than this still goes, alone).
    pub max_queued_bytes: usize,
    /// A WebSocket whose frames wait this long for room in its queue is closed (4003); an
    /// HTTP response whose writes make no progress for this long is dropped.
    pub slow_client_grace: Duration,
    /// Stored bytes of mailbox entries in one `GET /v1/mailbox` page (the entry that reaches
    /// it is the page's last); WebSocket delivery reads pages of at most this and
    /// `max_queued_bytes`.
    pub max_page_bytes: usize,
    /// Serve the client listener inside TLS (`wss://`, `https://`); None: plain.
    pub tls: Option<TlsConfig>,
    /// Serve `/metrics` and `/healthz` on this address only (plain HTTP, no auth), and answer
    /// them 404 on the client listener. Bound by `run::serve` before anything starts.
    pub admin_listen: Option<SocketAddr>,
    /// Serve the client protocol (WebSocket, messages, mailbox). False: a materializer node
    /// (`serve --role materializer`) whose listeners answer `/metrics` and `/healthz` only.
    pub clients: bool,
    /// `/healthz` reports a shard whose W has stayed below its log head, without moving, for
    /// this long (`stuck at W=…`).
    pub stuck_after: Duration,
    /// Replicas a commit must reach before `send_ack` (`WAIT` after the commit; ADR-0032).
    pub core_wait: tidemark_store::redis::dlog::WaitPolicy,
    /// Shortest time from one commit round of a core instance to the next (group commit,
    /// ADR-0045; a round of a full call's worth goes at once, ADR-0090): under steady traffic
    /// each round carries more sends, so core Redis makes fewer passes (and `fdatasync`s) per
    /// message; a send never waits longer than this for its round. Zero: a round starts as
    /// soon as the previous one is answered.
    pub commit_linger: Duration,
    /// Whether `run::serve`, in a process that also materializes, lets its materializers
    /// hand fresh hot-path entries straight to the connections (ADR-0041). Off: every
    /// delivery is read from the mailbox after its wake hint (as a gateway-only node does).
    pub local_delivery: bool,
    /// The handle `run::serve` shares between this gateway and its materializers when
    /// `local_delivery` applies; `None`: every delivery is read.
    pub local: Option<LocalDelivery>,
    /// Whether `run::serve`, in a process that also materializes, hands the records this
    /// gateway commits to its materializers (ADR-0049), so that they seldom read the logs.
    /// Off: the materializers read every record back with `XREAD`.
    pub commit_feed: bool,
    /// The handle `run::serve` shares between this gateway and its materializers when
    /// `commit_feed` applies; `None`: nothing is handed over.
    pub feed: Option<crate::materializer::CommitFeed>,
    /// How long the WebSocket acks of a mailbox instance gather before they are written, in
    /// pipelines (ADR-0038, ADR-0074): a connection's cursor is written at most once per
    /// interval, with the highest seq it acked. A gateway that crashes loses at most this
    /// much of its clients' acks (those entries are delivered again); a closing connection
    /// writes its last ack at once, and HTTP acks are written before their reply.
    pub ack_interval: Duration,
    /// Fault injection for tests (`None` in service).
    pub send_fault: Option<std::sync::Arc<dyn SendFault>>,
}

/// [`GatewayOptions::commit_linger`]'s default (ADR-0045; 1 ms until ADR-0090: 5 ms took about
/// a third off core Redis's CPU per message at 5,000 msg/s for about 1 ms of median latency).
pub const DEFAULT_COMMIT_LINGER: Duration = Duration::from_millis(5);

impl Default for GatewayOptions {
    fn default() -> Self {
        GatewayOptions {
            core_wait: Default::default(),
            commit_linger: DEFAULT_COMMIT_LINGER,
            ack_interval: acks::DEFAULT_ACK_INTERVAL,
            clients: true,
            limits: Limits::default(),
            token_secret: None,
            dev_auth: false,
            dev_auth_public: false,
            max_inflight_commits: 4096,
            max_inflight_commits_per_user: 0,
            max_connections_per_user: 16,
            send_rate_per_user: 0.0,
            send_burst_per_user: 0,
            recheck_interval: None,
            wake_sweep_interval: wake::SWEEP_EVERY,
            max_connections: 10_000,
            health_reserve: 32,
            header_read_timeout: Duration::from_secs(10),
            ping_interval: Duration::from_secs(20),
            idle_timeout: Duration::from_secs(60),
            max_queued_bytes: 64 * 1024,
            slow_client_grace: Duration::from_secs(30),
            max_page_bytes: 1024 * 1024,
            tls: None,
            admin_listen: None,
            stuck_after: Duration::from_secs(10),
            local_delivery: true,
            local: None,
            commit_feed: true,
            feed: None,
            send_fault: None,
        }
    }
}

/// Gateway errors.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// Storage failure at startup.
    #[error(transparent)]
    Store(#[from] tidemark_store::Error),
    /// Listener failure.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl GatewayError {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::Store(e) => e.code(),
            GatewayError::Io(_) => "io",
        }
    }
}

/// Serves WebSocket and HTTP on `listener` until `cancel`, then joins every task. When
/// `opts.admin_listen` is set, binds it first and serves `/metrics` and `/healthz` there
/// ([`serve_listeners`]).
///
/// Connects to every core and mailbox instance of `map` first (an unreachable instance
/// is an error here, before anything is served).
pub async fn serve(
    listener: tokio::net::TcpListener,
    map: ShardMap,
    opts: GatewayOptions,
    health: Arc<HealthBoard>,
    cancel: CancellationToken,
) -> Result<(), GatewayError> {
    let admin = match opts.admin_listen {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await?),
        None => None,
    };
    serve_listeners(listener, admin, map, opts, health, cancel).await
}

/// [`serve`] on listeners bound by the caller: `listener` for clients (TLS when `opts.tls`
/// is set) and, when given, `admin` for `/metrics` and `/healthz` (then `opts.admin_listen`
/// is ignored).
pub async fn serve_listeners(
    listener: tokio::net::TcpListener,
    admin: Option<tokio::net::TcpListener>,
    map: ShardMap,
    opts: GatewayOptions,
    health: Arc<HealthBoard>,
    cancel: CancellationToken,
) -> Result<(), GatewayError> {
    let mut opts = opts;
    if admin.is_some() {
        // health checks go to the admin listener: no reserve for them here
        opts.health_reserve = 0;
    }
    let fds_reserved = opts.health_reserve
        + if admin.is_some() {
            ADMIN_MAX_CONNECTIONS
        } else {
            0
        };
    opts.max_connections = fit_to_open_file_limit(opts.max_connections, fds_reserved);
    // Our own token: stopping the gateway (also on a listener failure) must not cancel the
    // caller's other services.
    let stop = cancel.child_token();
    let tracker = TaskTracker::new();
    let shared = state::Shared::connect(map, opts, health, stop.clone(), tracker.clone()).await?;

    // wake hints only matter to connected clients
    let wake_urls = if shared.opts.clients {
        shared.map.mailbox_urls().to_vec()
    } else {
        Vec::new()
    };
    // a subscriber that cannot subscribe for long is a `/healthz` problem (ADR-0126)
    shared.hub.report_to(shared.health.clone());
    for (index, url) in wake_urls.into_iter().enumerate() {
        // supervised: a panic restarts the subscriber, which wakes every connection again
        let (hub, stop2) = (shared.hub.clone(), stop.clone());
        let shards = shared.map.all_shards();
        let own: Vec<u32> = shards
            .clone()
            .filter(|&s| shared.map.mailbox_of(s) == index)
            .collect();
        let store = shared.mailbox_store(index);
        let every = shared.opts.wake_sweep_interval;
        tracker.spawn(crate::supervise::supervise(
            "wake_subscriber",
            stop.clone(),
            Some(shared.health.clone()),
            move || {
                let (hub, url, stop) = (hub.clone(), url.clone(), stop2.clone());
                let shards = shards.clone();
                let sweep = wake::Sweep::new(store.clone(), own.clone(), every);
                async move {
                    wake::run_subscriber(hub, url, shards, sweep, stop).await;
                    Ok::<(), std::convert::Infallible>(())
                }
            },
            |_| {},
        ));
    }

    // `addr=127.0.0.1:7400` in the logs, not `Some(…)`
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let opts = &shared.opts;
    let client_cfg = listener::ListenerConfig {
        max: opts.max_connections,
        reserve: opts.health_reserve,
        header_timeout: opts.header_read_timeout,
        write_stall: opts.slow_client_grace,
        tls: opts.tls.clone(),
    };
    let (routes, admin_serve) = match admin {
        None if !opts.clients => (http::Routes::Admin, None),
        None => (http::Routes::All, None),
        Some(admin) => {
            let admin_addr = admin
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default();
            tracing::info!(%admin_addr, "admin listener (/metrics, /healthz) listening");
            let cfg = listener::ListenerConfig {
                max: ADMIN_MAX_CONNECTIONS,
                reserve: 0,
                tls: None,
                ..client_cfg.clone()
            };
            let app = http::router(shared.clone(), http::Routes::Admin);
            let serve = listener::serve(admin, app, cfg, stop.clone(), tracker.clone());
            let routes = if opts.clients {
                http::Routes::Public
            } else {
                http::Routes::Admin
            };
            (routes, Some(serve))
        }
    };
    tracing::info!(%addr, tls = opts.tls.is_some(), "gateway listening");
    let app = http::router(shared.clone(), routes);
    let client_serve = listener::serve(listener, app, client_cfg, stop.clone(), tracker.clone());
    match admin_serve {
        Some(admin_serve) => {
            tokio::join!(client_serve, admin_serve);
        }
        None => client_serve.await,
    }
    // Stops sockets and hubs.
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    tracing::info!(%addr, "gateway stopped");
    Ok(())
}

/// File descriptors kept for everything but client sockets (Redis connections, files).
const FD_HEADROOM: usize = 256;

/// Raises this process's soft open-file limit to its hard limit (as servers do at startup:
/// every client socket is a descriptor) and returns `(soft, hard)` after it; `None` when the
/// limit cannot be read. Safe to call more than once.
pub fn raise_open_file_limit() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read/write the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = raised.rlim_cur;
        }
    }
    Some((lim.rlim_cur, lim.rlim_max))
}

/// Raises the soft open-file limit to the hard one ([`raise_open_file_limit`], logged) and
/// returns `max_connections`, lowered (with a warning) if the limit cannot hold it: a gateway
/// out of descriptors can no longer accept anything, `/healthz` included.
fn fit_to_open_file_limit(max_connections: usize, reserve: usize) -> usize {
    let want = (max_connections + reserve + FD_HEADROOM) as u64;
    let Some((limit, hard)) = raise_open_file_limit() else {
        return max_connections;
    };
    tracing::info!(
        open_file_limit = limit,
        hard_limit = hard,
        max_connections,
        "open-file limit"
    );
    if limit >= want {
        return max_connections;
    }
    let fit = (limit as usize)
        .saturating_sub(reserve + FD_HEADROOM)
        .max(1);
    tracing::warn!(
        max_connections,
        open_file_limit = limit,
        using = fit,
        "the open-file limit cannot hold --max-connections; raise it (ulimit -n, LimitNOFILE=)"
    );
    fit
}
