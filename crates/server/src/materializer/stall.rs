//! Whether each mailbox instance answers (ADR-0129): a worker's calls to one mailbox instance
//! wait a bounded time, and an instance that did not answer in time is left alone for a while.
//!
//! A worker's loop is one task that calls its mailbox instances one after another: the owner
//! marks, the resyncs of shards in retry, the step's writes, the wake hints, the GC. A call
//! waited for the connection's response timeout (30 s), so one instance that does not answer
//! (SIGSTOP, a host gone without a reset: its connection stays open) held up the shards of
//! every other instance of the worker for that long, again and again. Now:
//!
//! - each call waits at most [`MAILBOX_CALL_TIMEOUT`] (a read, a mark, a hint, a GC call, a
//!   resync), a step's writes (a hot-path pipeline, one shard's chunked round) that plus
//!   [`MAILBOX_ENTRY_TIME`] per mailbox entry written ([`step_bound`]);
//! - an instance whose call timed out is *stalled*: its calls are skipped (its shards retry,
//!   its hints wait, its marks and GC are left) for a backoff doubling from [`STALL_MIN`] to
//!   [`STALL_MAX`]; then one probe (a read of one key), bounded by [`MAILBOX_CALL_TIMEOUT`], says whether it
//!   answers again before anything else is sent to it. A hung instance then costs the loop at
//!   most one short wait per backoff;
//! - a write that timed out has an unknown outcome: its shards go through their retry, which
//!   re-reads W (never taken as applied).
//!
//! The connection is kept: a hung server answers in order once it resumes, a dead one's
//! connection fails by itself. A Redis Cluster is not tracked here: one node's hang is not the
//! cluster's, and the store bounds a cluster's calls per node.

use std::future::Future;
use std::time::{Duration, Instant};

use tidemark_store::redis::store::MailboxStore;

use super::Error;

/// Longest wait for one call of a worker to a mailbox instance outside a step's writes: the
/// owner marks, a wake hint publish, a GC call, a resync (its reads and claims), a claim at the
/// start, and the probe of a stalled instance. Such a call answers in milliseconds.
pub(super) const MAILBOX_CALL_TIMEOUT: Duration = Duration::from_secs(1);

/// What each mailbox entry a step writes adds to its bound ([`step_bound`]): about three times
/// what one costs a mailbox instance that writes everything to disk in a catch-up
/// (`appendfsync always`: 6–10 µs an entry, `docs/perf/catchup-always.json`,
/// `catchup-many-recipients.json`).
pub(super) const MAILBOX_ENTRY_TIME: Duration = Duration::from_micros(20);

/// Longest wait for a step's writes of `entries` mailbox entries to one mailbox instance (its
/// hot-path pipeline, or one shard's chunked round): [`MAILBOX_CALL_TIMEOUT`] plus
/// [`MAILBOX_ENTRY_TIME`] for each. A live step (a few entries) waits about a second for an
/// instance that hangs; a catch-up's pipeline (up to 512 records of each shard, of up to 128
/// recipients) gets the time it needs. One that takes longer still is only retried from W:
/// Redis runs it all the same, and the retry finds its records applied.
pub(super) fn step_bound(entries: usize) -> Duration {
    MAILBOX_CALL_TIMEOUT
        + MAILBOX_ENTRY_TIME.saturating_mul(u32::try_from(entries).unwrap_or(u32::MAX))
}

/// How long an instance is left alone after its first call that timed out.
pub(super) const STALL_MIN: Duration = Duration::from_secs(1);

/// Longest an instance is left alone before it is probed again (the backoff doubles up to
/// this): bounds how late the shards of an instance that resumed notice it.
pub(super) const STALL_MAX: Duration = Duration::from_secs(5);

/// Every mailbox instance of a worker, by number.
pub(super) struct Stalls {
    instances: Vec<Instance>,
}

/// One mailbox instance.
struct Instance {
    /// Its store (sharing the worker's connection), for the probe; `None`: a Redis Cluster,
    /// not tracked (see the module documentation).
    probe: Option<MailboxStore>,
    /// Its URL without a password, for logs and `/healthz`.
    shown: String,
    /// Until when its calls are skipped; past it, the next call is preceded by a probe.
    /// `None`: it is called.
    until: Option<Instant>,
    /// The last stall's length; zero once a call has answered in time since.
    backoff: Duration,
    /// Whether the worker last showed the instance as not answering (on its shards' health).
    shown_hung: bool,
}

impl Stalls {
    /// Every instance answering. `urls`: the map's mailbox URLs, by instance.
    pub(super) fn new(mailboxes: &[MailboxStore], urls: &[String]) -> Stalls {
        let instances = mailboxes
            .iter()
            .enumerate()
            .map(|(i, mb)| Instance {
                probe: (!mb.connection().is_cluster()).then(|| mb.clone()),
                shown: urls
                    .get(i)
                    .map_or_else(|| format!("#{i}"), |u| tidemark_store::redact_url(u)),
                until: None,
                backoff: Duration::ZERO,
                shown_hung: false,
            })
            .collect();
        Stalls { instances }
    }

    /// Whether calls to instance `mb` are skipped at `now` (its stall has not passed).
    pub(super) fn stalled(&self, mb: usize, now: Instant) -> bool {
        self.instances
            .get(mb)
            .and_then(|i| i.until)
            .is_some_and(|t| now < t)
    }

    /// Whether instance `mb` may be called now. False while it is stalled; once the stall has
    /// passed, a probe bounded by [`MAILBOX_CALL_TIMEOUT`] says whether it answers again (if
    /// not, it is stalled again, for longer). The probe reads one key (the owner mark of shard
    /// 0, whatever it holds): the store has no `PING`, and any answer will do.
    pub(super) async fn ready(&mut self, mb: usize) -> bool {
        let Some(inst) = self.instances.get_mut(mb) else {
            return true;
        };
        let Some(until) = inst.until else {
            return true;
        };
        if Instant::now() < until {
            return false;
        }
        let Some(store) = inst.probe.as_ref() else {
            return true;
        };
        match tokio::time::timeout(MAILBOX_CALL_TIMEOUT, store.live_owner(0)).await {
            // any answer, an error too (a refused connection): it is not hung
            Ok(_) => {
                inst.until = None;
                true
            }
            Err(_) => {
                self.timed_out(mb);
                false
            }
        }
    }

    /// The bound of a call to instance `mb` (`bound`; `None`: a cluster, not bounded here).
    pub(super) fn limit(&self, mb: usize, bound: Duration) -> Option<Duration> {
        self.instances
            .get(mb)
            .and_then(|i| i.probe.as_ref())
            .map(|_| bound)
    }

    /// A call to instance `mb` did not answer within its bound: stalled, for twice as long as
    /// the last time (from [`STALL_MIN`], up to [`STALL_MAX`]).
    pub(super) fn timed_out(&mut self, mb: usize) {
        let Some(inst) = self.instances.get_mut(mb) else {
            return;
        };
        let first = inst.backoff.is_zero();
        inst.backoff = if first {
            STALL_MIN
        } else {
            (inst.backoff * 2).min(STALL_MAX)
        };
        inst.until = Some(Instant::now() + inst.backoff);
        metrics::counter!("tidemark_errors_total", "code" => "mailbox_stalled").increment(1);
        if first {
            tracing::warn!(
                mailbox = %inst.shown,
                "mailbox instance does not answer; its shards wait, the others go on"
            );
        } else {
            tracing::debug!(mailbox = %inst.shown, backoff = ?inst.backoff,
                "mailbox instance still does not answer");
        }
    }

    /// A call to instance `mb` answered within its bound (with a reply or an error): it is
    /// no longer stalled. Nothing changes while a stall set meanwhile lasts (a call inside
    /// this one timed out).
    pub(super) fn answered(&mut self, mb: usize) {
        let Some(inst) = self.instances.get_mut(mb) else {
            return;
        };
        if inst.until.is_some() || inst.backoff.is_zero() {
            return;
        }
        inst.backoff = Duration::ZERO;
        tracing::info!(mailbox = %inst.shown, "mailbox instance answers again");
    }

    /// The instances that stopped or started answering since the last call, each with whether
    /// it answers now: the worker shows it on their shards' health (a quiet shard of a hung
    /// instance is in no retry, and would look healthy). An instance answers again once a call
    /// has answered in time after its probe.
    pub(super) fn changes(&mut self) -> Vec<(usize, bool)> {
        let mut out = Vec::new();
        for (mb, inst) in self.instances.iter_mut().enumerate() {
            let hung = !inst.backoff.is_zero();
            if hung != inst.shown_hung {
                inst.shown_hung = hung;
                out.push((mb, !hung));
            }
        }
        out
    }

    /// The error of a call to instance `mb` that was skipped or timed out.
    pub(super) fn error(&self, mb: usize) -> Error {
        Error::MailboxStalled {
            mailbox: self
                .instances
                .get(mb)
                .map_or_else(|| format!("#{mb}"), |i| i.shown.clone()),
        }
    }

    /// `call` to instance `mb`, bounded by `bound`: its output, or `None` when the instance is
    /// stalled (`call` is then never polled) or did not answer in time (its outcome unknown).
    pub(super) async fn within<F: Future>(
        &mut self,
        mb: usize,
        bound: Duration,
        call: F,
    ) -> Option<F::Output> {
        if !self.ready(mb).await {
            return None;
        }
        match bounded(self.limit(mb, bound), call).await {
            Some(out) => {
                self.answered(mb);
                Some(out)
            }
            None => {
                self.timed_out(mb);
                None
            }
        }
    }
}

/// `call`'s output, or `None` once `limit` has passed (`None`: no limit).
pub(super) async fn bounded<F: Future>(limit: Option<Duration>, call: F) -> Option<F::Output> {
    match limit {
        Some(d) => tokio::time::timeout(d, call).await.ok(),
        None => Some(call.await),
    }
}
