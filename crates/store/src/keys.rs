//! Redis key names. Every key of a shard carries the hash tag `{s}`, so each script touches
//! one slot and the same layout runs on standalone Redis and on Redis Cluster.
//!
//! ```text
//! mailbox Redis (materialize side)          core Redis (commit side)
//!   wm:{s}           hash  watermark [ADR]    dlog:{s}           stream  dispatch log, ids "<offset>-0"
//!   mb:{s}:<user>    zset  mailbox entries    head:{s}           string  last assigned offset
//!   ack:{s}          hash  user -> acked seq  dd:{s}:<sender>\0<client id>  string  offset (dedupe, TTL)
//!   stg:{s}:<o>      hash  lanes durable of o
//!   stgidx:{s}       zset  offsets with staging
//!   wake:{s}         pub/sub channel (hint)
//! ```

/// `wm:{s}`.
pub fn wm(shard: u32) -> String {
    format!("wm:{{{shard}}}")
}

/// `mb:{s}:<user>`: the user's mailbox, a sorted set scored by MailboxSeq.
pub fn mailbox(shard: u32, user: &str) -> String {
    format!("mb:{{{shard}}}:{user}")
}

/// `ack:{s}`: per-user acked seq of the shard's mailboxes.
pub fn acks(shard: u32) -> String {
    format!("ack:{{{shard}}}")
}

/// `stg:{s}:<o>`: staging state (durable lanes) of record `o`.
pub fn staging(shard: u32, offset: u64) -> String {
    format!("stg:{{{shard}}}:{offset}")
}

/// Prefix of staging keys, for `gc_completed_dispatch`.
pub fn staging_prefix(shard: u32) -> String {
    format!("stg:{{{shard}}}:")
}

/// `stgidx:{s}`: index of offsets that have staging state.
pub fn staging_index(shard: u32) -> String {
    format!("stgidx:{{{shard}}}")
}

/// `dlog:{s}`: the shard's dispatch log (a stream).
pub fn dlog(shard: u32) -> String {
    format!("dlog:{{{shard}}}")
}

/// `head:{s}`: last offset assigned in `dlog:{s}`.
pub fn head(shard: u32) -> String {
    format!("head:{{{shard}}}")
}

/// `dd:{s}:` prefix of dedupe keys (`<sender>\0<client id>` follows).
pub fn dedupe_prefix(shard: u32) -> String {
    format!("dd:{{{shard}}}:")
}

/// `wake:{s}`: Pub/Sub channel of materialisation hints.
pub fn wake(shard: u32) -> String {
    format!("wake:{{{shard}}}")
}
