//! The state a run's tasks share: the one clock every latency is measured on (message `i`
//! is intended at `t0 + i / rate`), the HDR histograms of e2e and SEND_ACK latency (µs), the
//! delivery, ack and error counters, and [`Acks`], which tells acks that arrived while
//! sending from those of the drain grace.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::time::Instant;

use crate::load::{bump, LoadOptions};

/// Highest latency a histogram holds (µs); larger values are clamped to it.
const HIST_MAX_US: u64 = 3_600_000_000;

/// The `send_ack`s of a run: all of them, and those that arrived while sending.
#[derive(Debug)]
pub(super) struct Acks {
    /// End of sending: `t0 + duration`.
    end_of_sending: Instant,
    /// Every ack that arrived in the window (drain grace included).
    total: AtomicU64,
    /// Acks that arrived by `end_of_sending`.
    while_sending: AtomicU64,
}

impl Acks {
    pub(super) fn new(end_of_sending: Instant) -> Self {
        Acks {
            end_of_sending,
            total: AtomicU64::new(0),
            while_sending: AtomicU64::new(0),
        }
    }

    /// An ack arrived at `at`.
    pub(super) fn arrived(&self, at: Instant) {
        self.total.fetch_add(1, Ordering::Relaxed);
        if at <= self.end_of_sending {
            self.while_sending.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// `(send_acked, send_acked_while_sending, acked_per_s_while_sending)` of a run that sent
    /// for `duration_s`: the rate counts only the acks that arrived while sending.
    pub(super) fn report(&self, duration_s: f64) -> (u64, u64, f64) {
        let while_sending = self.while_sending.load(Ordering::Relaxed);
        (
            self.total(),
            while_sending,
            while_sending as f64 / duration_s,
        )
    }
}

/// State shared by the scheduler, the ack waiters and the receivers.
pub(super) struct Shared {
    t0: Instant,
    rate: f64,
    /// Messages the run sends.
    pub(super) total: u64,
    /// End of the window: `t0 + duration + drain_grace`.
    pub(super) deadline: Instant,
    pub(super) acks: Acks,
    pub(super) delivered: AtomicU64,
    /// Sends queued and not answered yet (no `send_ack`, no `error` with their id); what is
    /// left at the end of the window timed out.
    pub(super) outstanding: AtomicU64,
    /// The same, per client (the sender): a connection that closes fails its own.
    pending: Vec<AtomicU64>,
    pub(super) e2e: Mutex<Histogram<u64>>,
    /// The e2e latencies again, one histogram per second of intended send time (the
    /// timeline: when in the run the slow deliveries were sent).
    pub(super) e2e_by_second: Vec<Mutex<Histogram<u64>>>,
    pub(super) send_ack: Mutex<Histogram<u64>>,
    pub(super) errors: Mutex<BTreeMap<String, u64>>,
    /// Set when the run is over: a connection closing now is not an error.
    pub(super) stopping: AtomicBool,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// The state of a run of `total` messages whose first is intended at `t0`.
    pub(super) fn new(t0: Instant, opts: &LoadOptions, total: u64) -> Self {
        Shared {
            t0,
            rate: opts.rate,
            total,
            deadline: t0 + opts.duration + opts.drain_grace,
            acks: Acks::new(t0 + opts.duration),
            delivered: AtomicU64::new(0),
            outstanding: AtomicU64::new(0),
            pending: (0..opts.clients).map(|_| AtomicU64::new(0)).collect(),
            e2e: Mutex::new(new_histogram()),
            e2e_by_second: (0..opts.duration.as_secs_f64().ceil().max(1.0) as usize)
                .map(|_| Mutex::new(coarse_histogram()))
                .collect(),
            send_ack: Mutex::new(new_histogram()),
            errors: Mutex::new(BTreeMap::new()),
            stopping: AtomicBool::new(false),
        }
    }

    /// The intended send time of message `i` (the one clock every latency is measured on).
    pub(super) fn intended(&self, i: u64) -> Instant {
        self.t0 + Duration::from_secs_f64(i as f64 / self.rate)
    }

    /// Records the e2e latency `d` of message `i`, in the whole run's histogram and in its
    /// second's.
    pub(super) fn record_e2e(&self, i: u64, d: Duration) {
        record(&self.e2e, d);
        let second = (i as f64 / self.rate) as usize;
        if let Some(h) = self.e2e_by_second.get(second) {
            record(h, d);
        }
    }

    /// The index of a message of this run from its send id (`m<index>`).
    pub(super) fn message_of(&self, id: &str) -> Option<u64> {
        id.strip_prefix('m')?
            .parse::<u64>()
            .ok()
            .filter(|&i| i < self.total)
    }

    /// A send of `client` is about to be queued (counted before it is, so that its answer
    /// can never be counted first).
    pub(super) fn queued(&self, client: usize) {
        self.pending[client].fetch_add(1, Ordering::Relaxed);
        self.outstanding.fetch_add(1, Ordering::Relaxed);
    }

    /// A send of `client` was answered (`send_ack` or `error`), or could not be queued.
    pub(super) fn answered(&self, client: usize) {
        // never below 0: a connection that closed has already given up its sends
        let take = |n: &AtomicU64| {
            n.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
                .is_ok()
        };
        if take(&self.pending[client]) {
            self.outstanding.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// `client`'s connection closed: its unanswered sends will never be answered. Returns
    /// how many there were.
    pub(super) fn closed(&self, client: usize) -> u64 {
        let lost = self.pending[client].swap(0, Ordering::Relaxed);
        self.outstanding.fetch_sub(lost, Ordering::Relaxed);
        lost
    }

    /// Counts one error of `code`.
    pub(super) fn error(&self, code: &str) {
        bump(&mut lock(&self.errors), code, 1);
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("valid histogram bounds")
}

/// Two significant digits: a second's P99 and maximum, at a tenth of the memory.
fn coarse_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 2).expect("valid histogram bounds")
}

/// Records one latency (clamped to 1 µs ..= [`HIST_MAX_US`]).
pub(super) fn record(h: &Mutex<Histogram<u64>>, d: Duration) {
    let us = (d.as_micros().min(u128::from(HIST_MAX_US)) as u64).max(1);
    lock(h).saturating_record(us);
}
