//! Per-shard state of a worker ([`OwnedShard`]) and its transitions: stop (fenced, corrupt),
//! retry after a failure (capped backoff), and holds (an empty lane, a log discontinuity).

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use super::chunked::Pending;
use super::worker::Worker;
use super::{DISCONTINUITY_RECHECK, LOG_REMINDER, RETRY_MAX, RETRY_MIN};
use crate::health::ShardStatus;

/// What [`Worker::scan`] found on every owned shard at the top of a step.
pub(super) struct StepScan {
    /// Running shards whose retry is due: resynced before the step reads.
    pub(super) due: Vec<u32>,
    /// Running shards whose lease gate is open (read, or waiting for their retry), for the
    /// health board; empty unless asked for.
    pub(super) served: Vec<u32>,
    /// The shards read now and where from: running, gate open, not waiting for a retry.
    /// In shard order (the owned shards are kept in shard order, ADR-0078).
    pub(super) positions: Vec<(u32, u64)>,
    /// Some running shard's lease gate is closed (it opens again by itself: look soon).
    pub(super) gated: bool,
    /// The earliest retry due among running shards.
    pub(super) next_retry: Option<Instant>,
    /// Some shard has records waiting for the chunked path.
    pub(super) any_pending: bool,
}

pub(super) struct OwnedShard {
    pub(super) shard: u32,
    pub(super) mb: usize,
    pub(super) epoch: u64,
    /// Highest offset read from the log (materialised or pending).
    pub(super) read_pos: u64,
    pub(super) uniform: bool,
    pub(super) pending: VecDeque<Pending>,
    pub(super) stopped: bool,
    /// Set while the shard waits to retry after a failure: it reads nothing until then.
    pub(super) retry: Option<Retry>,
    /// Why the shard is held (an empty lane, a log discontinuity), reported in health and
    /// re-checked periodically; cleared when W moves again.
    pub(super) held: Option<ShardStatus>,
    /// When the current hold or retry was last logged (one line per state change, then a
    /// reminder every [`LOG_REMINDER`]).
    pub(super) last_logged: Option<Instant>,
    /// Recipients that got entries since the last published wake hint.
    pub(super) touched: BTreeSet<String>,
    /// A wake hint is due: W moved, the shard was just claimed, or the last hint could not
    /// be published.
    pub(super) moved: bool,
    /// The number of the shard's next wake hint (ADR-0035): 0 is the hint of the claim.
    pub(super) hint_seq: u64,
    /// Since the last published hint, something was due that this process's connections were
    /// not handed as a local run (a replay, the chunked path, the claim, a failed publish): the
    /// hint goes out with this step. Otherwise it may wait for its instance's next flush
    /// (ADR-0047).
    pub(super) unhanded: bool,
    /// The last GC found the shard caught up with nothing pending, and nothing happened since:
    /// it is collected every `gc_idle_interval` instead of every `gc_interval`.
    pub(super) quiet: bool,
    pub(super) min_w: u64,
    pub(super) last_gc: Instant,
    /// Since when every read of the watermark has found it missing (ADR-0058): it is created
    /// again only once that has lasted [`super::WATERMARK_LOST_AFTER`], never on one read
    /// (a read that met a node with a stale role, such as a restarted primary that has not
    /// yet learnt it was replaced, finds nothing for a moment).
    pub(super) missing_since: Option<Instant>,
    /// The W the hint pass last gave the health board, and whether that pass deferred the
    /// shard's hint to the flush (ADR-0047): a moved shard stays moved over the steps its hint
    /// waits, and on those where it did not move again (the same W, nothing unhanded) its
    /// health is not updated again (ADR-0077).
    pub(super) shown_w: Option<u64>,
    pub(super) deferred: bool,
    /// Since when the chunked path's rounds have held a lane without the shard's lowest W
    /// rising, and that W (ADR-0112, ADR-0119): past [`super::chunked::REWRITE_HELD_AFTER`],
    /// the chunks marked written are written again, in case the instance lost them (a
    /// failover to a replica that had not received them), and this starts over. Moves of
    /// other lanes do not restart it: while the shard keeps receiving, some lane moves on
    /// nearly every round.
    pub(super) held_since: Option<(Instant, u64)>,
    /// The epoch a re-fence of a watermark gone back asked for (ADR-0100) while no answer has
    /// said it is ours (its reply lost, the connection cut by the same failover): the stored
    /// epoch may be it, written by us, and is then no sign of another owner (ADR-0120).
    /// [`Worker::stop`] waits for the resync instead of stopping the shard as fenced by it,
    /// and the resync fences past it. Cleared once a re-fence is answered or our own epoch
    /// is read back.
    pub(super) refencing: Option<u64>,
}

impl OwnedShard {
    /// A shard this worker does not run (its watermark was corrupt at start).
    pub(super) fn stopped(shard: u32, mb: usize) -> OwnedShard {
        OwnedShard {
            shard,
            mb,
            epoch: 0,
            read_pos: 0,
            uniform: false,
            pending: VecDeque::new(),
            stopped: true,
            retry: None,
            held: None,
            last_logged: None,
            touched: BTreeSet::new(),
            moved: false,
            hint_seq: 0,
            unhanded: false,
            quiet: false,
            min_w: 0,
            last_gc: Instant::now(),
            missing_since: None,
            shown_w: None,
            deferred: false,
            held_since: None,
            refencing: None,
        }
    }
}

/// A shard's retry after a failure.
#[derive(Debug, Clone, Copy)]
pub(super) struct Retry {
    /// When the next attempt is due.
    pub(super) due: Instant,
    /// The delay that led to `due` (doubles on each failure, up to [`RETRY_MAX`]).
    pub(super) backoff: Duration,
    /// A failure (reported as `retrying` in health) rather than a periodic re-check.
    pub(super) failure: bool,
}

impl Worker {
    /// The state of shard `s`, which this worker owns (every caller got `s` from the worker's
    /// own shards).
    pub(super) fn shard_mut(&mut self, s: u32) -> &mut OwnedShard {
        self.owned.get_mut(&s).expect("a shard this worker owns")
    }

    pub(super) fn stop(&mut self, shard: u32, status: ShardStatus) {
        if let ShardStatus::Fenced {
            current_epoch: Some(e),
        } = status
        {
            if self.owned.get(&shard).is_some_and(|sh| e < sh.epoch) {
                // not a newer owner: the stored epoch went backwards (see `resync`)
                self.schedule_retry(shard, &format!("watermark epoch went back to {e}"));
                return;
            }
            if let Some(sh) = self.owned.get(&shard) {
                if sh.refencing == Some(e) {
                    // maybe our own re-fence, whose answer was lost (ADR-0120): the resync
                    // finds out and fences past it. A retry already waiting is left to run
                    // when due (GC meets this on every interval: scheduled again each time,
                    // the retry would be pushed back for ever).
                    if sh.retry.is_none() {
                        self.schedule_retry(shard, &format!("re-fence to epoch {e} unanswered"));
                    }
                    return;
                }
            }
        }
        if let Some(sh) = self.owned.get_mut(&shard) {
            sh.stopped = true;
            sh.retry = None;
            sh.pending.clear();
        }
        tracing::error!(shard, ?status, "shard stopped");
        match &status {
            ShardStatus::Fenced { .. } => {
                metrics::counter!("tidemark_shard_fenced_total").increment(1)
            }
            ShardStatus::Corrupt(_) => {
                metrics::counter!("tidemark_shard_corrupt_total").increment(1)
            }
            _ => {}
        }
        self.health.update(shard, |h| {
            h.status = status;
            h.retrying = None;
        });
    }

    /// Puts `shard` in retry after `why`: its records in memory are dropped and, after the
    /// backoff, it re-reads its watermark and resumes from its lowest W.
    pub(super) fn schedule_retry(&mut self, shard: u32, why: &str) {
        // the shard is read again from W: a log trim queued for it (ADR-0088) goes, as the W it
        // was queued at may no longer be the mailbox side's (a W gone backwards, a watermark
        // lost); its next GC queues one from the W then confirmed
        self.trims.retain(|t| t.0 != shard);
        let Some(sh) = self.owned.get_mut(&shard) else {
            return;
        };
        if sh.stopped {
            return;
        }
        let backoff = sh
            .retry
            .map_or(RETRY_MIN, |r| (r.backoff * 2).min(RETRY_MAX));
        sh.retry = Some(Retry {
            due: Instant::now() + backoff,
            backoff,
            failure: true,
        });
        sh.pending.clear();
        self.health.set_retrying(shard, why);
    }

    /// One look at every owned shard at the top of a step (ADR-0077): what the loop needs
    /// from all of them, gathered in one pass where four passes gathered it before (the
    /// retries due, the shards read and where from, the earliest retry, whether any records
    /// wait for the chunked path). Every owned shard is still looked at on every step.
    /// `served`: whether the health board's list of served shards is wanted (it is sent at
    /// most every `SERVED_EVERY`).
    pub(super) fn scan(&self, now: Instant, served: bool) -> StepScan {
        let gate = self.opts.lease_gate.as_ref();
        let mut scan = StepScan {
            due: Vec::new(),
            served: Vec::with_capacity(if served { self.owned.len() } else { 0 }),
            positions: Vec::with_capacity(self.owned.len()),
            gated: false,
            next_retry: None,
            any_pending: false,
        };
        for sh in self.owned.values() {
            scan.any_pending |= !sh.pending.is_empty();
            if sh.stopped {
                continue;
            }
            if let Some(r) = sh.retry {
                if r.due <= now {
                    scan.due.push(sh.shard);
                }
                scan.next_retry = Some(scan.next_retry.map_or(r.due, |d: Instant| d.min(r.due)));
            }
            // One look at each running shard's lease gate (leases mode, see ownership.rs):
            // the shards whose lease is still ours are read (unless waiting for a retry), the
            // others looked at again soon. Two looks could disagree — a gate closed at the
            // first that the lease loop re-opened before the second — and leave the worker
            // waiting for a stop that never comes while the shard stays leased here.
            if gate.is_some_and(|g| !g.may_write(sh.shard)) {
                scan.gated = true;
                continue;
            }
            if served {
                scan.served.push(sh.shard);
            }
            if sh.retry.is_none() {
                scan.positions.push((sh.shard, sh.read_pos));
            }
        }
        scan
    }

    /// Runs the resync of each shard in `due` (their retry is due); a failed resync backs off
    /// further.
    pub(super) async fn resync_due(&mut self, due: Vec<u32>) {
        for s in due {
            match self.resync(s).await {
                Ok(()) => {
                    let sh = self.shard_mut(s);
                    if sh.stopped {
                        continue;
                    }
                    if !sh.retry.take().is_some_and(|r| r.failure) {
                        continue;
                    }
                    tracing::info!(shard = s, w = sh.min_w, "shard resumed after a failure");
                    metrics::counter!("tidemark_shard_recoveries_total").increment(1);
                    self.health.update(s, |h| {
                        h.retrying = None;
                        h.last_progress = Instant::now();
                    });
                }
                Err(e) => {
                    tracing::warn!(shard = s, error = %e, "resync failed; retrying");
                    self.schedule_retry(s, &e.to_string());
                }
            }
        }
    }

    /// Holds shard `s` for `why` (an empty lane, a log discontinuity): its records in memory
    /// are dropped and it re-reads from W after `recheck`, until W moves again. Logged and
    /// counted once per change of reason, with a reminder every [`LOG_REMINDER`].
    pub(super) fn hold(&mut self, s: u32, why: ShardStatus, recheck: Duration) {
        let Some(sh) = self.owned.get_mut(&s) else {
            return;
        };
        let changed = sh.held.as_ref() != Some(&why);
        let remind = sh.last_logged.is_none_or(|t| t.elapsed() >= LOG_REMINDER);
        if changed {
            match &why {
                ShardStatus::LaneEmpty { lane, offset } => {
                    tracing::error!(shard = s, lane, offset, "record needs an empty lane; held");
                    metrics::counter!("tidemark_lane_empty_holds_total").increment(1);
                }
                ShardStatus::Discontinuity { w, next } => {
                    tracing::error!(shard = s, w, ?next, "log discontinuity; shard held");
                    metrics::counter!("tidemark_log_discontinuities_total").increment(1);
                }
                _ => {}
            }
            sh.last_logged = Some(Instant::now());
        } else if remind {
            tracing::warn!(shard = s, status = ?why, "shard still held");
            sh.last_logged = Some(Instant::now());
        }
        sh.held = Some(why.clone());
        sh.retry = Some(Retry {
            due: Instant::now() + recheck,
            backoff: recheck,
            failure: false,
        });
        sh.pending.clear();
        let min_w = sh.min_w;
        self.health.update(s, |h| {
            h.status = why;
            h.min_w = min_w;
        });
    }

    /// The log holds no record `w + 1` (its next record is `next`).
    pub(super) fn hold_discontinuity(&mut self, s: u32, w: u64, next: Option<u64>) {
        self.hold(
            s,
            ShardStatus::Discontinuity { w, next },
            DISCONTINUITY_RECHECK,
        );
    }

    /// A held shard's W moved again (the lane was initialised, the log continues): running.
    pub(super) fn clear_held(&mut self, s: u32) {
        if let Some(sh) = self.owned.get_mut(&s) {
            if sh.held.take().is_some() {
                sh.last_logged = None;
                tracing::info!(shard = s, "held shard moves again; running");
                self.health.update(s, |h| h.status = ShardStatus::Running);
            }
        }
    }
}
