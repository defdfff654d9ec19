//! The store's one error type. Normal outcomes of the scripts (replay, gap, fenced, held,
//! corrupt verdicts of Lua) are values in `redis::store`, not errors; these are the failures.

use crate::redis::watermark::{CorruptCause, CorruptCode};

/// Errors of `tidemark-store`; [`Error::code`] is stable. Cloned when one failure answers
/// several callers (the messages of a group commit).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The Redis connection or a command failed.
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    /// `wm:{s}` does not exist on the instance asked (see `ops::explain_missing` for why).
    #[error("shard {shard}: no watermark (wm:{{{shard}}} does not exist on this instance)")]
    NoWatermark { shard: u32 },
    /// The watermark failed Rust validation (`decode_lane_watermarks`).
    #[error("shard {shard}: corrupt: {cause}")]
    Corrupt { shard: u32, cause: CorruptCause },
    /// A Lua script refused the watermark as corrupt.
    #[error("shard {shard}: corrupt: {code}{} ({})", lane.map(|l| format!(" in lane {l}")).unwrap_or_default(), code.describe())]
    CorruptLua {
        shard: u32,
        code: CorruptCode,
        lane: Option<usize>,
    },
    /// `wm init` found a watermark and was not told to overwrite it.
    #[error("shard {shard}: a watermark already exists (use --force to overwrite)")]
    AlreadyExists { shard: u32 },
    /// A script replied with something its wrapper does not understand.
    #[error("unexpected reply from {script}: {detail}")]
    UnexpectedReply {
        script: &'static str,
        detail: String,
    },
    /// A dispatch-log record could not be decoded.
    #[error("dlog:{{{shard}}} record {offset}: {detail}")]
    BadRecord {
        shard: u32,
        offset: u64,
        detail: String,
    },
    /// The caller passed an argument outside its domain (e.g. an offset above u48).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// `dlog:{s}` has assigned its last offset (2^48-1): the commit was refused, nothing
    /// written. The shard takes no new message (operator action needed).
    #[error("dlog:{{{shard}}} is exhausted: its head is at 2^48-1, no offset is left")]
    LogExhausted { shard: u32 },
    /// `dlog:{s}` holds a record at or above its head + 1 (a damaged core instance): the
    /// commit's `XADD` failed and nothing was written for this message (ADR-0051: only the
    /// shard's part of a commit call stops). A resend with the same id is deduplicated.
    #[error("dlog:{{{shard}}} is ahead of its head; commit refused: {detail}")]
    LogAheadOfHead { shard: u32, detail: String },
    /// The commit script failed inside this shard's part of a call (a head that is not a
    /// number, a key of another type) at this message or before it, or the instance refused
    /// the message's `XADD` (out of memory, READONLY, NOREPLICAS, MISCONF): a resend is
    /// deduplicated. The part's messages before the one it failed at keep their answers
    /// (ADR-0099). Since ADR-0051 a call may hold several shards; the others are not
    /// affected.
    #[error("shard {shard}: the commit failed: {detail}")]
    CommitFailed { shard: u32, detail: String },
    /// The ack script failed for this ack (a key of another type, an acked seq that is not a
    /// number): since ADR-0053 one call holds many acks, and the others are not affected.
    /// What this ack wrote before the error stays written; sending it again is safe (an
    /// ack is a max).
    #[error("shard {shard}: the ack of {user} failed: {detail}")]
    AckFailed {
        shard: u32,
        user: String,
        detail: String,
    },
    /// The client id was already committed (within the dedupe lifetime) with another request:
    /// other recipients or another body. Nothing was written.
    #[error("shard {shard}: this id was already used for another message (committed at offset {offset})")]
    IdReused { shard: u32, offset: u64 },
    /// A write was applied on the primary but `WAIT` saw fewer replicas take it than asked
    /// within the timeout: not acknowledged (a resend with the same id is deduplicated).
    #[error("shard {shard}: written on the primary but confirmed by {replicas} of {wanted} replicas in time")]
    NotReplicated {
        shard: u32,
        replicas: u32,
        wanted: u32,
    },
    /// Another process registered node id `id` and is live (ADR-0114): two processes with
    /// one id would hold the same leases. This one registers nothing and must hold no lease
    /// until that record expires.
    #[error("node id {id} is in use by another live process")]
    NodeIdInUse { id: String },
}

impl Error {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Redis(_) => "redis",
            Error::NoWatermark { .. } => "no_watermark",
            Error::Corrupt { .. } | Error::CorruptLua { .. } => "corrupt",
            Error::AlreadyExists { .. } => "already_exists",
            Error::UnexpectedReply { .. } => "unexpected_reply",
            Error::BadRecord { .. } => "bad_record",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::LogExhausted { .. } => "log_exhausted",
            Error::LogAheadOfHead { .. } => "log_ahead_of_head",
            Error::CommitFailed { .. } => "commit_failed",
            Error::AckFailed { .. } => "ack_failed",
            Error::IdReused { .. } => "id_reused",
            Error::NotReplicated { .. } => "not_replicated",
            Error::NodeIdInUse { .. } => "node_id_in_use",
        }
    }

    /// True for a corrupt watermark, by either reader.
    pub fn is_corrupt(&self) -> bool {
        matches!(self, Error::Corrupt { .. } | Error::CorruptLua { .. })
    }

    /// The `(code, lane)` verdict of a corrupt watermark, by either reader.
    pub fn corrupt_verdict(&self) -> Option<(String, Option<usize>)> {
        match self {
            Error::Corrupt { cause, .. } => Some((cause.code().to_string(), cause.lane())),
            Error::CorruptLua { code, lane, .. } => Some((code.to_string(), *lane)),
            _ => None,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
