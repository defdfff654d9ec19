//! Shard health: what each owned shard is doing ([`ShardStatus`]), the board the
//! materializer writes and `/healthz`, the send path and `/metrics` read ([`HealthBoard`]).
//!
//! The board is the one place a shard's health is set, and it sets the shard's gauges
//! (`tidemark_shard_min_w`, `_head`, `_lag`, `_epoch`, `_running`) in the same call, so
//! `/metrics` shows what the board holds without work at scrape time.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A running shard that its worker's loop has not gone through for this long (not read, not
/// waiting for a retry: a closed lease gate, a worker stuck in a call or parked), or a shard
/// leased by this node that no worker runs, is reported by `/healthz`: a stall is never silent.
/// Well above a worker loop's longest normal turn (an `XREAD BLOCK` of
/// [`crate::materializer::MaterializerOptions::block`] and a step).
pub const NOT_SERVED_AFTER: Duration = Duration::from_secs(5);

/// State of one shard as the owner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardStatus {
    /// Claiming and resuming.
    Starting,
    /// Materialising.
    Running,
    /// Another owner raised the epoch; this one stopped.
    Fenced { current_epoch: Option<u64> },
    /// Record `offset` has recipients in `lane`, which is empty (presence 0): no lane takes the
    /// record (its messages are kept; GC never passes it). The owner re-checks every
    /// [`crate::materializer::RETRY_MAX`] and resumes once the lane is initialised.
    LaneEmpty { lane: usize, offset: u64 },
    /// The log does not continue from W: the next record it holds is `next` (None: it holds
    /// nothing after W) although the head is above W (a restore moved W back, or the log was
    /// trimmed above W). Only this shard waits; it re-checks every few seconds.
    Discontinuity { w: u64, next: Option<u64> },
    /// The watermark is corrupt; the shard is stopped (fail closed).
    Corrupt(String),
    /// Some other failure stopped the shard.
    Failed(String),
}

/// Health of one shard, for `/healthz` and `/metrics`.
#[derive(Debug, Clone)]
pub struct ShardHealth {
    /// Current status.
    pub status: ShardStatus,
    /// Epoch this owner holds.
    pub epoch: u64,
    /// Lowest present W last seen.
    pub min_w: u64,
    /// Log head last seen (`head:{s}`).
    pub head: u64,
    /// When W last moved (or the shard was last seen idle with nothing to do).
    pub last_progress: Instant,
    /// When the worker's loop last went through the shard (read its log, or waited for its
    /// retry); see [`NOT_SERVED_AFTER`].
    pub served_at: Instant,
    /// The failure the shard is retrying after, and since when (None: not retrying).
    pub retrying: Option<(String, Instant)>,
    /// The log head is at 2^48−1: commits to this shard are refused (`log_exhausted`).
    pub log_exhausted: bool,
}

/// Shared board of shard health: written by the materializer, read by `/healthz`, the send
/// path and `/metrics` (whose per-shard gauges it keeps current).
#[derive(Debug, Default)]
pub struct HealthBoard {
    shards: Mutex<BTreeMap<u32, Entry>>,
    /// Shards whose status is `Corrupt` now: read on every send ([`HealthBoard::is_corrupt`]),
    /// so the common case (none) costs one atomic load instead of the board's lock.
    corrupt: std::sync::atomic::AtomicUsize,
    /// Leases mode: the shards whose lease this node holds, and since when (set by the lease
    /// loop every tick).
    leased: Mutex<BTreeMap<u32, Instant>>,
    /// Leases mode: the shards this node lost because it could not renew their lease (core
    /// Redis not answering), and since when, until it holds them again or they are assigned
    /// to another node (ADR-0102): no worker runs them, and maybe no node does.
    unrenewed: Mutex<BTreeMap<u32, Instant>>,
    /// Leases mode: another live process registered this node's id (ADR-0114), and since
    /// when: this node holds no lease meanwhile.
    id_in_use: Mutex<Option<Instant>>,
    /// The gateway's wake subscribers that are not subscribed now, by mailbox instance (its
    /// URL without password): since when, and why (the last failure). A subscriber handles
    /// its failures itself and retries for ever, so without this `/healthz` said "ok" while
    /// no hint of the instance woke a connection and its sweep did not run (ADR-0126).
    wake_down: Mutex<BTreeMap<String, (Instant, String)>>,
    /// The supervised tasks ([`crate::supervise::supervise`]), by the id
    /// [`HealthBoard::register_task`] gave: a task that keeps failing is restarted for ever,
    /// and without this `/healthz` would say "ok" while it does no work.
    tasks: Mutex<Vec<TaskRuns>>,
}

/// A wake subscriber not subscribed for this long is reported by `/healthz` (ADR-0126): a
/// reconnection takes well under a second (a retry every 500 ms), and a mailbox instance that
/// fails over takes a few seconds.
pub const WAKE_DOWN_AFTER: Duration = Duration::from_secs(10);

/// Restarts in a row after which a supervised task that has not stayed up for
/// [`crate::supervise::HEALTHY_RUN`] is reported by `/healthz`: one restart is a hiccup
/// (logged and counted), three that each failed within that time are a loop.
pub const RESTART_LOOP: u32 = 3;

/// How one supervised task's runs have gone.
#[derive(Debug)]
struct TaskRuns {
    name: &'static str,
    /// Runs that ended one after the other, none of them up for
    /// [`crate::supervise::HEALTHY_RUN`] (0: none ended yet).
    streak: u32,
    /// How the last run ended.
    last: String,
    /// When the current run started; `None` while it waits to be restarted.
    running_since: Option<Instant>,
}

impl TaskRuns {
    /// The current run has stayed up for [`crate::supervise::HEALTHY_RUN`].
    fn up_long(&self) -> bool {
        self.running_since
            .is_some_and(|since| since.elapsed() >= crate::supervise::HEALTHY_RUN)
    }
}

/// One shard's health and the handles of its gauges (registered once, set on change).
#[derive(Debug)]
struct Entry {
    health: ShardHealth,
    gauges: ShardGauges,
}

/// The per-shard gauges of `/metrics`, labelled `shard`.
#[derive(Debug)]
struct ShardGauges {
    min_w: metrics::Gauge,
    head: metrics::Gauge,
    lag: metrics::Gauge,
    epoch: metrics::Gauge,
    running: metrics::Gauge,
    /// The values last set (min_w, head, lag, epoch, running), `None` before the first: a
    /// gauge is set only when its value changes. The materializer updates a moved shard's
    /// health after every step until its hint goes out (ADR-0047), mostly with nothing new,
    /// and setting all five gauges each time was 1 % of the server's instructions.
    shown: Option<[u64; 5]>,
}

impl ShardGauges {
    fn new(shard: u32) -> ShardGauges {
        // handles taken before the recorder is installed would record nothing
        let _ = crate::telemetry::metrics_handle();
        let label = shard.to_string();
        ShardGauges {
            min_w: metrics::gauge!("tidemark_shard_min_w", "shard" => label.clone()),
            head: metrics::gauge!("tidemark_shard_head", "shard" => label.clone()),
            lag: metrics::gauge!("tidemark_shard_lag", "shard" => label.clone()),
            epoch: metrics::gauge!("tidemark_shard_epoch", "shard" => label.clone()),
            running: metrics::gauge!("tidemark_shard_running", "shard" => label),
            shown: None,
        }
    }

    /// Brings every gauge to `h`'s value, setting only those whose value changed.
    fn set(&mut self, h: &ShardHealth) {
        let running = u64::from(matches!(h.status, ShardStatus::Running));
        let now = [
            h.min_w,
            h.head,
            h.head.saturating_sub(h.min_w),
            h.epoch,
            running,
        ];
        let gauges = [
            &self.min_w,
            &self.head,
            &self.lag,
            &self.epoch,
            &self.running,
        ];
        for (i, gauge) in gauges.into_iter().enumerate() {
            if self.shown.is_none_or(|shown| shown[i] != now[i]) {
                gauge.set(now[i] as f64);
            }
        }
        self.shown = Some(now);
    }
}

impl HealthBoard {
    /// Changes `shard`'s health with `f` and brings its gauges up to date: the only place
    /// a shard's health (and so its `/metrics` gauges) is set.
    pub(crate) fn update(&self, shard: u32, f: impl FnOnce(&mut ShardHealth)) {
        let mut m = self.shards.lock().expect("health lock");
        let e = m.entry(shard).or_insert_with(|| Entry {
            health: ShardHealth {
                status: ShardStatus::Starting,
                epoch: 0,
                min_w: 0,
                head: 0,
                last_progress: Instant::now(),
                served_at: Instant::now(),
                retrying: None,
                log_exhausted: false,
            },
            gauges: ShardGauges::new(shard),
        });
        let h = &mut e.health;
        let was = matches!(h.status, ShardStatus::Corrupt(_));
        f(h);
        e.gauges.set(h);
        let is = matches!(h.status, ShardStatus::Corrupt(_));
        if was != is {
            let c = &self.corrupt;
            if is {
                c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            } else {
                c.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Records that `shard` is retrying after `why`, keeping when the retrying began.
    pub(crate) fn set_retrying(&self, shard: u32, why: &str) {
        self.update(shard, |h| {
            let since = h.retrying.as_ref().map_or_else(Instant::now, |r| r.1);
            h.retrying = Some((why.to_string(), since));
        });
    }

    /// Records that the worker's loop went through `shards` just now (one lock; the gauges do
    /// not change).
    pub(crate) fn mark_served(&self, shards: &[u32]) {
        let now = Instant::now();
        let mut m = self.shards.lock().expect("health lock");
        for s in shards {
            if let Some(e) = m.get_mut(s) {
                e.health.served_at = now;
            }
        }
    }

    /// A supervised task named `name` (several may share a name) is about to start its
    /// first run: its id for [`Self::task_started`] and [`Self::task_ended`].
    pub(crate) fn register_task(&self, name: &'static str) -> usize {
        let mut t = self.tasks.lock().expect("health lock");
        t.push(TaskRuns {
            name,
            streak: 0,
            last: String::new(),
            running_since: None,
        });
        t.len() - 1
    }

    /// Task `id` starts a run now.
    pub(crate) fn task_started(&self, id: usize) {
        if let Some(t) = self.tasks.lock().expect("health lock").get_mut(id) {
            t.running_since = Some(Instant::now());
        }
    }

    /// Task `id`'s run ended (`how`) before it was asked to stop; it will be restarted. A
    /// run that was up for [`crate::supervise::HEALTHY_RUN`] starts a new streak.
    pub(crate) fn task_ended(&self, id: usize, how: &str) {
        if let Some(t) = self.tasks.lock().expect("health lock").get_mut(id) {
            t.streak = if t.up_long() { 1 } else { t.streak + 1 };
            t.last = how.to_string();
            t.running_since = None;
        }
    }

    /// Task `id` was asked to stop (its cancellation): whatever its runs did, it is not
    /// failing now, and is no longer reported.
    pub(crate) fn task_stopped(&self, id: usize) {
        if let Some(t) = self.tasks.lock().expect("health lock").get_mut(id) {
            t.streak = 0;
            t.running_since = None;
        }
    }

    /// The wake subscriber of mailbox instance `instance` is not subscribed, because of `why`
    /// (kept since when it was first not subscribed; `why` is the latest reason).
    pub(crate) fn wake_unsubscribed(&self, instance: &str, why: &str) {
        let mut m = self.wake_down.lock().expect("health lock");
        match m.get_mut(instance) {
            Some((_, last)) => why.clone_into(last),
            None => {
                m.insert(instance.to_string(), (Instant::now(), why.to_string()));
            }
        }
    }

    /// The wake subscriber of `instance` is subscribed (or stopped on purpose): no longer
    /// reported.
    pub(crate) fn wake_subscribed(&self, instance: &str) {
        self.wake_down.lock().expect("health lock").remove(instance);
    }

    /// Leases mode: the shards whose lease this node holds now (kept since when they were
    /// first given).
    pub(crate) fn set_leased(&self, shards: impl IntoIterator<Item = u32>) {
        let now = Instant::now();
        let mut m = self.leased.lock().expect("health lock");
        let old = std::mem::take(&mut *m);
        *m = shards
            .into_iter()
            .map(|s| (s, old.get(&s).copied().unwrap_or(now)))
            .collect();
    }

    /// Leases mode: the shards lost because their lease could not be renewed, each with when
    /// it was lost (ADR-0102).
    pub(crate) fn set_unrenewed(&self, shards: &BTreeMap<u32, Instant>) {
        *self.unrenewed.lock().expect("health lock") = shards.clone();
    }

    /// Leases mode: whether another live process has registered this node's id (ADR-0114).
    pub(crate) fn set_id_in_use(&self, in_use: bool) {
        let mut m = self.id_in_use.lock().expect("health lock");
        if !in_use {
            *m = None;
        } else if m.is_none() {
            *m = Some(Instant::now());
        }
    }

    /// Marks `shards` as having no running owner (a worker restarting after a panic or an
    /// error): `/healthz` reports them until the worker has re-claimed them.
    pub fn mark_down(&self, shards: &[u32], why: &str) {
        for &s in shards {
            self.update(s, |h| {
                h.status = ShardStatus::Failed(why.to_string());
                h.retrying = None;
            });
        }
    }

    /// Forgets `shard` (handed over to another node): `/healthz` no longer reports it and its
    /// `tidemark_shard_running` gauge is 0.
    pub fn forget(&self, shard: u32) {
        let mut m = self.shards.lock().expect("health lock");
        if let Some(e) = m.remove(&shard) {
            e.gauges.running.set(0.0);
            if matches!(e.health.status, ShardStatus::Corrupt(_)) {
                self.corrupt
                    .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Those of `shards` whose worker stopped them fenced (another owner raised the epoch).
    pub(crate) fn fenced_among(&self, shards: impl IntoIterator<Item = u32>) -> Vec<u32> {
        let m = self.shards.lock().expect("health lock");
        shards
            .into_iter()
            .filter(|s| {
                m.get(s)
                    .is_some_and(|e| matches!(e.health.status, ShardStatus::Fenced { .. }))
            })
            .collect()
    }

    /// True when `shard` is owned here and stopped because its watermark is corrupt.
    pub fn is_corrupt(&self, shard: u32) -> bool {
        if self.corrupt.load(std::sync::atomic::Ordering::Relaxed) == 0 {
            return false;
        }
        self.shards
            .lock()
            .expect("health lock")
            .get(&shard)
            .is_some_and(|e| matches!(e.health.status, ShardStatus::Corrupt(_)))
    }

    /// A copy of every shard's health.
    pub fn snapshot(&self) -> BTreeMap<u32, ShardHealth> {
        let m = self.shards.lock().expect("health lock");
        m.iter().map(|(&s, e)| (s, e.health.clone())).collect()
    }

    /// Problems that make the service unhealthy: a supervised task in a restart loop
    /// ([`RESTART_LOOP`]), a wake subscriber not subscribed for [`WAKE_DOWN_AFTER`], a shard not running, one with a lag that has not moved for
    /// `stuck_after`, one its worker has not gone through for [`NOT_SERVED_AFTER`], and one
    /// leased here that no worker runs.
    pub fn problems(&self, stuck_after: Duration) -> Vec<String> {
        let mut out = Vec::new();
        for t in self.tasks.lock().expect("health lock").iter() {
            if t.streak >= RESTART_LOOP && !t.up_long() {
                out.push(format!(
                    "task {}: restarted {} times in a row, no run up for {:?} ({}); last run {}",
                    t.name,
                    t.streak,
                    crate::supervise::HEALTHY_RUN,
                    if t.running_since.is_some() {
                        "running again"
                    } else {
                        "waiting to restart"
                    },
                    t.last
                ));
            }
        }
        for (instance, (since, why)) in self.wake_down.lock().expect("health lock").iter() {
            if since.elapsed() > WAKE_DOWN_AFTER {
                out.push(format!(
                    "wake subscriber of {instance}: not subscribed for {:?}: no hint of its \
                     shards wakes a connection here, and its sweep does not run; last failure: \
                     {why}",
                    since.elapsed()
                ));
            }
        }
        if let Some(since) = *self.id_in_use.lock().expect("health lock") {
            out.push(format!(
                "node id in use by another live process for {:?}: this node holds no lease \
                 until that process stops (give each process its own --node-id)",
                since.elapsed()
            ));
        }
        let snapshot = self.snapshot();
        let unrenewed = self.unrenewed.lock().expect("health lock").clone();
        for (s, since) in unrenewed {
            if since.elapsed() > NOT_SERVED_AFTER {
                out.push(format!(
                    "shard {s}: not materialized: its lease could not be renewed {:?} ago (core \
                     Redis not answering) and this node has not held it since",
                    since.elapsed()
                ));
            }
        }
        let leased = self.leased.lock().expect("health lock").clone();
        for (s, since) in leased {
            if !snapshot.contains_key(&s) && since.elapsed() > NOT_SERVED_AFTER {
                out.push(format!(
                    "shard {s}: not materialized: leased by this node for {:?}, but no worker \
                     runs it",
                    since.elapsed()
                ));
            }
        }
        for (s, h) in snapshot {
            if h.log_exhausted {
                out.push(format!(
                    "shard {s}: log exhausted (head {} = 2^48-1): sends are refused with \
                     log_exhausted",
                    h.head
                ));
            }
            match &h.status {
                ShardStatus::Running => {
                    if let Some((err, since)) = &h.retrying {
                        out.push(format!(
                            "shard {s}: retrying for {:?} (W={}, head {}): {err}",
                            since.elapsed(),
                            h.min_w,
                            h.head
                        ));
                    } else if h.served_at.elapsed() > NOT_SERVED_AFTER {
                        out.push(format!(
                            "shard {s}: not materialized for {:?}: its worker has not read its \
                             log (W={}, head {} when last seen)",
                            h.served_at.elapsed(),
                            h.min_w,
                            h.head
                        ));
                    } else if h.head > h.min_w && h.last_progress.elapsed() > stuck_after {
                        out.push(format!(
                            "shard {s}: stuck at W={} with head {} for {:?}",
                            h.min_w,
                            h.head,
                            h.last_progress.elapsed()
                        ));
                    }
                }
                ShardStatus::Starting => out.push(format!("shard {s}: starting")),
                ShardStatus::LaneEmpty { lane, offset } => out.push(format!(
                    "shard {s}: record {offset} has recipients in lane {lane}, which is empty; \
                     held (nothing dropped) until the lane is initialised"
                )),
                ShardStatus::Discontinuity { w, next } => out.push(format!(
                    "shard {s}: log discontinuity: W={w}, head {}, but the log's next record \
                     is {} (see docs/operations.md, Restores)",
                    h.head,
                    next.map_or("none".to_string(), |n| n.to_string())
                )),
                other => out.push(format!("shard {s}: {other:?}")),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long_ago() -> Instant {
        Instant::now()
            .checked_sub(NOT_SERVED_AFTER + Duration::from_secs(1))
            .expect("a monotonic clock older than a few seconds")
    }

    const STUCK: Duration = Duration::from_secs(10);

    /// The value of the gauge `name` of `shard` in the rendered `/metrics`.
    fn gauge(name: &str, shard: u32) -> f64 {
        let text = crate::telemetry::metrics_handle().render();
        let prefix = format!("{name}{{shard=\"{shard}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str())?.parse().ok())
            .unwrap_or_else(|| panic!("{prefix} not rendered"))
    }

    /// A shard's gauges follow its health through every update, those set only on change
    /// included: a value that goes back to an earlier one, one that stays while another
    /// moves, a status that comes and goes.
    #[test]
    fn a_shards_gauges_follow_every_update() {
        // a shard no other test of this process uses: the recorder is global
        let s = 4_000_017;
        let b = HealthBoard::default();
        let shown = |min_w: f64, head: f64, lag: f64, epoch: f64, running: f64| {
            assert_eq!(gauge("tidemark_shard_min_w", s), min_w, "min_w");
            assert_eq!(gauge("tidemark_shard_head", s), head, "head");
            assert_eq!(gauge("tidemark_shard_lag", s), lag, "lag");
            assert_eq!(gauge("tidemark_shard_epoch", s), epoch, "epoch");
            assert_eq!(gauge("tidemark_shard_running", s), running, "running");
        };
        b.update(s, |h| {
            h.status = ShardStatus::Running;
            h.epoch = 3;
            h.head = 9;
            h.min_w = 5;
        });
        shown(5.0, 9.0, 4.0, 3.0, 1.0);
        // nothing changes: nothing moves
        b.update(s, |h| h.last_progress = Instant::now());
        shown(5.0, 9.0, 4.0, 3.0, 1.0);
        b.update(s, |h| h.min_w = 9);
        shown(9.0, 9.0, 0.0, 3.0, 1.0);
        // back to an earlier value (a restore): shown again
        b.update(s, |h| h.min_w = 5);
        shown(5.0, 9.0, 4.0, 3.0, 1.0);
        b.update(s, |h| {
            h.status = ShardStatus::Fenced {
                current_epoch: Some(4),
            }
        });
        shown(5.0, 9.0, 4.0, 3.0, 0.0);
        b.update(s, |h| {
            h.status = ShardStatus::Running;
            h.epoch = 4;
        });
        shown(5.0, 9.0, 4.0, 4.0, 1.0);
        b.forget(s);
        assert_eq!(gauge("tidemark_shard_running", s), 0.0);
        // taken again: its gauges are set anew
        b.update(s, |h| h.status = ShardStatus::Running);
        shown(0.0, 0.0, 0.0, 0.0, 1.0);
    }

    #[test]
    fn a_running_shard_its_worker_does_not_go_through_is_reported() {
        let b = HealthBoard::default();
        for s in 0..3 {
            b.update(s, |h| h.status = ShardStatus::Running);
        }
        assert!(b.problems(STUCK).is_empty());
        b.update(1, |h| h.served_at = long_ago());
        let p = b.problems(STUCK);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("shard 1: not materialized for "), "{p:?}");
        // the worker's loop goes through it again
        b.mark_served(&[1]);
        assert!(b.problems(STUCK).is_empty());
        // a shard in retry says why instead (it is not stalled: it retries)
        b.update(2, |h| {
            h.served_at = long_ago();
            h.retrying = Some(("boom".into(), Instant::now()));
        });
        let p = b.problems(STUCK);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("shard 2: retrying for "), "{p:?}");
    }

    #[test]
    fn a_task_in_a_restart_loop_is_reported_until_a_run_stays_up() {
        let b = HealthBoard::default();
        let t = b.register_task("wake_subscriber");
        let other = b.register_task("wake_subscriber");
        b.task_started(other);
        b.task_started(t);
        // failures below the loop threshold are hiccups
        for _ in 1..RESTART_LOOP {
            b.task_ended(t, "panicked: boom");
            assert!(b.problems(STUCK).is_empty());
            b.task_started(t);
        }
        b.task_ended(t, "panicked: boom");
        let p = b.problems(STUCK);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with("task wake_subscriber: restarted 3 times in a row"),
            "{p:?}"
        );
        assert!(p[0].contains("waiting to restart"), "{p:?}");
        assert!(p[0].ends_with("last run panicked: boom"), "{p:?}");
        // restarted: still reported until the run has stayed up
        b.task_started(t);
        assert_eq!(b.problems(STUCK).len(), 1);
        b.tasks.lock().unwrap()[t].running_since =
            Instant::now().checked_sub(crate::supervise::HEALTHY_RUN);
        assert!(b.problems(STUCK).is_empty());
        // a run that stayed up starts a new streak when it ends
        b.task_ended(t, "exited: returned");
        assert!(b.problems(STUCK).is_empty());
    }

    /// ADR-0126: a wake subscriber that is not subscribed is reported once it has not been
    /// for [`WAKE_DOWN_AFTER`], with its latest failure, until it subscribes again.
    #[test]
    fn a_wake_subscriber_not_subscribed_is_reported_until_it_is() {
        let b = HealthBoard::default();
        let url = "redis://127.0.0.1:6379";
        b.wake_unsubscribed(url, "starting");
        assert!(b.problems(STUCK).is_empty(), "not for a moment");
        b.wake_unsubscribed(url, "NOPERM this user has no permissions");
        let since = Instant::now()
            .checked_sub(WAKE_DOWN_AFTER + Duration::from_secs(1))
            .unwrap();
        b.wake_down.lock().unwrap().get_mut(url).unwrap().0 = since;
        // a further failure keeps when it began
        b.wake_unsubscribed(url, "NOPERM again");
        let p = b.problems(STUCK);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with(&format!("wake subscriber of {url}: not subscribed for ")),
            "{p:?}"
        );
        assert!(p[0].ends_with("last failure: NOPERM again"), "{p:?}");
        b.wake_subscribed(url);
        assert!(b.problems(STUCK).is_empty());
    }

    #[test]
    fn a_leased_shard_no_worker_runs_is_reported() {
        let b = HealthBoard::default();
        b.set_leased([0, 1]);
        b.update(0, |h| h.status = ShardStatus::Running);
        // just leased: its worker is about to start
        assert!(b.problems(STUCK).is_empty());
        b.leased.lock().unwrap().insert(1, long_ago());
        // still leased: it keeps the time it was first leased
        b.set_leased([0, 1]);
        let p = b.problems(STUCK);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].starts_with("shard 1: not materialized: leased by this node"),
            "{p:?}"
        );
        // its worker runs it
        b.update(1, |h| h.status = ShardStatus::Running);
        assert!(b.problems(STUCK).is_empty());
        // no longer leased, no longer run
        b.forget(1);
        b.set_leased([0]);
        assert!(b.problems(STUCK).is_empty());
    }
}
