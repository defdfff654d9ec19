//! Group commit (ADR-0036, ADR-0045): the batching stage between the sends and
//! `commit_dispatch.lua`.
//!
//! Every core instance has a queue. A commit joins the queue of its shard's instance; if
//! fewer than [`FLUSHERS`] flush tasks run for that instance, one is started. A flush task
//! takes everything queued (at most [`MAX_ROUND`] messages: a round) and splits it by shard.
//! On one core instance it commits the round's shards together, in script calls of at most
//! [`MAX_GROUP`] messages, each call holding several shards' whole parts (ADR-0051: at 5,000
//! msg/s over 64 shards a round holds ~30 messages of ~23 shards: one command instead of 23
//! for core Redis to read, run and write to its AOF, one call instead of 23 here; ADR-0091:
//! a part larger than a call is split over calls that run one after another, [`pack`]). On
//! a Redis Cluster a call holds one shard (one slot): each shard's part is committed in one
//! script call (a larger part takes several, one after another), all shards of the round
//! concurrently, each to the node of its slot, each shard in a task of its own that the round
//! waits for at most [`CLUSTER_ROUND_WAIT`] (ADR-0128: a hung node holds up only its own
//! shards' commits, not every round). The calls that can run at once are queued on
//! the instance's connection together, so redis-rs writes them together and core Redis reads
//! and runs them in one pass of its event loop: one `fdatasync`, one read and one reply write
//! for the whole round (measured: about one Redis read per round,
//! `docs/perf/profile-core-redis-5000.txt`). It hands each message its own
//! answer and repeats until the queue is empty. So a send waits for no timer beyond the linger
//! (below): alone, it goes at once; under load, whatever queued while the previous round
//! was being taken goes in the next round. Two flush tasks keep core Redis busy at full
//! load: while the gateway answers one round, Redis runs the next (with one, it
//! waited idle for the gateway: `bench commit` fell by a quarter, docs/performance.md).
//!
//! The linger (`commit_linger`, ADR-0045, 5 ms by default since ADR-0090): a round starts at
//! least that long after the previous round of its instance started, unless a call's worth
//! ([`MAX_GROUP`]) is already waiting. A send that finds the instance quiet for longer still
//! goes at once; under steady traffic, rounds come at most once per linger and each carries
//! what arrived meanwhile: fewer passes of core Redis (each with its `fdatasync`) for at most
//! the linger of added latency. tokio's timer has millisecond granularity (its docs: `Sleep`
//! "operates at millisecond granularity"), so a linger of N ms waits N to N + 1 ms: at 5,000
//! msg/s and the old 1 ms default the calls reached core Redis 1.82 ms apart (median, 9.7
//! messages a round), while its `fdatasync` takes 0.27 ms (median; `docs/performance.md`,
//! "The logs' trims sent together").
//!
//! Order: within a round, each shard's messages are committed in the order they were queued.
//! A shard's part is in one call, or, when larger than a call, in calls that run one after
//! another ([`pack`], ADR-0091); the script commits a call's messages of one log in the order
//! given, also when one of them needs a second call (ADR-0091). Nothing relies on the order in
//! which two calls in flight reach Redis (two flush tasks, a reconnect, a reloaded script, a
//! second call can change it): a WebSocket connection's messages awaiting answers are all in
//! one round (ADR-0089: it queues its one-shard sends into its open round only,
//! [`RoundTicket`], and [`take_round`] never splits a connection), and a send to several
//! shards is queued only once everything before it is answered. So a connection's sends to a shard get increasing
//! offsets. Within a shard's call the script commits in queue order, each message answered as
//! if committed alone at that point (its offset, duplicate, id reused, log exhausted — also
//! against a message earlier in the same group).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use tidemark_store::redis::dlog::{CommitRequest, Committed, DispatchRecord, LogStore};
use tidemark_store::topology::ShardMap;
use tidemark_store::Error as StoreError;
use tokio_util::task::TaskTracker;

use super::batch::{answer, Waiting};
use super::send::CommitPermit;
use crate::materializer::{CommitFeed, ShardFeed};

/// Most messages in one `commit_dispatch` call, all its parts together (the script runs ~6
/// µs per message, so a full call holds its core instance for well under a millisecond).
pub const MAX_GROUP: usize = 128;

/// Most messages in one round of an instance (all its shards together): a full round holds
/// core Redis for a few milliseconds at most, and bounds what one failed round fails.
pub const MAX_ROUND: usize = 1024;

/// Flush tasks (rounds in flight) per core instance.
pub const FLUSHERS: usize = 2;

/// On a Redis Cluster, how long a flush task waits for its round's calls before it takes the
/// next round and leaves the slower calls to finish on their own (ADR-0128). A round's calls
/// answer in milliseconds; one that takes longer is a node that is hung, dead before its
/// failover, or waiting out a `WAIT` for replicas it lost, and before this bound both flush
/// tasks waited for it (up to the client's 30 s response timeout), so every shard's commits
/// stopped with it. Each send is still bounded by the commit path's own timeout.
pub const CLUSTER_ROUND_WAIT: Duration = Duration::from_millis(250);

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
    /// The WebSocket connection that queued it among others not yet answered (ADR-0089), or
    /// 0: a round that takes one of a connection's messages takes all of them.
    pub conn: u64,
    /// The send's room among the commits in flight (its user's share and the gateway's), held
    /// until the message is answered: a connection that closes with sends queued does not
    /// free their room while they still wait for Redis (ADR-0095). `None`: the caller holds
    /// it.
    pub permit: Option<CommitPermit>,
}

/// The round of a core instance that a queued message will go in (ADR-0089): a connection
/// queues its next sends into that round only while it is still open (not yet taken), so all
/// its messages awaiting an answer are in one round and none can overtake another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RoundTicket {
    instance: usize,
    /// Rounds the instance had taken when the message was queued.
    round: u64,
}

type Answer = Result<Committed, StoreError>;

struct Inner {
    map: ShardMap,
    /// One per core instance (index = instance).
    cores: Vec<LogStore>,
    dedupe_ttl_s: u64,
    /// One queue per core instance.
    instances: Vec<Mutex<Queue>>,
    /// One per core instance: notified when its queue fills a call ([`MAX_GROUP`]), so that a
    /// flush task waiting out the linger starts the round at once (ADR-0090).
    full: Vec<tokio::sync::Notify>,
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
    /// Rounds taken so far ([`RoundTicket`]).
    rounds: u64,
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
        let full = cores.iter().map(|_| tokio::sync::Notify::new()).collect();
        GroupCommit {
            inner: Arc::new(Inner {
                map,
                cores,
                dedupe_ttl_s,
                instances,
                full,
                linger,
                tracker,
                feed,
            }),
        }
    }

    /// Commits `msg` to its shard with the next round of that shard's instance; its own
    /// answer.
    pub(crate) async fn commit(&self, msg: Pending) -> Answer {
        match self.enqueue(msg, None) {
            Ok((rx, _)) => received(rx.await),
            Err(_) => unreachable!("a message without a ticket is always queued"),
        }
    }

    /// Queues `msg` for the next round of its shard's instance now, without waiting: the
    /// answer comes on the receiver ([`received`] reads it), and the ticket names the round.
    /// Messages of one round are committed in the order queued, shard by shard. With `round`,
    /// only into that round: `msg` back if it was taken meanwhile, or is another instance's
    /// (ADR-0089).
    pub(crate) fn enqueue(
        &self,
        msg: Pending,
        round: Option<RoundTicket>,
    ) -> Result<(tokio::sync::oneshot::Receiver<Answer>, RoundTicket), Box<Pending>> {
        let instance = self.inner.map.core_of(msg.shard);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (start, full, taken) = {
            let mut q = self.inner.instances[instance].lock().expect("not poisoned");
            if round.is_some_and(|t| t.instance != instance || t.round != q.rounds) {
                return Err(Box::new(msg));
            }
            q.waiting.push(Waiting { item: msg, tx });
            let full = q.waiting.len() == MAX_GROUP;
            let start = q.flushers < FLUSHERS && {
                q.flushers += 1;
                true
            };
            (start, full, q.rounds)
        };
        if full {
            self.inner.full[instance].notify_one();
        }
        if start {
            let inner = self.inner.clone();
            self.inner.tracker.spawn(flush(inner, instance));
        }
        Ok((
            rx,
            RoundTicket {
                instance,
                round: taken,
            },
        ))
    }
}

/// The answer of a message queued by [`GroupCommit::enqueue`]; a flush task that ended
/// without answering (a panic) fails the send, retryable.
pub(crate) fn received(answer: Result<Answer, tokio::sync::oneshot::error::RecvError>) -> Answer {
    answer.unwrap_or_else(|_| {
        Err(StoreError::UnexpectedReply {
            script: "commit_dispatch",
            detail: "the group commit stopped before answering".into(),
        })
    })
}

impl Inner {
    /// The next step of a flush task of `instance`: a round to commit (its start is the
    /// instance's last), a wait for the linger, or the end of the task (nothing queued).
    fn next(&self, instance: usize) -> Next {
        let mut q = self.instances[instance].lock().expect("not poisoned");
        let now = Instant::now();
        if let Some(due) = q.last_round.map(|t| t + self.linger) {
            // a queue that fills a call goes at once: the linger is there to gather a round,
            // and this one is gathered (ADR-0090)
            if due > now && !q.waiting.is_empty() && q.waiting.len() < MAX_GROUP {
                return Next::Wait(due);
            }
        }
        if q.waiting.is_empty() {
            q.flushers -= 1;
            return Next::Stop;
        }
        q.last_round = Some(now);
        q.rounds += 1;
        Next::Round(take_round(&mut q.waiting, MAX_ROUND))
    }
}

/// A round from `waiting`: its first `max` messages, and, when that leaves some behind, the
/// rest of every connection it took a message of (ADR-0089), each in queue order, so that a
/// connection's messages awaiting answers are never split between two rounds.
fn take_round<T>(waiting: &mut Vec<Waiting<Pending, T>>, max: usize) -> Vec<Waiting<Pending, T>> {
    let n = waiting.len().min(max);
    let mut round: Vec<_> = waiting.drain(..n).collect();
    if waiting.is_empty() {
        return round;
    }
    let conns: std::collections::HashSet<u64> = round
        .iter()
        .map(|w| w.item.conn)
        .filter(|&c| c != 0)
        .collect();
    if !conns.is_empty() {
        for w in std::mem::take(waiting) {
            if conns.contains(&w.item.conn) {
                round.push(w);
            } else {
                waiting.push(w);
            }
        }
    }
    round
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
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => {}
                    _ = inner.full[instance].notified() => {}
                }
                continue;
            }
            Next::Stop => return,
        };
        crate::telemetry::hot()
            .commit_round_size
            .record(round.len() as f64);
        // by shard, each in queue order
        let mut by_shard: BTreeMap<u32, Vec<Waiting<Pending, Answer>>> = BTreeMap::new();
        for w in round {
            by_shard.entry(w.item.shard).or_default().push(w);
        }
        let core = &inner.cores[instance];
        if core.is_cluster() {
            // one slot per call: a call per shard, to the node of its slot, each shard's
            // calls a task of their own; the round waits for them at most
            // [`CLUSTER_ROUND_WAIT`], and what is still running then goes on without it
            // (ADR-0128): a node that does not answer holds up its own shards only
            let calls: Vec<_> = by_shard
                .into_iter()
                .map(|(shard, part)| {
                    let (task, core) = (inner.clone(), core.clone());
                    inner.tracker.spawn(async move {
                        let feed = task.feed.as_ref();
                        commit_shard(core, shard, part, task.dedupe_ttl_s, feed).await
                    })
                })
                .collect();
            let _ =
                tokio::time::timeout(CLUSTER_ROUND_WAIT, futures::future::join_all(calls)).await;
        } else {
            // one instance: the round's shards together, at most [`MAX_GROUP`] messages per
            // call (ADR-0051); the calls of a chain one after another, the chains
            // concurrently (ADR-0091)
            let chains = pack(by_shard).into_iter().map(|chain| async {
                for parts in chain {
                    commit_parts(core.clone(), parts, inner.dedupe_ttl_s, inner.feed.as_ref())
                        .await;
                }
            });
            futures::future::join_all(chains).await;
        }
    }
}

/// The parts of one commit call: (shard, its messages in queue order).
type Parts = Vec<(u32, Vec<Waiting<Pending, Answer>>)>;

/// Packs a round's shards, in shard order, into calls of at most [`MAX_GROUP`] messages, and
/// the calls into chains (ADR-0091): the calls of a chain run one after another, the chains
/// concurrently. A shard's part goes whole into one call when it fits one: a call that has
/// no room left for it is closed, and the part starts the next. Only a part larger than a
/// call is split, its pieces in queue order in consecutive calls of one chain, so that a
/// call of the shard starts only once the call before it is answered (with its second call
/// for one-key messages that need their dedupe keys, ADR-0043). Calls that run concurrently
/// reach Redis in the order written only while nothing intervenes: a `NOSCRIPT` reload, a
/// reconnect or that second call can put one call before another, and a connection's sends
/// to a shard (ADR-0089: in one round) must keep their order.
fn pack(by_shard: BTreeMap<u32, Vec<Waiting<Pending, Answer>>>) -> Vec<Vec<Parts>> {
    let mut chains = Vec::new();
    // the calls of the open chain before the open call
    let mut chain: Vec<Parts> = Vec::new();
    let mut call: Parts = Vec::new();
    let mut held = 0;
    for (shard, mut part) in by_shard {
        if held + part.len() > MAX_GROUP && !call.is_empty() {
            chain.push(std::mem::take(&mut call));
            chains.push(std::mem::take(&mut chain));
            held = 0;
        }
        // only a part larger than a call: its pieces in the chain, in order
        while part.len() > MAX_GROUP - held {
            let rest = part.split_off(MAX_GROUP - held);
            call.push((shard, std::mem::replace(&mut part, rest)));
            chain.push(std::mem::take(&mut call));
            held = 0;
        }
        held += part.len();
        call.push((shard, part));
        if held == MAX_GROUP {
            chain.push(std::mem::take(&mut call));
            chains.push(std::mem::take(&mut chain));
            held = 0;
        }
    }
    if !call.is_empty() {
        chain.push(call);
    }
    if !chain.is_empty() {
        chains.push(chain);
    }
    chains
}

/// Commits the parts of several shards in one script call (ADR-0051) and answers them. The
/// requests borrow the queued sends' fields as they are (their recipients too) and sit in one
/// list for the call, answered in one list (ADR-0083).
async fn commit_parts(
    mut core: LogStore,
    parts: Parts,
    dedupe_ttl_s: u64,
    feed: Option<&CommitFeed>,
) {
    let n: usize = parts.iter().map(|(_, group)| group.len()).sum();
    let reqs: Vec<CommitRequest<'_, String>> = parts
        .iter()
        .flat_map(|(_, group)| group.iter().map(request))
        .collect();
    let mut at = 0;
    let refs: Vec<(u32, &[CommitRequest<'_, String>])> = parts
        .iter()
        .map(|(shard, group)| {
            let part = &reqs[at..at + group.len()];
            at += group.len();
            (*shard, part)
        })
        .collect();
    crate::telemetry::hot().commit_group_size.record(n as f64);
    let results = core.commit_flat(&refs, dedupe_ttl_s).await;
    drop(refs);
    drop(reqs);
    match results {
        Ok(results) => {
            let mut results = results.into_iter();
            for (shard, group) in parts {
                let results = results.by_ref().take(group.len());
                match feed.and_then(|f| f.shard(shard)) {
                    Some(feed) => answer_and_offer(&feed, group, results),
                    None => answer(group, Ok(results)),
                }
            }
        }
        Err(e) => {
            for (_, group) in parts {
                answer(group, Err::<Vec<Answer>, _>(e.clone()));
            }
        }
    }
}

/// What the script needs of a queued message (its fields borrowed as they are).
fn request(w: &Waiting<Pending, Answer>) -> CommitRequest<'_, String> {
    CommitRequest {
        sender: &w.item.sender,
        client_id: &w.item.client_id,
        recipients: &w.item.recipients,
        body: &w.item.body,
        sent_at_us: w.item.sent_at_us,
        digest: &w.item.digest,
        claim_home: w.item.claim_home,
    }
}

/// On a Redis Cluster: commits one shard's part of a round, [`MAX_GROUP`] messages per call,
/// one call after another, and answers them.
async fn commit_shard(
    core: LogStore,
    shard: u32,
    mut part: Vec<Waiting<Pending, Answer>>,
    dedupe_ttl_s: u64,
    feed: Option<&CommitFeed>,
) {
    while !part.is_empty() {
        let rest = part.split_off(part.len().min(MAX_GROUP));
        let group = std::mem::replace(&mut part, rest);
        commit_parts(core.clone(), vec![(shard, group)], dedupe_ttl_s, feed).await;
    }
}

/// Answers a group's sends and hands each record the group added to the log (not the
/// duplicates) to this process's materializer of the shard (ADR-0049): the record as the log
/// holds it, made of the send's own fields (moved, not copied).
fn answer_and_offer(
    feed: &ShardFeed<'_>,
    group: Vec<Waiting<Pending, Answer>>,
    results: impl Iterator<Item = Answer>,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(shard: u32, client_id: usize) -> Waiting<Pending, Answer> {
        waiting_of(shard, client_id, 0)
    }

    fn waiting_of(shard: u32, client_id: usize, conn: u64) -> Waiting<Pending, Answer> {
        let (tx, _rx) = tokio::sync::oneshot::channel();
        Waiting {
            item: Pending {
                shard,
                sender: "alice".into(),
                client_id: client_id.to_string(),
                recipients: vec!["bob".into()],
                body: String::new(),
                sent_at_us: 0,
                digest: String::new(),
                claim_home: None,
                conn,
                permit: None,
            },
            tx,
        }
    }

    /// A round packs into calls of at most MAX_GROUP messages, shards in order, every message
    /// once and each shard's in queue order. A shard's part is split only when larger than a
    /// call, and then its calls are consecutive calls of one chain (ADR-0091).
    #[test]
    fn a_round_packs_into_calls_in_shard_and_queue_order_splitting_only_large_parts() {
        let sizes = [
            (3u32, 5usize),
            (1, 200),
            (7, 1),
            (2, MAX_GROUP - 5),
            (9, 60),
        ];
        let mut by_shard: BTreeMap<u32, Vec<Waiting<Pending, Answer>>> = BTreeMap::new();
        for (shard, n) in sizes {
            by_shard.insert(shard, (0..n).map(|i| waiting(shard, i)).collect());
        }
        let chains = pack(by_shard);
        // (shard, messages) of each call, by chain
        let layout: Vec<Vec<Vec<(u32, usize)>>> = chains
            .iter()
            .map(|chain| {
                chain
                    .iter()
                    .map(|call| call.iter().map(|(s, p)| (*s, p.len())).collect())
                    .collect()
            })
            .collect();
        assert_eq!(
            layout,
            [
                // shard 1's 200: 128, then 72 in a call of its own (shard 2's 123 would not fit)
                vec![vec![(1, MAX_GROUP)], vec![(1, 200 - MAX_GROUP)]],
                // shard 2's part whole in the next call; shard 3's 5 fill it
                vec![vec![(2, MAX_GROUP - 5), (3, 5)]],
                vec![vec![(7, 1), (9, 60)]],
            ]
        );
        // flattened: shards ascending, each shard's ids 0.. in order
        let flat: Vec<(u32, usize)> = chains
            .iter()
            .flatten()
            .flatten()
            .flat_map(|(s, p)| {
                p.iter()
                    .map(move |w| (*s, w.item.client_id.parse().unwrap()))
            })
            .collect();
        let mut want: Vec<(u32, usize)> = sizes
            .iter()
            .flat_map(|&(s, n)| (0..n).map(move |i| (s, i)))
            .collect();
        want.sort();
        assert_eq!(flat, want);
        assert!(chains
            .iter()
            .flatten()
            .flatten()
            .all(|(s, p)| p.iter().all(|w| w.item.shard == *s) && !p.is_empty()));
        // many shards of a few messages each: calls as full as whole parts allow, and no
        // shard in two calls
        let mut by_shard: BTreeMap<u32, Vec<Waiting<Pending, Answer>>> = BTreeMap::new();
        for shard in 0..64u32 {
            let n = 1 + (shard as usize * 7) % 30;
            by_shard.insert(shard, (0..n).map(|i| waiting(shard, i)).collect());
        }
        let total: usize = by_shard.values().map(Vec::len).sum();
        let chains = pack(by_shard);
        assert!(chains.iter().all(|chain| chain.len() == 1));
        let calls: Vec<&Parts> = chains.iter().flatten().collect();
        let held: Vec<usize> = calls
            .iter()
            .map(|c| c.iter().map(|(_, p)| p.len()).sum())
            .collect();
        assert_eq!(held.iter().sum::<usize>(), total);
        assert!(held.iter().all(|&n| n <= MAX_GROUP), "{held:?}");
        assert!(
            held[..held.len() - 1].iter().all(|&n| n > MAX_GROUP - 30),
            "{held:?}"
        );
        let mut shards: Vec<u32> = calls
            .iter()
            .flat_map(|c| c.iter().map(|(s, _)| *s))
            .collect();
        shards.dedup();
        assert_eq!(shards, (0..64).collect::<Vec<_>>());
    }

    /// ADR-0089: a round cut at its bound still takes every message of a connection it took
    /// one of, in queue order, and leaves the others queued in order; a round that takes the
    /// whole queue is the queue.
    #[test]
    fn a_round_cut_short_takes_all_of_each_connection_it_took_from() {
        // queue: conn 7 at 0 and 5, conn 0 (none) at 1 and 6, conn 8 at 2, conn 9 at 3, 4, 7
        let conns = [7u64, 0, 8, 9, 9, 7, 0, 9];
        let mut q: Vec<_> = conns
            .iter()
            .enumerate()
            .map(|(i, &c)| waiting_of(1, i, c))
            .collect();
        let ids = |v: &[Waiting<Pending, Answer>]| -> Vec<usize> {
            v.iter()
                .map(|w| w.item.client_id.parse().unwrap())
                .collect()
        };
        let round = take_round(&mut q, 3);
        assert_eq!(ids(&round), [0, 1, 2, 5]);
        assert_eq!(ids(&q), [3, 4, 6, 7]);
        let round = take_round(&mut q, 1);
        assert_eq!(ids(&round), [3, 4, 7]);
        assert_eq!(ids(&q), [6]);
        let round = take_round(&mut q, 1024);
        assert_eq!(ids(&round), [6]);
        assert!(q.is_empty());
    }
}
