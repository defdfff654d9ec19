//! The gateway: clients' WebSocket and HTTP front door (client protocol v1, `docs/protocol.md`).
//!
//! ```text
//!   GET  /v1/ws             WebSocket: send / ack / sync in, ready / send_ack / deliver / error out
//!   POST /v1/messages       send one message
//!   GET  /v1/mailbox        read a page of the caller's mailbox (never above the lane's W)
//!   POST /v1/mailbox/ack    ack up to a seq
//!   GET  /metrics           Prometheus text
//!   GET  /healthz           200 "ok", or 503 with one problem per line
//! ```
//!
//! - **Send** ([`send`]): recipients are grouped by shard and committed to every shard's core
//!   instance concurrently; `send_ack` once all have committed. At most
//!   `max_inflight_commits` commits are in flight gateway-wide; a send that finds no room
//!   within 100 ms is refused with `overloaded` (retryable, nothing lost). A WebSocket
//!   connection commits its sends one after another, so a client's sends to one mailbox keep
//!   their order.
//! - **Delivery** ([`ws`]): each connection has a delivery loop that reads the mailbox after
//!   its cursor, keeps only entries at or below the lane's W, and pushes `deliver` frames in
//!   seq order. It is woken by the [`wake`] hub (Pub/Sub hints naming the user), by a periodic
//!   re-check (missed hints) and by `sync`. Pub/Sub is a hint only, never the data path.
//! - **Writer**: one task per socket owns the sink and drains a bounded channel; the reader,
//!   the sender and the delivery loop feed it (the delivery loop waits for room: backpressure).
//! - **Shutdown**: on `cancel` the listener stops, every socket is closed (1001 going away),
//!   and every task this module spawned is joined before [`serve`] returns.

use std::sync::Arc;
use std::time::Duration;

use tidemark_protocol::Limits;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Topology;
use crate::materializer::HealthBoard;

mod auth;
mod http;
mod mailbox;
mod send;
mod state;
mod wake;
mod ws;

/// Gateway settings.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// Frame/body/recipient limits.
    pub limits: Limits,
    /// HMAC secret for bearer tokens (None: tokens are refused).
    pub token_secret: Option<Vec<u8>>,
    /// Accept `?user=NAME` without a token (development only).
    pub dev_auth: bool,
    /// Most commits in flight before `send` is refused with `overloaded`.
    pub max_inflight_commits: usize,
    /// Periodic re-check of every connected mailbox (missed wake-up hints).
    pub recheck_interval: Duration,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        GatewayOptions {
            limits: Limits::default(),
            token_secret: None,
            dev_auth: false,
            max_inflight_commits: 4096,
            recheck_interval: Duration::from_secs(1),
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
    /// The topology is unusable (validation failed).
    #[error("gateway: {0}")]
    Config(String),
}

impl GatewayError {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::Store(e) => e.code(),
            GatewayError::Io(_) => "io",
            GatewayError::Config(_) => "config",
        }
    }
}

/// Serves WebSocket and HTTP on `listener` until `cancel`, then joins every task.
///
/// Connects to every core and mailbox instance of `topology` first (an unreachable instance
/// is an error here, before anything is served).
pub async fn serve(
    listener: tokio::net::TcpListener,
    topology: Topology,
    opts: GatewayOptions,
    health: Arc<HealthBoard>,
    cancel: CancellationToken,
) -> Result<(), GatewayError> {
    topology
        .validate()
        .map_err(|e| GatewayError::Config(e.to_string()))?;
    // Our own token: stopping the gateway (also on a listener failure) must not cancel the
    // caller's other services.
    let stop = cancel.child_token();
    let tracker = TaskTracker::new();
    let shared =
        state::Shared::connect(topology, opts, health, stop.clone(), tracker.clone()).await?;

    for url in shared.topology.mailbox.clone() {
        // supervised: a panic restarts the subscriber (connections re-check meanwhile)
        let (hub, stop2) = (shared.hub.clone(), stop.clone());
        tracker.spawn(crate::supervise::supervise(
            "wake_subscriber",
            stop.clone(),
            move || {
                let (hub, url, stop) = (hub.clone(), url.clone(), stop2.clone());
                async move {
                    wake::run_subscriber(hub, url, stop).await;
                    Ok::<(), std::convert::Infallible>(())
                }
            },
            |_| {},
        ));
    }

    let addr = listener.local_addr().ok();
    tracing::info!(?addr, "gateway listening");
    let app = http::router(shared.clone());
    // Small frames must not wait for Nagle's algorithm (it added ~40 ms to acks and deliveries).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(stop.clone().cancelled_owned())
        .await;
    // Stops sockets and hubs (also when the listener failed on its own).
    stop.cancel();
    tracker.close();
    tracker.wait().await;
    tracing::info!(?addr, "gateway stopped");
    served.map_err(GatewayError::from)
}
