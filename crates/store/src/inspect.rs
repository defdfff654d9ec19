//! Read-only reads for the operator tools (`tidemark trace`, in the `tidemark-ops` crate):
//! what a shard's log, mailboxes, acks and staging state hold at one offset, typed, so that
//! raw Redis commands stay in this crate. Nothing here writes, and nothing on the data path
//! calls it.
//!
//! ```text
//! core Redis      dlog:{s}        XRANGE - + COUNT 1        first_log_offset
//! mailbox Redis   mb:{s}:*        SCAN + ZCOUNT o o         mailboxes_holding
//!                 mb:{s}:<user>   ZRANGEBYSCORE o o    ┐
//!                 ack:{s}         HGET <user>          ┘    entries_at
//!                 stg:{s}:<o>     HKEYS                     staging_lanes
//! ```

use crate::error::Result;
use crate::keys;
use crate::redis::dlog::LogStore;
use crate::redis::store::MailboxStore;
use crate::scan::KeyScan;

/// The lowest offset `dlog:{shard}` still holds (`None`: the log is empty). Only the record's
/// id is read, so a record that does not decode still counts.
pub async fn first_log_offset(log: &LogStore, shard: u32) -> Result<Option<u64>> {
    let v: redis::Value = redis::cmd("XRANGE")
        .arg(keys::dlog(shard))
        .arg("-")
        .arg("+")
        .arg("COUNT")
        .arg(1)
        .query_async(&mut log.connection())
        .await?;
    let redis::Value::Array(entries) = v else {
        return Ok(None);
    };
    Ok(entries.first().and_then(|e| match e {
        redis::Value::Array(pair) => match pair.first() {
            Some(redis::Value::BulkString(id)) => std::str::from_utf8(id)
                .ok()?
                .strip_suffix("-0")?
                .parse()
                .ok(),
            _ => None,
        },
        _ => None,
    }))
}

/// Users of the shard whose mailbox holds an entry with seq `seq` (SCAN `mb:{s}:*`, then
/// ZCOUNT on each), sorted, without duplicates.
pub async fn mailboxes_holding(store: &MailboxStore, shard: u32, seq: u64) -> Result<Vec<String>> {
    let mut conn = store.connection();
    let prefix = keys::mailbox(shard, "");
    let mut scan = KeyScan::new(format!("{prefix}*"));
    let mut users = Vec::new();
    while let Some(batch) = scan.next_batch::<Vec<u8>>(&mut conn).await? {
        if batch.is_empty() {
            continue;
        }
        let mut pipe = redis::pipe();
        for k in &batch {
            pipe.cmd("ZCOUNT").arg(k).arg(seq).arg(seq);
        }
        let counts: Vec<u64> = pipe.query_async(&mut conn).await?;
        for (k, n) in batch.iter().zip(counts) {
            if n > 0 {
                if let Some(u) = k
                    .strip_prefix(prefix.as_bytes())
                    .and_then(|u| std::str::from_utf8(u).ok())
                {
                    users.push(u.to_string());
                }
            }
        }
    }
    users.sort();
    users.dedup();
    Ok(users)
}

/// One user's mailbox at one seq, as [`entries_at`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MailboxAt {
    /// The members of `mb:{s}:<user>` whose score is the seq (stored entries; normally at most
    /// one).
    pub members: Vec<Vec<u8>>,
    /// The user's `ack:{s}` (0 when never acked).
    pub acked: u64,
}

/// For every user of `users`, in order: the mailbox entries with score `seq` and the user's
/// acked seq, in one pipeline.
pub async fn entries_at(
    store: &MailboxStore,
    shard: u32,
    seq: u64,
    users: &[String],
) -> Result<Vec<MailboxAt>> {
    if users.is_empty() {
        return Ok(Vec::new());
    }
    let mut pipe = redis::pipe();
    for u in users {
        pipe.cmd("ZRANGEBYSCORE")
            .arg(keys::mailbox(shard, u))
            .arg(seq)
            .arg(seq);
        pipe.cmd("HGET").arg(keys::acks(shard)).arg(u);
    }
    let replies: Vec<redis::Value> = pipe.query_async(&mut store.connection()).await?;
    let mut out = Vec::with_capacity(users.len());
    for pair in replies.chunks(2) {
        let members: Vec<Vec<u8>> =
            redis::from_redis_value_ref(&pair[0]).map_err(redis::RedisError::from)?;
        let acked: Option<u64> =
            redis::from_redis_value_ref(&pair[1]).map_err(redis::RedisError::from)?;
        out.push(MailboxAt {
            members,
            acked: acked.unwrap_or(0),
        });
    }
    Ok(out)
}

/// The lanes marked durable in `stg:{shard}:<offset>`, sorted; `None` when there is no staging
/// state (hot path, or already collected by GC).
pub async fn staging_lanes(
    store: &MailboxStore,
    shard: u32,
    offset: u64,
) -> Result<Option<Vec<usize>>> {
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg(keys::staging(shard, offset))
        .query_async(&mut store.connection())
        .await?;
    if fields.is_empty() {
        return Ok(None);
    }
    let mut lanes: Vec<usize> = fields.iter().filter_map(|f| f.parse().ok()).collect();
    lanes.sort_unstable();
    Ok(Some(lanes))
}
