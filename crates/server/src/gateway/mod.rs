//! The gateway (placeholder: being written). Interface fixed for `run.rs`.

use std::sync::Arc;
use std::time::Duration;

use tidemark_protocol::Limits;
use tokio_util::sync::CancellationToken;

use crate::config::Topology;
use crate::materializer::HealthBoard;

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
}

/// Serves WebSocket and HTTP on `listener` until `cancel`, then joins every task.
pub async fn serve(
    listener: tokio::net::TcpListener,
    topology: Topology,
    opts: GatewayOptions,
    health: Arc<HealthBoard>,
    cancel: CancellationToken,
) -> Result<(), GatewayError> {
    let _ = (listener, topology, opts, health);
    cancel.cancelled().await;
    Ok(())
}
