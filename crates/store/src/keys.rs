//! Redis key names. Every key of a shard carries the hash tag `{s}`, so each script touches
//! one slot and the same layout runs on standalone Redis and on Redis Cluster.
//!
//! ```text
//! mailbox Redis (materialize side)          core Redis (commit side)
//!   wm:{s}           hash  watermark [ADR]    dlog:{s}           stream  dispatch log, ids "<offset>-0"
//!   mb:{s}:<user>    zset  mailbox entries    head:{s}           string  last assigned offset
//!   ack:{s}          hash  user -> acked seq  dd:{s}:<n>:<sender><client id>  string  "<offset>:<digest>" (dedupe, TTL)
//!                                             msgid:{h}:<n>:<sender><client id>  string  digest, or "<offset>:<digest>"
//!                                                                 (h: sender's shard, TTL; ADR-0040)
//!   stg:{s}:<o>      hash  lanes durable of o             dlogwake:{s}  sharded channel: commit hint (cluster only)
//!                                             dlogsync:{s}  string  last offset a log read had confirmed
//!                                                                 (with a core replica wait only; ADR-0064)
//!   stgidx:{s}       zset  offsets with staging
//!   owner:{s}        string epoch of the live owner (PX, refreshed every second)
//!   wmsync:{s}       string W last confirmed for a log trim (with a replica wait only)
//!   wake:{s}         pub/sub channel (hint)
//!
//! core Redis, coordination (ADR-0030)
//!   lease:{s}              string  node id owning shard s (PX; on the shard's core instance)
//!   {tidemark}:nodes       zset    node id -> Redis ms its record expires (instance 0)
//!   {tidemark}:node:<id>   hash    url, role, beat (PX; instance 0)
//! ```
//!
//! In the dedupe key, `<n>` is the sender's length in bytes, in decimal: the prefix makes the
//! key unambiguous, no two (sender, client id) pairs share one. The earlier form
//! `dd:{s}:<sender>\0<client id>` was ambiguous (`a\0b`+`c` and `a`+`b\0c` met); it is still
//! read, never written, for the 24 h its records live (ADR-0022).
//!
//! In a deployment of identity version 2 (ADR-0040), a one-shard send whose commit claims its
//! id writes no `dd:` record: its claim `msgid:` holds `"<offset>:<digest>"` and is the
//! dedupe record. A send to several shards still claims the bare digest first and writes a
//! `dd:` record per shard.

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

/// `wmsync:{s}`: the W the GC last asked the replicas to confirm before trimming the core
/// log. Written for its replication: the `WAIT` after it covers everything the primary held
/// when W was read (ADR-0063); only with a mailbox replica wait.
pub fn wm_sync(shard: u32) -> String {
    format!("wmsync:{{{shard}}}")
}

/// `dlogsync:{s}`: the offset of the last record a log reader asked the core replicas to
/// confirm before handing it on. Written for its replication: the `WAIT` after it covers every
/// record the primary held when the log was read (ADR-0064); only with a core replica wait.
pub fn dlog_sync(shard: u32) -> String {
    format!("dlogsync:{{{shard}}}")
}

/// `owner:{s}`: the epoch of the process materialising the shard, set with a short expiry and
/// refreshed while it runs (deleted on a clean stop): how offline tools tell a live owner.
pub fn owner(shard: u32) -> String {
    format!("owner:{{{shard}}}")
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

/// `dlogwake:{s}`: sharded Pub/Sub channel of commit hints on a Redis Cluster (ADR-0032).
pub fn dlog_wake(shard: u32) -> String {
    format!("dlogwake:{{{shard}}}")
}

/// `head:{s}`: last offset assigned in `dlog:{s}`.
pub fn head(shard: u32) -> String {
    format!("head:{{{shard}}}")
}

/// `msgid:{h}:<n>:<sender><client id>`: which message (request digest) a sender's client id
/// names, kept on the sender's own shard `h` so that every send with that id meets it,
/// whatever shards its recipients fall in. A one-shard send's claim made inside its commit
/// holds `"<offset>:<digest>"` in a deployment of identity version 2 (ADR-0040).
pub fn message_id(shard: u32, sender: &str, client_id: &str) -> String {
    format!("msgid:{{{shard}}}:{}:{sender}{client_id}", sender.len())
}

/// `dd:{s}:<n>:<sender><client id>`, n the sender's length in bytes (decimal): the dedupe
/// record of (sender, client id). Unambiguous for any two strings.
pub fn dedupe(shard: u32, sender: &str, client_id: &str) -> String {
    format!("dd:{{{shard}}}:{}:{sender}{client_id}", sender.len())
}

/// `dd:{s}:<sender>\0<client id>`: the earlier, ambiguous form of [`dedupe`]. Read by
/// `commit_dispatch.lua` (never written) so that records written before the change still
/// dedupe for the rest of their 24 h.
pub fn dedupe_legacy(shard: u32, sender: &str, client_id: &str) -> String {
    format!("dd:{{{shard}}}:{sender}\0{client_id}")
}

/// `wake:{s}`: Pub/Sub channel of materialisation hints.
pub fn wake(shard: u32) -> String {
    format!("wake:{{{shard}}}")
}

/// `lease:{s}`: the node that owns shard `s` (a PX lease on the shard's core instance).
pub fn lease(shard: u32) -> String {
    format!("lease:{{{shard}}}")
}

/// `{tidemark}:nodes`: the live nodes, scored by when their record expires (core instance 0).
pub const NODES: &str = "{tidemark}:nodes";

/// Prefix of a node's record: `{tidemark}:node:<id>`.
pub const NODE_PREFIX: &str = "{tidemark}:node:";
