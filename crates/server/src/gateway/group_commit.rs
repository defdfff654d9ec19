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

use std::sync::{Arc, Mutex};

use tidemark_store::redis::dlog::{CommitRequest, Committed, LogStore};
use tidemark_store::topology::ShardMap;
use tidemark_store::Error as StoreError;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

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

struct Waiting {
    msg: Pending,
    tx: oneshot::Sender<Result<Committed, StoreError>>,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Waiting>,
    /// A flush task runs for this shard.
    running: bool,
}

struct Inner {
    map: ShardMap,
    /// One per core instance (index = instance).
    cores: Vec<LogStore>,
    dedupe_ttl_s: u64,
    shards: Vec<Mutex<Queue>>,
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
        let shards = (0..map.shards()).map(|_| Mutex::default()).collect();
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
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut q = self.inner.shards[shard as usize]
                .lock()
                .expect("not poisoned");
            q.waiting.push(Waiting { msg, tx });
            !std::mem::replace(&mut q.running, true)
        };
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

/// Ends a flush: the shard is free for the next one. On a panic, the messages still queued
/// are dropped (their senders get an error and may retry: dedupe holds).
struct Running<'a> {
    queue: &'a Mutex<Queue>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.waiting.clear();
            q.running = false;
        }
    }
}

/// Commits the shard's queue, one group per call, until it is empty.
async fn flush(inner: Arc<Inner>, shard: u32) {
    let queue = &inner.shards[shard as usize];
    let _running = Running { queue };
    let mut core = inner.cores[inner.map.core_of(shard)].clone();
    loop {
        let group: Vec<Waiting> = {
            let mut q = queue.lock().expect("not poisoned");
            if q.waiting.is_empty() {
                q.running = false;
                return;
            }
            let n = q.waiting.len().min(MAX_GROUP);
            q.waiting.drain(..n).collect()
        };
        let recipients: Vec<Vec<&str>> = group
            .iter()
            .map(|w| w.msg.recipients.iter().map(String::as_str).collect())
            .collect();
        let reqs: Vec<CommitRequest<'_>> = group
            .iter()
            .zip(&recipients)
            .map(|(w, rs)| CommitRequest {
                sender: &w.msg.sender,
                client_id: &w.msg.client_id,
                recipients: rs,
                body: &w.msg.body,
                sent_at_us: w.msg.sent_at_us,
                digest: &w.msg.digest,
                claim_home: w.msg.claim_home,
            })
            .collect();
        metrics::histogram!("tidemark_commit_group_size").record(reqs.len() as f64);
        let results = core.commit_group(shard, &reqs, inner.dedupe_ttl_s).await;
        drop(reqs);
        match results {
            Ok(results) => {
                for (w, r) in group.into_iter().zip(results) {
                    let _ = w.tx.send(r);
                }
            }
            Err(e) => {
                for w in group {
                    let _ = w.tx.send(Err(e.clone()));
                }
            }
        }
    }
}
