//! Group commit (ADR-0036, ADR-0045): the batching stage between the sends and
//! `commit_dispatch.lua`.
//!
//! Every core instance has a queue. A commit joins the queue of its shard's instance; if no
//! round for that instance is in flight, a flush task is started, which takes everything
//! queued (at most [`MAX_ROUND`] messages), splits it by shard, and commits each shard's part
//! in one script call (at most [`MAX_GROUP`] messages; a larger part takes several calls, one
//! after another), all shards of the round concurrently, so that their calls leave in one
//! write and core Redis runs them in one pass of its event loop: one `fdatasync`, one read
//! and one reply write for the whole round. It hands each message its own answer and repeats
//! until the queue is empty. So a send waits for no timer: alone, it goes at once; under
//! load, whatever queued while the previous round of its instance was in flight goes in the
//! next round. At most one round per instance is in flight, so at most one call per shard.
//!
//! The linger (`commit_linger`, ADR-0045): a round starts at least that long after the
//! previous round of its instance started. A send that finds the instance quiet for longer
//! still goes at once; under steady traffic, rounds come at most once per linger and each
//! carries what arrived meanwhile: fewer passes of core Redis (each with its `fdatasync`) for
//! at most the linger of added latency.
//!
//! Order: a WebSocket connection commits its sends one after another (the next one only
//! after the answer to the last), so no round holds two sends of one connection, and its
//! sends to a shard get increasing offsets as before. Within a shard's call the script commits
//! in queue order, each message answered as if committed alone at that point (its offset,
//! duplicate, id reused, log exhausted — also against a message earlier in the same group).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tidemark_store::redis::dlog::{CommitRequest, Committed, LogStore};
use tidemark_store::topology::ShardMap;
use tidemark_store::Error as StoreError;
use tokio_util::task::TaskTracker;

use super::batch::{answer, Queues, Waiting};

/// Most messages in one `commit_dispatch` call (the script runs ~6 µs per message, so a full
/// group holds its core instance for well under a millisecond).
pub const MAX_GROUP: usize = 128;

/// Most messages in one round of an instance (all its shards together): a full round holds
/// core Redis for a few milliseconds at most, and bounds what one failed round fails.
pub const MAX_ROUND: usize = 1024;

/// One message waiting in an instance's queue: an owned copy of what the script needs.
pub(crate) struct Pending {
    /// The shard whose log it goes to.
    pub shard: u32,
    pub sender: String,
    pub client_id: String,
    pub recipients: Vec<String>,
    pub body: String,
    pub sent_at_us: u64,
    pub digest: String,
    /// The sender's home shard when the call claims the id too (ADR-0037).
    pub claim_home: Option<u32>,
}

type Answer = Result<Committed, StoreError>;

struct Inner {
    map: ShardMap,
    /// One per core instance (index = instance).
    cores: Vec<LogStore>,
    dedupe_ttl_s: u64,
    /// One queue per core instance.
    instances: Queues<Pending, Answer>,
    /// Shortest time from one round of an instance to the next (zero: none).
    linger: Duration,
    /// When the last round of each instance started (the linger counts from it).
    last_round: Vec<Mutex<Option<Instant>>>,
    tracker: TaskTracker,
}

/// The per-instance queues (cheap to clone).
#[derive(Clone)]
pub(crate) struct GroupCommit {
    inner: Arc<Inner>,
}

impl GroupCommit {
    pub(crate) fn new(
        map: ShardMap,
        cores: Vec<LogStore>,
        dedupe_ttl_s: u64,
        linger: Duration,
        tracker: TaskTracker,
    ) -> GroupCommit {
        let instances = Queues::new(cores.len());
        let last_round = cores.iter().map(|_| Mutex::new(None)).collect();
        GroupCommit {
            inner: Arc::new(Inner {
                map,
                cores,
                dedupe_ttl_s,
                instances,
                linger,
                last_round,
                tracker,
            }),
        }
    }

    /// Commits `msg` to its shard with the next round of that shard's instance; its own
    /// answer.
    pub(crate) async fn commit(&self, msg: Pending) -> Answer {
        let instance = self.inner.map.core_of(msg.shard);
        let (rx, start) = self.inner.instances.push(instance, msg);
        if start {
            let inner = self.inner.clone();
            self.inner.tracker.spawn(flush(inner, instance));
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

/// Commits the instance's queue, one round at a time, until it is empty.
async fn flush(inner: Arc<Inner>, instance: usize) {
    let _running = inner.instances.running(instance);
    loop {
        let last = *inner.last_round[instance].lock().expect("not poisoned");
        if let Some(last) = last.filter(|_| !inner.linger.is_zero()) {
            // what queues meanwhile joins this round
            tokio::time::sleep_until(last + inner.linger).await;
        }
        let Some(round) = inner.instances.next_batch(instance, MAX_ROUND) else {
            return;
        };
        *inner.last_round[instance].lock().expect("not poisoned") = Some(Instant::now());
        metrics::histogram!("tidemark_commit_round_size").record(round.len() as f64);
        // by shard, each in queue order
        let mut by_shard: BTreeMap<u32, Vec<Waiting<Pending, Answer>>> = BTreeMap::new();
        for w in round {
            by_shard.entry(w.item.shard).or_default().push(w);
        }
        let calls = by_shard.into_iter().map(|(shard, part)| {
            let core = inner.cores[instance].clone();
            commit_shard(core, shard, part, inner.dedupe_ttl_s)
        });
        futures::future::join_all(calls).await;
    }
}

/// Commits one shard's part of a round, [`MAX_GROUP`] messages per call, and answers them.
async fn commit_shard(
    mut core: LogStore,
    shard: u32,
    mut part: Vec<Waiting<Pending, Answer>>,
    dedupe_ttl_s: u64,
) {
    while !part.is_empty() {
        let rest = part.split_off(part.len().min(MAX_GROUP));
        let group = std::mem::replace(&mut part, rest);
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
        let results = core.commit_group(shard, &reqs, dedupe_ttl_s).await;
        drop(reqs);
        drop(recipients);
        answer(group, results);
    }
}
