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

    /// Whether everything written so far to shard `shard`'s primary has reached the replicas
    /// asked for (`WAIT` after a read of `wm:{s}`, on that primary's connection). Always true
    /// when no wait is asked. Call before trimming the core log below W: a promoted replica
    /// then holds at least that W.
    pub async fn confirm_replicated(&mut self, shard: u32) -> Result<bool> {
        let Some(mut wait) = self.wait else {
            return Ok(true);
        };
        // a short wait: this runs in the materializer's loop, and a trim not confirmed now is
        // simply tried again at the next GC (W is normally on the replicas long before)
        wait.timeout = wait.timeout.min(std::time::Duration::from_millis(50));
        let mut cmd = redis::cmd("EXISTS");
        cmd.arg(crate::keys::wm(shard));
        match crate::redis::replicas::with_wait(&mut self.conn, &cmd, wait).await {
            Ok(_) => Ok(true),
            Err(crate::redis::replicas::WaitError::Short) => Ok(false),
            Err(crate::redis::replicas::WaitError::Redis(e)) => Err(e.into()),
        }
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
