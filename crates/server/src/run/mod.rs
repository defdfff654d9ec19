//! Running Tidemark: [`serve()`] runs the gateway and the materializers against Redis
//! instances it did not start; [`up()`] starts its own redis-server processes (AOF on, data under
//! a directory), then serves. Both stop cleanly on cancellation and join every task.
//!
//! Every long-running task is supervised ([`crate::supervise`]): a materializer worker that
//! panics (or returns) is logged with its shards, counted, reported in `/healthz` (its shards
//! have no running owner) and started again, which re-claims its shards (safe: replays are
//! no-ops). The gateway cannot be restarted in place: if it panics or stops on its own, the
//! whole service stops with an error, so the process exits non-zero and its own supervisor
//! (systemd, Kubernetes) restarts it — never a process that is up with a dead gateway.

mod data_dir;
// what `serve` and `up` refuse before anything starts (unsafe --dev-auth, no token secret)
mod guard;
mod serve;
mod up;

pub use data_dir::{
    load_or_create_redis_password, load_or_create_secret, lock_data_dir, prepare_data_dir,
    DataDirLock, Tightened, REDIS_PASSWORD_FILE, TOKEN_SECRET_FILE, UP_LOCK_FILE,
};
pub use guard::{check_dev_auth, serve_secret};
pub use serve::{check_identity, init_missing, redact_url, serve, Running, ServeOptions};
pub(crate) use serve::{check_ownable, supervise_worker, WorkerSpec};
pub use up::{up, up_locked, Up, UpOptions, UP_TOPOLOGY_FILE};

use std::net::SocketAddr;

use tidemark_protocol::secret::SecretError;
use tidemark_store::topology::TopologyError;

use crate::gateway::GatewayError;
use crate::materializer;

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
    /// Another process (another `tidemark up`) holds the data dir's lock (ADR-0109): nothing
    /// was started or written.
    #[error(
        "{} is in use by another `tidemark up` (it holds {}); stop that one first, or use \
         another --data-dir",
        dir.display(),
        dir.join(data_dir::UP_LOCK_FILE).display()
    )]
    DataDirLocked { dir: std::path::PathBuf },
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
            Error::DataDirLocked { .. } => "data_dir_locked",
            Error::TaskEnded { .. } => "task_ended",
        }
    }
}
