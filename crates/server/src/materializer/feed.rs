//! The commit feed (ADR-0049): in a process that both serves clients and materializes, the
//! records its own gateway commits are handed to the worker that owns their shard, so the
//! worker need not read them back from the log with `XREAD`.
//!
//! ```text
//!   gateway: commit_dispatch answered {0, offset} ──offer──▶ CommitFeed ──▶ worker of the shard
//!                                                      (bounded queue; full: dropped, `lost`)
//!   worker, feed mode:   takes each shard's records that continue its read position;
//!                        reads the log (non-blocking XREAD, after what it holds) only every
//!                        FEED_POLL, 10 ms after a hole in what it was handed (a record
//!                        committed elsewhere, dropped, or answered out of order) and at once
//!                        when `lost` is set; once QUIET_POLLS polls in a row found nothing
//!                        and nothing was handed over between them, it waits on the log
//!                        (XREAD BLOCK) instead of polling it, until anything arrives (ADR-0068)
//!   worker, log mode:    XREAD BLOCK as before; what is handed over is kept above the read
//!                        positions, for the next try of feed mode
//! ```
//!
//! The feed is a shortcut, never the source of truth: a record is taken only where its `prev`
//! is the shard's read position, so nothing is skipped; the log is still read often enough
//! to find what the feed did not carry. A record a poll finds that is not handed over within
//! 50 ms (another gateway commits to these shards) puts the worker back in log mode; it tries
//! the feed again after a backoff (1 s, doubling to 5 min).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidemark_store::redis::dlog::DispatchRecord;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::worker::Worker;
use super::READ_GRACE;

/// Records queued for one worker before offers are dropped (the worker then reads the log).
pub const FEED_QUEUE: usize = 8192;

/// One worker's end of the feed.
pub(crate) struct FeedRx {
    pub(crate) rx: mpsc::Receiver<(u32, DispatchRecord)>,
    /// Set when an offer found the queue full: a record was not handed over.
    pub(crate) lost: Arc<AtomicBool>,
}

/// Where a shard's records go: its worker's queue.
#[derive(Clone)]
struct Route {
    tx: mpsc::Sender<(u32, DispatchRecord)>,
    lost: Arc<AtomicBool>,
}

/// The handle shared by a process's gateway (which offers) and materializer workers (which
/// register their shards). Cheap to clone.
#[derive(Clone, Default)]
pub struct CommitFeed {
    routes: Arc<Mutex<HashMap<u32, Route>>>,
    /// The replicas the gateway's commits wait for, by core instance URL (ADR-0094): a worker
    /// takes records from the feed only where they waited for as many as its own log reads
    /// would.
    waits: Arc<Mutex<HashMap<String, u32>>>,
}

impl std::fmt::Debug for CommitFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommitFeed").finish_non_exhaustive()
    }
}

impl CommitFeed {
    /// Registers a worker for `shards` (replacing a previous worker's registration of them);
    /// its queue closes when the returned end is dropped.
    pub(crate) fn register(&self, shards: &[u32]) -> FeedRx {
        let (tx, rx) = mpsc::channel(FEED_QUEUE);
        let lost = Arc::new(AtomicBool::new(false));
        let mut routes = self.routes.lock().expect("feed lock");
        for &s in shards {
            routes.insert(
                s,
                Route {
                    tx: tx.clone(),
                    lost: lost.clone(),
                },
            );
        }
        FeedRx { rx, lost }
    }

    /// Records that the gateway's commits to the core instance at `core_url` wait for
    /// `replicas` replicas before they are answered (and offered). Set by the gateway when it
    /// connects (ADR-0094).
    pub fn set_commit_wait(&self, core_url: &str, replicas: u32) {
        self.waits
            .lock()
            .expect("feed lock")
            .insert(core_url.to_string(), replicas);
    }

    /// The replicas the gateway's commits to `core_url` wait for; `None`: no gateway of this
    /// process said.
    fn commit_wait(&self, core_url: &str) -> Option<u32> {
        self.waits.lock().expect("feed lock").get(core_url).copied()
    }

    /// Where `shard`'s records go, if a worker of this process takes them (so building one
    /// is worth it): looked up once per commit call, not per record.
    pub fn shard(&self, shard: u32) -> Option<ShardFeed<'_>> {
        let route = self
            .routes
            .lock()
            .expect("feed lock")
            .get(&shard)
            .cloned()?;
        Some(ShardFeed {
            feed: self,
            shard,
            route,
        })
    }
}

/// One shard's end of the feed, for the records of one commit call.
pub struct ShardFeed<'a> {
    feed: &'a CommitFeed,
    shard: u32,
    route: Route,
}

impl ShardFeed<'_> {
    /// Hands a record just committed to the shard's worker. Never waits: a full queue drops
    /// the record (and flags the worker, which reads the log).
    pub fn offer(&self, rec: DispatchRecord) {
        match self.route.tx.try_send((self.shard, rec)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.route.lost.store(true, Ordering::Release);
                metrics::counter!("tidemark_commit_feed_dropped_total").increment(1);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                // the worker is gone: forget its routes (a new worker registers its own)
                let mut routes = self.feed.routes.lock().expect("feed lock");
                routes.retain(|_, r| !r.tx.is_closed());
            }
        }
    }
}

/// Drops the records at or below `pos` (the smallest first; no new map is built).
fn drop_through(m: &mut BTreeMap<u64, DispatchRecord>, pos: u64) {
    while let Some(e) = m.first_entry() {
        if *e.key() > pos {
            break;
        }
        e.remove();
    }
}

/// In feed mode, how often the log is read anyway (records the feed did not carry: another
/// gateway's commits, a dropped offer); also the longest such a record waits then.
pub const FEED_POLL: Duration = Duration::from_millis(100);
/// In feed mode, how many polls in a row that found nothing, with nothing handed over between
/// them, make the worker quiet: it then waits on the log with a blocking read (which any
/// commit to its shards ends at once, its own included) instead of polling it every
/// [`FEED_POLL`], so an idle process costs core Redis two reads a second, as log mode does,
/// not ten (ADR-0068).
pub const QUIET_POLLS: u32 = 10;
/// In feed mode, how soon the log is read after a hole shows in what was handed over (and
/// is still there): two flushes of one core instance may answer out of order, so most holes
/// close by themselves within a millisecond or two.
const HOLE_POLL: Duration = Duration::from_millis(10);
/// The first wait in log mode before the feed is tried again; it doubles on every failed
/// try, up to [`FEED_TRIAL_MAX`].
const FEED_TRIAL_FIRST: Duration = Duration::from_secs(1);
const FEED_TRIAL_MAX: Duration = Duration::from_secs(300);
/// Records held for shards the loop does not read now (a closed lease gate) before the
/// whole buffer is dropped (the log is read instead).
const FED_HELD_MAX: usize = 2 * FEED_QUEUE;
/// How long a record a poll found, and the feed had not handed over, may take to be offered
/// before it counts as another process's commit: under load the gateway's offer can come
/// some milliseconds after the log holds the record.
const SUSPECT_GRACE: Duration = Duration::from_millis(50);
/// Suspects held at most; more: another process commits here (log mode at once).
const SUSPECTS_MAX: usize = 4096;

/// A worker's side of the feed: what it was handed and in which mode it reads.
pub(crate) struct FeedState {
    rx: FeedRx,
    /// The feed, to read what the gateway's commits wait for (ADR-0094).
    feed: CommitFeed,
    /// The replicas this worker's log reads wait for (ADR-0064): the feed is used only when
    /// the gateway's commits to this core instance wait for at least as many.
    needs: u32,
    /// Records handed over and not yet taken, per shard, by offset (two flushes of one
    /// core instance may answer out of order).
    fed: BTreeMap<u32, BTreeMap<u64, DispatchRecord>>,
    /// Feed mode (the log is only polled) or log mode (`XREAD BLOCK`).
    on: bool,
    /// Log mode: when the feed is tried again.
    trial_at: Instant,
    /// The wait before the next try after a failed one.
    backoff: Duration,
    /// Feed mode: when the log is polled next.
    poll_at: Instant,
    /// Since when some shard's handed-over records have had a hole (none: no hole).
    hole_since: Option<Instant>,
    /// Records a poll found that the feed had not handed over yet, and when: each is this
    /// process's own commit if its offer follows within [`SUSPECT_GRACE`], else another's.
    suspects: HashMap<(u32, u64), Instant>,
    /// Polls in a row that found nothing while nothing was handed over: at [`QUIET_POLLS`]
    /// the log is waited on instead of polled (ADR-0068).
    quiet_polls: u32,
}

impl FeedState {
    pub(crate) fn new(feed: &CommitFeed, shards: &[u32], needs: u32) -> FeedState {
        let now = Instant::now();
        FeedState {
            rx: feed.register(shards),
            feed: feed.clone(),
            needs,
            fed: BTreeMap::new(),
            on: false,
            trial_at: now + FEED_TRIAL_FIRST,
            backoff: FEED_TRIAL_FIRST,
            poll_at: now,
            hole_since: None,
            suspects: HashMap::new(),
            quiet_polls: 0,
        }
    }

    fn held(&self) -> usize {
        self.fed.values().map(BTreeMap::len).sum()
    }
}

/// What a read in feed mode gave.
pub(super) enum FeedRead {
    Batches(Vec<(u32, Vec<DispatchRecord>)>),
    Failed(String),
    Cancelled,
}

impl Worker {
    /// Whether the loop reads in feed mode now.
    pub(super) fn feed_on(&self) -> bool {
        self.feed.as_ref().is_some_and(|f| f.on)
    }

    /// Moves what was handed over into the per-shard buffers (records of shards this worker
    /// does not run, or at or below their read position, are dropped).
    fn drain_feed(&mut self) {
        let Some(f) = self.feed.as_mut() else {
            return;
        };
        while let Ok((s, rec)) = f.rx.rx.try_recv() {
            if !f.suspects.is_empty() {
                f.suspects.remove(&(s, rec.offset));
            }
            let Some(sh) = self.owned.get(&s).filter(|sh| !sh.stopped) else {
                continue;
            };
            if rec.offset > sh.read_pos {
                f.fed.entry(s).or_default().insert(rec.offset, rec);
            }
        }
        if f.held() > FED_HELD_MAX {
            f.fed.clear();
            f.rx.lost.store(true, Ordering::Release);
        }
    }

    /// Drops what every shard's read position covers (log mode reads those records anyway).
    pub(super) fn prune_feed(&mut self) {
        self.drain_feed();
        let Some(f) = self.feed.as_mut() else {
            return;
        };
        for (s, m) in f.fed.iter_mut() {
            match self.owned.get(s).filter(|sh| !sh.stopped) {
                Some(sh) => drop_through(m, sh.read_pos),
                None => m.clear(),
            }
        }
        f.fed.retain(|_, m| !m.is_empty());
    }

    /// Each shard's handed-over records that continue its read position (at most a batch);
    /// true when some shard holds records after a hole. `positions` is in shard order (as
    /// [`Worker::scan`] gives it): the shards with records handed over are looked up in it,
    /// a few per step, where each of the 64 positions was looked up in the records (ADR-0077).
    fn fed_batches(&mut self, positions: &[(u32, u64)]) -> (Vec<(u32, Vec<DispatchRecord>)>, bool) {
        debug_assert!(
            positions.windows(2).all(|w| w[0].0 < w[1].0),
            "in shard order"
        );
        let batch = self.opts.batch;
        let Some(f) = self.feed.as_mut() else {
            return (Vec::new(), false);
        };
        let mut out = Vec::new();
        let mut hole = false;
        for (&s, m) in f.fed.iter_mut() {
            let Ok(i) = positions.binary_search_by_key(&s, |p| p.0) else {
                continue;
            };
            let pos = positions[i].1;
            drop_through(m, pos);
            let mut run = Vec::new();
            let mut at = pos;
            while run.len() < batch {
                match m.first_entry() {
                    Some(e) if e.get().prev == at => {
                        let rec = e.remove();
                        at = rec.offset;
                        run.push(rec);
                    }
                    _ => break,
                }
            }
            hole |= !m.is_empty() && run.len() < batch;
            if !run.is_empty() {
                f.quiet_polls = 0;
                crate::telemetry::hot()
                    .commit_feed_records
                    .increment(run.len() as u64);
                out.push((s, run));
            }
        }
        f.fed.retain(|_, m| !m.is_empty());
        (out, hole)
    }

    /// In log mode, after a read: tries the feed again once its backoff has passed, unless
    /// the read found a backlog (the log is the faster way through one).
    pub(super) fn feed_after_log_read(&mut self, backlog: bool) {
        self.prune_feed();
        let Some(f) = self.feed.as_mut() else {
            return;
        };
        let now = Instant::now();
        if !f.on && !backlog && now >= f.trial_at {
            // ADR-0094: records the gateway answered before as many replicas had them as
            // this worker's reads wait for would skip that wait: the log is read instead
            let waited = f.feed.commit_wait(&self.core_url);
            if waited.is_none_or(|w| w < f.needs) {
                f.trial_at = now + FEED_TRIAL_FIRST;
                return;
            }
            f.on = true;
            f.poll_at = now + FEED_POLL;
            metrics::counter!("tidemark_commit_feed_switches_total", "to" => "feed").increment(1);
            tracing::debug!(core = %self.core_shown, "commit feed: feed mode");
        }
    }

    /// A read in feed mode: the shards' handed-over records that continue their read
    /// positions, as soon as there are any; the log (non-blocking) every [`FEED_POLL`], soon
    /// after a hole, and at once after a dropped offer; otherwise nothing once `block` has
    /// passed. A quiet worker ([`QUIET_POLLS`]) waits on the log for the rest of `block`
    /// instead, if that is longer than a poll's interval.
    pub(super) async fn feed_read(
        &mut self,
        positions: &[(u32, u64)],
        block: Duration,
        cancel: &CancellationToken,
    ) -> FeedRead {
        let deadline = Instant::now() + block;
        loop {
            self.drain_feed();
            if self.foreign_suspects() {
                return FeedRead::Batches(Vec::new());
            }
            let (batches, hole) = self.fed_batches(positions);
            let f = self.feed.as_mut().expect("feed mode has a feed");
            // the periodic poll, or a hole's, whichever is first
            let due = if hole {
                let since = *f.hole_since.get_or_insert_with(Instant::now);
                f.poll_at.min(since + HOLE_POLL)
            } else {
                f.hole_since = None;
                f.poll_at
            };
            let now = Instant::now();
            let lost = f.rx.lost.swap(false, Ordering::AcqRel);
            // ADR-0092: a due poll goes before records in hand are returned, with them: under
            // load some shard nearly always has records in hand, and a poll that waited for a
            // turn without any held back every record the feed did not carry (another
            // gateway's, one after a dropped offer) until such a turn came
            if lost || now >= due {
                return self
                    .feed_poll(positions, batches, Duration::ZERO, cancel)
                    .await;
            }
            if !batches.is_empty() {
                return FeedRead::Batches(batches);
            }
            let left = deadline.saturating_duration_since(now);
            if f.quiet_polls >= QUIET_POLLS && !hole && left >= FEED_POLL {
                // ADR-0068: nothing for a while; any commit to these shards ends the wait
                return self.feed_poll(positions, Vec::new(), left, cancel).await;
            }
            let wake = deadline.min(due);
            let got = tokio::select! {
                _ = cancel.cancelled() => return FeedRead::Cancelled,
                rec = f.rx.rx.recv() => Some(rec),
                _ = tokio::time::sleep_until(wake.into()) => None,
            };
            match got {
                Some(Some((s, rec))) => {
                    f.suspects.remove(&(s, rec.offset));
                    f.fed.entry(s).or_default().insert(rec.offset, rec);
                }
                // no sender left (the routes of this worker's shards were replaced by a newer
                // registration, or the feed was dropped): the log is read from now on
                Some(None) => {
                    self.feed = None;
                    return FeedRead::Batches(Vec::new());
                }
                None if Instant::now() < due => return FeedRead::Batches(Vec::new()),
                None => {} // the poll is due: next turn
            }
        }
    }

    /// Polls the log after what was handed over (`batches`: each shard's records that continue
    /// its position, taken by the caller's [`Worker::fed_batches`]): each shard from the end
    /// of its records, which come first in its batch. Records in the log that the feed never
    /// handed over put the worker back in log mode: someone else commits to these shards. A
    /// non-zero `block` waits on the log up to that long (a quiet worker, ADR-0068), and only
    /// with nothing in hand: the records of this process's own commits are in the log before
    /// they are handed over, so they end the wait as anyone's do.
    async fn feed_poll(
        &mut self,
        positions: &[(u32, u64)],
        mut batches: Vec<(u32, Vec<DispatchRecord>)>,
        block: Duration,
        cancel: &CancellationToken,
    ) -> FeedRead {
        let ends: BTreeMap<u32, u64> = batches
            .iter()
            .filter_map(|(s, recs)| recs.last().map(|r| (*s, r.offset)))
            .collect();
        let from: Vec<(u32, u64)> = positions
            .iter()
            .map(|&(s, pos)| (s, ends.get(&s).copied().unwrap_or(pos)))
            .collect();
        // a wait only with nothing in hand (what was handed over goes now): the callers pass
        // a block only then
        debug_assert!(block.is_zero() || batches.is_empty());
        if !block.is_zero() {
            metrics::counter!("tidemark_commit_feed_quiet_waits_total").increment(1);
        }
        let reader = self.reader.as_mut().expect("the reader is here");
        let read = tokio::select! {
            _ = cancel.cancelled() => return FeedRead::Cancelled,
            r = tokio::time::timeout(
                block + READ_GRACE,
                reader.read(&from, self.opts.batch, block),
            ) => r,
        };
        let polled = match read {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => return FeedRead::Failed(e.to_string()),
            Err(_) => return FeedRead::Failed("XREAD timed out".to_string()),
        };
        let now = Instant::now();
        self.suspect_unfed(&from, &polled, now);
        for (s, recs) in polled {
            match batches.iter_mut().find(|(b, _)| *b == s) {
                Some((_, taken)) => taken.extend(recs),
                None => batches.push((s, recs)),
            }
        }
        let f = self.feed.as_mut().expect("feed mode has a feed");
        f.hole_since = None;
        f.poll_at = now + FEED_POLL;
        if batches.is_empty() {
            f.quiet_polls = f.quiet_polls.saturating_add(1);
        } else {
            f.quiet_polls = 0;
        }
        if f.suspects.is_empty() {
            f.backoff = FEED_TRIAL_FIRST;
        }
        FeedRead::Batches(batches)
    }

    /// Notes the records of a poll, above where it read from, that were never handed over.
    fn suspect_unfed(
        &mut self,
        from: &[(u32, u64)],
        batches: &[(u32, Vec<DispatchRecord>)],
        now: Instant,
    ) {
        self.drain_feed();
        let Some(f) = self.feed.as_mut() else {
            return;
        };
        let pos: BTreeMap<u32, u64> = from.iter().copied().collect();
        for (s, recs) in batches {
            let at = pos.get(s).copied().unwrap_or(0);
            let fed = f.fed.get(s);
            for r in recs.iter().filter(|r| r.offset > at) {
                if !fed.is_some_and(|m| m.contains_key(&r.offset)) {
                    f.suspects.insert((*s, r.offset), now);
                }
            }
        }
    }

    /// Whether a record a poll found was not offered within [`SUSPECT_GRACE`] (or too many
    /// wait): another process commits to these shards, and the worker goes back to log mode.
    fn foreign_suspects(&mut self) -> bool {
        let Some(f) = self.feed.as_mut() else {
            return false;
        };
        if f.suspects.is_empty() {
            return false;
        }
        let now = Instant::now();
        let late = f
            .suspects
            .values()
            .filter(|&&t| now.saturating_duration_since(t) >= SUSPECT_GRACE)
            .count();
        if late == 0 && f.suspects.len() <= SUSPECTS_MAX {
            return false;
        }
        f.suspects.clear();
        f.on = false;
        f.trial_at = now + f.backoff;
        f.backoff = (f.backoff * 2).min(FEED_TRIAL_MAX);
        metrics::counter!("tidemark_commit_feed_switches_total", "to" => "log").increment(1);
        tracing::debug!(
            core = %self.core_shown,
            late,
            retry_in_ms = f.trial_at.saturating_duration_since(now).as_millis() as u64,
            "commit feed: the log holds records the feed did not carry; log mode"
        );
        true
    }
}
