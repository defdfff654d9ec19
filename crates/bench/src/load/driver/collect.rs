//! What a run measured, gathered into its [`RunReport`]: the server-side samples of every
//! Redis instance (`INFO` at `t0`, at the end of sending and at the end of the window: A, B
//! and C), their per-instance and per-pool deltas (CPU % and ops/s over A→B, µs per `EVALSHA`
//! and CPU per message over A→C), the client-side latency percentiles and curves, and the
//! error counts.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::join_all;
use hdrhistogram::Histogram;

use super::shared::{lock, Shared};
use super::Setup;
use crate::load::info::{Delta, Sample, Watched};
use crate::load::report::{InstanceStats, Percentiles, PoolPair, RunReport, CURVE_PERCENTILES};
use crate::load::{bump, Error, LoadOptions};

/// Connects to every Redis instance of the deployment, mailbox pool first; a bad URL fails
/// here, before any client connects.
pub(super) async fn watch_all(setup: &Setup) -> Result<Vec<Watched>, Error> {
    let mut watched = Vec::new();
    for (i, url) in setup.mailbox_urls.iter().enumerate() {
        watched.push(Watched::connect("mailbox", i, url).await?);
    }
    for (i, url) in setup.core_urls.iter().enumerate() {
        watched.push(Watched::connect("core", i, url).await?);
    }
    Ok(watched)
}

/// One sample of every watched instance, in order.
pub(super) async fn sample_all(watched: &mut [Watched]) -> Result<Vec<Sample>, Error> {
    join_all(watched.iter_mut().map(Watched::sample))
        .await
        .into_iter()
        .collect()
}

/// The samples of a run: at `t0` (A), at the end of sending (B), at the end of the window (C).
pub(super) struct Samples {
    pub(super) a: Vec<Sample>,
    pub(super) b: Vec<Sample>,
    pub(super) c: Vec<Sample>,
}

/// The report of a finished run: `shared` holds what the clients measured, `samples` what
/// the servers did, `max_lag` how late the scheduler sent at worst.
pub(super) fn run_report(
    opts: &LoadOptions,
    setup: &Setup,
    shared: &Shared,
    watched: &[Watched],
    samples: &Samples,
    max_lag: Duration,
) -> RunReport {
    let Samples { a, b, c } = samples;
    let total = shared.total;
    let expected = total * opts.fanout as u64;
    let mut errors = lock(&shared.errors).clone();
    bump(
        &mut errors,
        "ack_pending_at_end",
        shared.outstanding.load(Ordering::Relaxed),
    );
    let delivered = shared.delivered.load(Ordering::Relaxed);
    let e2e = lock(&shared.e2e).clone();
    let send_ack = lock(&shared.send_ack).clone();
    let duration_s = opts.duration.as_secs_f64();
    let (acked, acked_while_sending, acked_per_s_while_sending) = shared.acks.report(duration_s);

    // Server side.
    let mut per_instance = Vec::new();
    let mut pools: BTreeMap<&str, PoolAcc> = BTreeMap::new();
    for (i, w) in watched.iter().enumerate() {
        let loaded = Delta::between(&a[i], &b[i]);
        let whole = Delta::between(&a[i], &c[i]);
        let acc = pools.entry(w.pool).or_default();
        acc.instances += 1;
        acc.cpu_pct_sum += loaded.cpu_pct();
        acc.ops += loaded.ops_per_s();
        acc.calls += whole.evalsha_calls;
        acc.usec += whole.evalsha_usec;
        acc.cpu_s += whole.cpu_s;
        per_instance.push(InstanceStats {
            pool: w.pool.to_owned(),
            index: w.index,
            url: tidemark_store::redact_url(&w.url),
            evalsha_calls: whole.evalsha_calls,
            evalsha_us: whole.evalsha_us(),
            cpu_pct: loaded.cpu_pct(),
            ops_per_s: loaded.ops_per_s(),
            cpu_s: whole.cpu_s,
        });
    }
    let pool = |name: &str| pools.get(name).copied().unwrap_or_default();
    let (mb, core) = (pool("mailbox"), pool("core"));

    RunReport {
        layout: setup.layout,
        target: setup.target.to_owned(),
        mailbox_instances: setup.mailbox_urls.len(),
        core_instances: setup.core_urls.len(),
        shards: setup.shards,
        clients: opts.clients,
        rate: opts.rate,
        duration_s,
        fanout: opts.fanout,
        seed: opts.seed,
        sent: total,
        send_acked: acked,
        send_acked_while_sending: Some(acked_while_sending),
        acked_per_s_while_sending: Some(acked_per_s_while_sending),
        delivered,
        expected,
        delivered_in_window_pct: if expected > 0 {
            delivered as f64 / expected as f64 * 100.0
        } else {
            0.0
        },
        e2e_ms: percentiles(&e2e),
        send_ack_ms: percentiles(&send_ack),
        e2e_curve: curve(&e2e),
        send_ack_curve: curve(&send_ack),
        evalsha_us: PoolPair {
            mailbox: mb.evalsha_us(),
            core: core.evalsha_us(),
        },
        redis_cpu_pct: PoolPair {
            mailbox: mb.cpu_pct(),
            core: core.cpu_pct(),
        },
        ops_per_s: PoolPair {
            mailbox: mb.ops,
            core: core.ops,
        },
        mailbox_cpu_us_per_msg: if delivered > 0 {
            mb.cpu_s * 1e6 / delivered as f64
        } else {
            0.0
        },
        max_send_lag_ms: max_lag.as_secs_f64() * 1e3,
        errors,
        per_instance,
    }
}

/// Sums of one pool.
#[derive(Debug, Clone, Copy, Default)]
struct PoolAcc {
    instances: usize,
    cpu_pct_sum: f64,
    ops: f64,
    calls: u64,
    usec: u64,
    cpu_s: f64,
}

impl PoolAcc {
    fn evalsha_us(&self) -> f64 {
        if self.calls > 0 {
            self.usec as f64 / self.calls as f64
        } else {
            0.0
        }
    }

    fn cpu_pct(&self) -> f64 {
        if self.instances > 0 {
            self.cpu_pct_sum / self.instances as f64
        } else {
            0.0
        }
    }
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    if h.is_empty() {
        return Percentiles::default();
    }
    let ms = |us: u64| us as f64 / 1e3;
    Percentiles {
        p50: ms(h.value_at_quantile(0.50)),
        p99: ms(h.value_at_quantile(0.99)),
        p999: ms(h.value_at_quantile(0.999)),
        max: ms(h.max()),
    }
}

fn curve(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    CURVE_PERCENTILES
        .iter()
        .map(|&p| {
            let us = if p >= 100.0 {
                h.max()
            } else {
                h.value_at_quantile(p / 100.0)
            };
            (p, us as f64 / 1e3)
        })
        .collect()
}
