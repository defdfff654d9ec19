//! Group commit (ADR-0036): the per-shard batching stage between the sends and
//! `commit_dispatch.lua`.
//!
//! Every shard has a queue. A commit for a shard joins its queue; if no call for that shard
//! is in flight, a flush task is started, which takes everything queued (at most
//! [`MAX_GROUP`]) and commits it in one script call, in queue order, hands each message its
//! own answer, and repeats until the queue is empty. So a send waits for no timer: alone, it
//! goes at once; under load, whatever queued while the previous call for its shard was in
//! flight goes in the next call. At most one call per shard is in flight.
//!
//! Order: a WebSocket connection commits its sends one after another (the next one only
//! after the answer to the last), so no group holds two sends of one connection, and its
//! sends to a shard get increasing offsets as before. Within a group the script commits in
//! queue order, each message answered as if committed alone at that point (its offset, or
//! duplicate, id reused, log exhausted — also against a message earlier in the same group).

use std::sync::Arc;

use tidemark_store::redis::dlog::{CommitRequest, Committed, LogStore};
use tidemark_store::topology::ShardMap;
use tidemark_store::Error as StoreError;
use tokio_util::task::TaskTracker;

use super::batch::{answer, Queues};

/// Most messages in one `commit_dispatch` call (the script runs ~6 µs per message, so a full
/// group holds its core instance for well under a millisecond).
pub const MAX_GROUP: usize = 128;

/// One message waiting in a shard's queue: an owned copy of what the script needs.
pub(crate) struct Pending {
    pub sender: String,
    pub client_id: String,
    pub recipients: Vec<String>,
    pub body: String,
    pub sent_at_us: u64,
    pub digest: String,
    /// The sender's home shard when the call claims the id too (ADR-0037).
    pub claim_home: Option<u32>,
}

struct Inner {
    map: ShardMap,
    /// One per core instance (index = instance).
    cores: Vec<LogStore>,
    dedupe_ttl_s: u64,
    shards: Queues<Pending, Result<Committed, StoreError>>,
    tracker: TaskTracker,
}

/// The per-shard queues (cheap to clone).
#[derive(Clone)]
pub(crate) struct GroupCommit {
    inner: Arc<Inner>,
}

impl GroupCommit {
    pub(crate) fn new(
        map: ShardMap,
        cores: Vec<LogStore>,
        dedupe_ttl_s: u64,
        tracker: TaskTracker,
    ) -> GroupCommit {
        let shards = Queues::new(map.shards() as usize);
        GroupCommit {
            inner: Arc::new(Inner {
                map,
                cores,
                dedupe_ttl_s,
                shards,
                tracker,
            }),
        }
    }

    /// Commits `msg` to `shard` with the next call for that shard; its own answer.
    pub(crate) async fn commit(&self, shard: u32, msg: Pending) -> Result<Committed, StoreError> {
        let (rx, start) = self.inner.shards.push(shard as usize, msg);
        if start {
            let inner = self.inner.clone();
            self.inner.tracker.spawn(flush(inner, shard));
        }
        // the flush task ended without an answer (a panic): the send fails, retryable
        rx.await.unwrap_or_else(|_| {
            Err(StoreError::UnexpectedReply {
                script: "commit_dispatch",
                detail: "the group commit stopped before answering".into(),
            })
        })
    }
}

/// Commits the shard's queue, one group per call, until it is empty.
async fn flush(inner: Arc<Inner>, shard: u32) {
    let _running = inner.shards.running(shard as usize);
    let mut core = inner.cores[inner.map.core_of(shard)].clone();
    loop {
        let Some(group) = inner.shards.next_batch(shard as usize, MAX_GROUP) else {
            return;
        };
        let recipients: Vec<Vec<&str>> = group
            .iter()
            .map(|w| w.item.recipients.iter().map(String::as_str).collect())
            .collect();
        let reqs: Vec<CommitRequest<'_>> = group
            .iter()
            .zip(&recipients)
            .map(|(w, rs)| CommitRequest {
                sender: &w.item.sender,
                client_id: &w.item.client_id,
                recipients: rs,
                body: &w.item.body,
                sent_at_us: w.item.sent_at_us,
                digest: &w.item.digest,
                claim_home: w.item.claim_home,
            })
            .collect();
        metrics::histogram!("tidemark_commit_group_size").record(reqs.len() as f64);
        let results = core.commit_group(shard, &reqs, inner.dedupe_ttl_s).await;
        drop(reqs);
        drop(recipients);
        answer(group, results);
    }
}
