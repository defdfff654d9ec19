//! Group commit (ADR-0036, ADR-0045): the batching stage between the sends and
//! `commit_dispatch.lua`.
//!
//! Every core instance has a queue. A commit joins the queue of its shard's instance; if
//! fewer than [`FLUSHERS`] flush tasks run for that instance, one is started. A flush task
//! takes everything queued (at most [`MAX_ROUND`] messages: a round), splits it by shard, and
//! commits each shard's part in one script call (at most [`MAX_GROUP`] messages; a larger
//! part takes several calls, one after another), all shards of the round concurrently. The
//! calls are queued on the instance's connection together, so redis-rs writes them together
//! and core Redis reads and runs them in one pass of its event loop: one `fdatasync`, one
//! read and one reply write for the whole round (measured: about one Redis read per round,
//! `docs/perf/profile-core-redis-5000.txt`). On a Redis Cluster the calls go to the nodes
//! of their shards, concurrently, as before. It hands each message its own answer and
//! repeats until the queue is empty. So a send waits for no timer beyond the linger
//! (below): alone, it goes at once; under load, whatever queued while the previous round
//! was being taken goes in the next round. Two flush tasks keep core Redis busy at full
//! load: while the gateway answers one round, Redis runs the next (with one, it
//! waited idle for the gateway: `bench commit` fell by a quarter, docs/performance.md).
//!
//! The linger (`commit_linger`, ADR-0045): a round starts at least that long after the
//! previous round of its instance started. A send that finds the instance quiet for longer
//! still goes at once; under steady traffic, rounds come at most once per linger and each
//! carries what arrived meanwhile: fewer passes of core Redis (each with its `fdatasync`) for
//! at most the linger of added latency.
//!
//! Order: a WebSocket connection commits its sends one after another (the next one only
//! after the answer to the last), so no two rounds in flight hold sends of one connection,
//! and its sends to a shard get increasing offsets as before. The calls of the two rounds
//! share the instance's connection, so Redis runs them in the order they were taken. Within
//! a shard's call the script commits in queue order, each message answered as if committed
//! alone at that point (its offset, duplicate, id reused, log exhausted — also against a
//! message earlier in the same group).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tidemark_store::redis::dlog::{CommitRequest, Committed, DispatchRecord, LogStore};
use tidemark_store::topology::ShardMap;
use tidemark_store::Error as StoreError;
use tokio_util::task::TaskTracker;

use super::batch::{answer, Waiting};
use crate::materializer::{CommitFeed, ShardFeed};

/// Most messages in one `commit_dispatch` call (the script runs ~6 µs per message, so a full
/// group holds its core instance for well under a millisecond).
pub const MAX_GROUP: usize = 128;

/// Most messages in one round of an instance (all its shards together): a full round holds
/// core Redis for a few milliseconds at most, and bounds what one failed round fails.
pub const MAX_ROUND: usize = 1024;

/// Flush tasks (rounds in flight) per core instance.
pub const FLUSHERS: usize = 2;

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
    instances: Vec<Mutex<Queue>>,
    /// Shortest time from one round of an instance to the next (zero: none).
    linger: Duration,
    tracker: TaskTracker,
    /// This process's materializers, to which each record committed is handed (ADR-0049).
    feed: Option<CommitFeed>,
}

/// A core instance's queue.
#[derive(Default)]
struct Queue {
    waiting: Vec<Waiting<Pending, Answer>>,
    /// Flush tasks running for the instance (at most [`FLUSHERS`]).
    flushers: usize,
    /// When the last round started (the linger counts from it).
    last_round: Option<Instant>,
}

/// What a flush task does next.
enum Next {
    Round(Vec<Waiting<Pending, Answer>>),
    Wait(Instant),
    Stop,
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
        feed: Option<CommitFeed>,
    ) -> GroupCommit {
        let instances = cores.iter().map(|_| Mutex::default()).collect();
        GroupCommit {
            inner: Arc::new(Inner {
                map,
                cores,
                dedupe_ttl_s,
                instances,
                linger,
                tracker,
                feed,
            }),
        }
    }

    /// Commits `msg` to its shard with the next round of that shard's instance; its own
    /// answer.
    pub(crate) async fn commit(&self, msg: Pending) -> Answer {
        let instance = self.inner.map.core_of(msg.shard);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let start = {
            let mut q = self.inner.instances[instance].lock().expect("not poisoned");
            q.waiting.push(Waiting { item: msg, tx });
            q.flushers < FLUSHERS && {
                q.flushers += 1;
                true
            }
        };
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

impl Inner {
    /// The next step of a flush task of `instance`: a round to commit (its start is the
    /// instance's last), a wait for the linger, or the end of the task (nothing queued).
    fn next(&self, instance: usize) -> Next {
        let mut q = self.instances[instance].lock().expect("not poisoned");
        let now = Instant::now();
        if let Some(due) = q.last_round.map(|t| t + self.linger) {
            if due > now && !q.waiting.is_empty() {
                return Next::Wait(due);
            }
        }
        if q.waiting.is_empty() {
            q.flushers -= 1;
            return Next::Stop;
        }
        q.last_round = Some(now);
        let n = q.waiting.len().min(MAX_ROUND);
        Next::Round(q.waiting.drain(..n).collect())
    }
}

/// Ends a flush task's claim on its instance if it panics: what is still queued is dropped
/// (those callers get an error; a retry is safe, commits dedupe), and the next commit starts
/// a flush task again.
struct Flusher<'a> {
    queue: &'a Mutex<Queue>,
}

impl Drop for Flusher<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.waiting.clear();
            q.flushers -= 1;
        }
    }
}

/// Commits the instance's queue, one round at a time, until it is empty.
async fn flush(inner: Arc<Inner>, instance: usize) {
    let _flusher = Flusher {
        queue: &inner.instances[instance],
    };
    loop {
        let round = match inner.next(instance) {
            Next::Round(round) => round,
            // what queues meanwhile joins the round
            Next::Wait(due) => {
                tokio::time::sleep_until(due).await;
                continue;
            }
            Next::Stop => return,
        };
        metrics::histogram!("tidemark_commit_round_size").record(round.len() as f64);
        // by shard, each in queue order
        let mut by_shard: BTreeMap<u32, Vec<Waiting<Pending, Answer>>> = BTreeMap::new();
        for w in round {
            by_shard.entry(w.item.shard).or_default().push(w);
        }
        let calls = by_shard.into_iter().map(|(shard, part)| {
            let core = inner.cores[instance].clone();
            let feed = inner.feed.as_ref().and_then(|f| f.shard(shard));
            commit_shard(core, shard, part, inner.dedupe_ttl_s, feed)
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
    feed: Option<ShardFeed<'_>>,
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
        match (&feed, results) {
            (Some(feed), Ok(results)) => answer_and_offer(feed, group, results),
            (_, results) => answer(group, results),
        }
    }
}

/// Answers a group's sends and hands each record the group added to the log (not the
/// duplicates) to this process's materializer of the shard (ADR-0049): the record as the log
/// holds it, made of the send's own fields (moved, not copied).
fn answer_and_offer(
    feed: &ShardFeed<'_>,
    group: Vec<Waiting<Pending, Answer>>,
    results: Vec<Answer>,
) {
    for (Waiting { item, tx }, r) in group.into_iter().zip(results) {
        let fresh = match &r {
            Ok(Committed {
                offset,
                duplicate: false,
            }) => Some(*offset),
            _ => None,
        };
        let _ = tx.send(r);
        if let Some(offset) = fresh {
            feed.offer(DispatchRecord {
                offset,
                prev: offset - 1,
                sender: item.sender,
                client_id: item.client_id,
                recipients: item.recipients,
                body: item.body,
                sent_at_us: item.sent_at_us,
            });
        }
    }
}
