//! Typed access to the mailbox Redis ([`MailboxStore`]): one wrapper per script, EVALSHA with
//! NOSCRIPT recovery, and the only call site of [`decode_lane_watermarks`] [ADR-0015].
//!
//! Scripts are loaded with `SCRIPT LOAD` when a [`MailboxStore`] connects. A Redis restart
//! empties the script cache; a call that meets `NOSCRIPT` reloads the whole set and repeats,
//! as `EVAL` with the script's source (ADR-0059: on a cluster whose slot map is stale the
//! reload may reach the old primary, and `EVAL` runs wherever the key is served).
//! For a pipeline the *whole* pipeline is repeated in its original order: every watermark
//! script is a CAS on `W` and every entry write is idempotent, so the commands that had already
//! applied come back as replays and nothing is ever applied out of order.
//!
//! Script replies are turned into values ([`Materialized`], [`Advance`], …); only failures
//! that must stop the caller (Redis down, missing watermark) are [`Error`]s. A corrupt verdict
//! from Lua is a value too ([`Verdict`]), so callers handle it explicitly (fail closed).
//!
//! Every reply's status number is decoded once into a [`ScriptStatus`] (the reply convention
//! of `lua/common/_lanes.lua`) and a corrupt verdict's cause string into a [`CorruptCode`];
//! a number or a code outside those tables is an [`Error::UnexpectedReply`].
//!
//! ```text
//! redis/store.rs          MailboxStore: connect, accessors; decode_watermark (the ADR's
//!                         one call site of decode_lane_watermarks)
//! redis/store/
//!   conn.rs               SCRIPT LOAD, EVALSHA, NOSCRIPT reload, pipelines
//!   reply.rs              every script reply decoded: ScriptStatus, Verdict, the outcome
//!                         types (Materialized, Advance, ChunkWritten, Gc, Fence), parse_*
//!   watermark_ops.rs      read, init, fence, claim / check_claimable, downgrade, rebase
//!   materialize.rs        hot path (single, batches), lane chunks, advance, GC
//!   mailbox.rs            mailbox pages, ack, acked, ZRANGEBYSCORE replies
//!   owner.rs              owner marks `owner:{s}`: refresh, clear, live owner
//!   tests.rs              unit tests: Lua tables against the Rust enums, synthetic replies
//! ```
//!
//! [`CorruptCode`]: super::watermark::CorruptCode

mod conn;
mod mailbox;
mod materialize;
mod owner;
mod reply;
mod watermark_ops;

#[cfg(test)]
mod tests;

use super::scripts::{self, ScriptSet};
use super::watermark::{decode_lane_watermarks, Layout, ShardWatermark, U48_MAX};
use crate::endpoint::{self, Conn};
use crate::error::{Error, Result};

pub use mailbox::{parse_withscores, ACKS_PER_CALL};
pub use materialize::{
    AdvanceRecord, LaneChunk, SingleItem, MAX_HOT_RECIPIENTS, MAX_RUN, MAX_RUN_ENTRIES,
};
pub use owner::OWNER_MARK_TTL_MS;
pub use reply::{
    Advance, AdvanceCounts, ChunkWritten, Fence, Gc, Materialized, ScriptStatus, Verdict,
};

/// Connection to one mailbox Redis with the script set of one layout.
#[derive(Clone)]
pub struct MailboxStore {
    conn: Conn,
    set: &'static ScriptSet,
    /// Replicas [`MailboxStore::confirm_replicated`] waits for (`None`: none asked).
    wait: Option<crate::redis::dlog::ReplicaWait>,
}

impl MailboxStore {
    /// Connects to `url` (an instance or a cluster endpoint, [`crate::endpoint`]), loads the
    /// script set of `layout`.
    pub async fn connect(url: &str, layout: Layout) -> Result<MailboxStore> {
        let conn = endpoint::connect(url, endpoint::ConnectOptions::default()).await?;
        let mut s = MailboxStore {
            conn,
            set: scripts::for_layout(layout),
            wait: None,
        };
        s.load_scripts().await?;
        Ok(s)
    }

    /// The layout this store writes.
    pub fn layout(&self) -> Layout {
        self.set.layout
    }

    /// The script set in use.
    pub fn scripts(&self) -> &'static ScriptSet {
        self.set
    }

    /// A clone of the underlying connection, for plain commands.
    pub fn connection(&self) -> Conn {
        self.conn.clone()
    }

    /// Resolves `policy` on this instance (or cluster) and keeps the result for
    /// [`MailboxStore::confirm_replicated`].
    pub async fn set_replica_wait(
        &mut self,
        policy: &crate::redis::dlog::WaitPolicy,
    ) -> Result<Option<crate::redis::dlog::ReplicaWait>> {
        self.wait = policy.resolve(&mut self.conn).await?;
        Ok(self.wait)
    }

    /// The W below which shard `shard`'s core log may be trimmed, given `w` (the lowest
    /// present W the caller read): `w` when no replica wait is asked; otherwise the lower of
    /// `w` and the W on the shard's primary, once that is confirmed on the replicas asked
    /// for, or `None` (not confirmed now: the next GC tries again). Call before trimming the
    /// core log: a promoted replica then holds at least that W.
    ///
    /// One pipeline on the primary: a read of `wm:{s}`, a write of `wmsync:{s}`, `WAIT`. The
    /// `WAIT` covers the write, and so (replication is in order) everything the primary held
    /// when it read W, whichever connection the pipeline ran on. (Before, `EXISTS` then
    /// `WAIT` relied on the connection having written W: a reconnect since, or redis-rs'
    /// cluster client running the pipeline again on a new connection, made the `WAIT`
    /// answer at once and confirm nothing, ADR-0063.)
    pub async fn confirm_replicated(&mut self, shard: u32, w: u64) -> Result<Option<u64>> {
        let Some(mut wait) = self.wait else {
            return Ok(Some(w));
        };
        // a short wait: this runs in the materializer's loop, and a trim not confirmed now is
        // simply tried again at the next GC (W is normally on the replicas long before)
        wait.timeout = wait.timeout.min(std::time::Duration::from_millis(50));
        let mut read = redis::cmd("HGETALL");
        read.arg(crate::keys::wm(shard));
        let mut write = redis::cmd("SET");
        write.arg(crate::keys::wm_sync(shard)).arg(w);
        let v = match crate::redis::replicas::with_wait(&mut self.conn, &[read, write], wait).await
        {
            Ok(mut v) => v.swap_remove(0),
            Err(crate::redis::replicas::WaitError::Short) => return Ok(None),
            Err(crate::redis::replicas::WaitError::Redis(e)) => return Err(e.into()),
        };
        let flat = match v {
            redis::Value::Map(m) => {
                redis::Value::Array(m.into_iter().flat_map(|(k, v)| [k, v]).collect())
            }
            other => other,
        };
        let on_primary = reply::decode_read_reply(&[shard], &redis::Value::Array(vec![flat]))?
            .pop()
            .expect("one shard asked, one answer")?;
        Ok(Some(w.min(on_primary.lanes.min_present_w().unwrap_or(0))))
    }
}

/// One shard's `wm:{s}` fields, as `read_log_watermarks.lua` returned them, decoded and
/// validated: the only call site of [`decode_lane_watermarks`] (ADR-0015 names it here).
fn decode_watermark(shard: u32, fields: &[(&[u8], &[u8])]) -> Result<ShardWatermark> {
    decode_lane_watermarks(fields).map_err(|cause| Error::Corrupt { shard, cause })
}

/// Refuses an offset (or seq) that does not fit the watermark's u48.
fn check_u48(what: &str, v: u64) -> Result<()> {
    if v > U48_MAX {
        return Err(Error::InvalidArgument(format!("{what} {v} exceeds u48")));
    }
    Ok(())
}
