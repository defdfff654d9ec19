//! The crate's one error type.

use tokio_tungstenite::tungstenite;

/// Every error this crate returns.
///
/// Each variant has a stable [`code`](Error::code) for logs, metrics and exit messages. For
/// [`Error::Server`] and [`Error::Rejected`] the code is the server's own protocol error code
/// (`unauthorized`, `overloaded`, …; see `docs/protocol.md`), so a caller can decide whether
/// to retry with [`Error::retryable`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The WebSocket URL could not be parsed or turned into an upgrade request, or is a
    /// `wss://` URL (this crate is built without TLS). Code `invalid_url`.
    #[error("invalid WebSocket URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// The TCP connection or the WebSocket handshake failed (no HTTP answer to judge). Code
    /// `connect_failed`.
    #[error("cannot connect to {url}: {source}")]
    Connect {
        /// The URL connected to (without credentials in the query).
        url: String,
        /// The underlying error.
        #[source]
        source: tungstenite::Error,
    },
    /// The server (or a proxy in front of it) answered the upgrade request with an HTTP error
    /// (e.g. 401, or 502 from a proxy). Code: the server's error code from the body when there
    /// is one, else `upgrade_rejected`; see [`Error::retryable`].
    #[error("WebSocket upgrade refused with HTTP {status}: {code}: {message}")]
    Rejected {
        /// The HTTP status.
        status: u16,
        /// The protocol error code from the body (`{"error":{"code":…}}`), or
        /// `upgrade_rejected` when the body has none.
        code: String,
        /// The server's message, or the raw body.
        message: String,
    },
    /// The server answered with an `error` frame (for [`send_and_wait`](crate::ClientHandle::send_and_wait):
    /// one carrying the send's id; while connecting: instead of `ready`). Code: the server's
    /// code, e.g. `bad_recipient`.
    #[error("server error {code}: {message}")]
    Server {
        /// The stable protocol error code.
        code: String,
        /// The server's human-readable message.
        message: String,
    },
    /// Waiting for `ready` or for a `send_ack` took longer than allowed. Code `timeout`.
    /// For a send, the message may or may not be committed: retry with the same id.
    #[error("timed out after {0:?} waiting for {1}")]
    Timeout(std::time::Duration, &'static str),
    /// The connection is closed (by either side, or it failed) before the operation could
    /// complete. Code `closed`. For a send, retry with the same id on a new connection.
    #[error("connection closed")]
    Closed,
    /// The server broke the protocol (e.g. its first frame was not `ready`). Code `protocol`.
    #[error("protocol violation by the server: {0}")]
    Protocol(String),
    /// [`send_and_wait`](crate::ClientHandle::send_and_wait) was called with an id that already has
    /// a waiter on this connection. Code `id_in_flight`.
    #[error("a send with id {0:?} is already waiting for its ack on this connection")]
    IdInFlight(String),
    /// The token secret could not be loaded or is too short. Code: the loader's
    /// (`secret_unreadable`, `secret_missing`, `secret_too_short`, `secret_create`).
    #[error(transparent)]
    Secret(#[from] tidemark_protocol::SecretError),
    /// A token lifetime that is zero, not a duration, or overflows. Code `bad_ttl`.
    #[error("bad token lifetime: {0}")]
    BadTtl(String),
}

impl Error {
    /// The stable code string, e.g. `"timeout"`, or the server's protocol code for
    /// [`Error::Server`] and [`Error::Rejected`].
    pub fn code(&self) -> &str {
        match self {
            Error::InvalidUrl { .. } => "invalid_url",
            Error::Connect { .. } => "connect_failed",
            Error::Rejected { code, .. } => code,
            Error::Server { code, .. } => code,
            Error::Timeout(..) => "timeout",
            Error::Closed => "closed",
            Error::Protocol(_) => "protocol",
            Error::IdInFlight(_) => "id_in_flight",
            Error::Secret(e) => e.code(),
            Error::BadTtl(_) => "bad_ttl",
        }
    }

    /// Whether the same request may be tried again unchanged (a send with the **same id**),
    /// after a backoff: a server code the protocol marks retryable (`overloaded`,
    /// `rate_limited`, `internal`), a timeout, a closed connection or a failed connect. An
    /// upgrade refused with a code this client does not know (`upgrade_rejected`: a body
    /// without one, e.g. a proxy's page) is judged by its HTTP status: 5xx (502, 503, 504 from
    /// a proxy while the gateway restarts), 429 and 408 are retryable, others are not.
    pub fn retryable(&self) -> bool {
        match self {
            Error::Server { code, .. } => code
                .parse::<tidemark_protocol::ErrorCode>()
                .is_ok_and(|c| c.retryable()),
            Error::Rejected { status, code, .. } => {
                match code.parse::<tidemark_protocol::ErrorCode>() {
                    Ok(c) => c.retryable(),
                    Err(_) => matches!(status, 500..=599 | 429 | 408),
                }
            }
            Error::Timeout(..) | Error::Closed | Error::Connect { .. } => true,
            _ => false,
        }
    }
}
