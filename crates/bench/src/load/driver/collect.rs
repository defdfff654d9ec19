//! What a run measured, gathered into its [`RunReport`]: the server-side samples of every
//! Redis instance (`INFO` at `t0`, at the end of sending and at the end of the window: A, B
//! and C), of every remote gateway process (its `/metrics`) and of this process
//! (`/proc/self`); their per-instance, per-process and per-pool deltas (CPU % and ops/s over
//! A→B, µs per `EVALSHA`, CPU per message and commands per message over A→C), the
//! client-side latency percentiles and curves, and the error counts. A reading that failed
//! after its retries leaves the figures that need it `None` and is listed in
//! [`RunReport::unread`].

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::join_all;
use hdrhistogram::Histogram;

use super::shared::{lock, Shared};
use super::Setup;
use crate::load::info::{CmdCounter, Delta, ReadPolicy, Sample, Watched};
use crate::load::procs::{self_sample, MetricsSource, ProcSample};
use crate::load::report::{
    CommandStats, InstanceStats, Percentiles, PoolPair, ProcessStats, RunReport, SecondLatency,
    CURVE_PERCENTILES,
};
use crate::load::{bump, Error, LoadOptions};

/// Connects to every Redis instance of the deployment, mailbox pool first; a bad URL (or an
/// instance that cannot be reached after every retry) fails here, before any client
/// connects.
pub(super) async fn watch_all(setup: &Setup, policy: ReadPolicy) -> Result<Vec<Watched>, Error> {
    let mut watched = Vec::new();
    for (i, url) in setup.mailbox_urls.iter().enumerate() {
        watched.push(Watched::connect("mailbox", i, url, policy).await?);
    }
    for (i, url) in setup.core_urls.iter().enumerate() {
        watched.push(Watched::connect("core", i, url, policy).await?);
    }
    Ok(watched)
}

/// The gateway processes whose `/metrics` are read (none when the deployment runs in this
/// process); a URL that does not parse fails here.
pub(super) fn servers(setup: &Setup, policy: ReadPolicy) -> Result<Vec<MetricsSource>, Error> {
    setup
        .metrics_urls
        .iter()
        .map(|u| MetricsSource::new(u, policy))
        .collect()
}

/// Everything read at one sampling point.
pub(super) struct Point {
    /// Every watched Redis instance, in order; `Err`: why it was not read.
    redis: Vec<Result<Sample, String>>,
    /// Every gateway process, in order.
    servers: Vec<Result<ProcSample, String>>,
    /// This process.
    me: ProcSample,
}

/// One sample of every watched instance and gateway, and of this process; every read is
/// retried per its policy, and one that still fails is kept as its reason.
pub(super) async fn sample_point(watched: &mut [Watched], servers: &[MetricsSource]) -> Point {
    let me = self_sample();
    let (redis, servers) = tokio::join!(
        join_all(watched.iter_mut().map(Watched::sample)),
        join_all(servers.iter().map(MetricsSource::sample)),
    );
    Point { redis, servers, me }
}

/// The samples of a run: at `t0` (A), at the end of sending (B), at the end of the window (C).
pub(super) struct Samples {
    pub(super) a: Point,
    pub(super) b: Point,
    pub(super) c: Point,
}

const POINTS: [&str; 3] = ["A (start)", "B (end of sending)", "C (end of window)"];

/// The delta between two readings, when both were read.
fn between(a: &Result<Sample, String>, b: &Result<Sample, String>) -> Option<Delta> {
    Some(Delta::between(a.as_ref().ok()?, b.as_ref().ok()?))
}

/// `x × 10⁶ / n` (µs per message), `None` without messages.
fn per_msg_us(x: f64, n: u64) -> Option<f64> {
    (n > 0).then(|| x * 1e6 / n as f64)
}

/// A process's figures from its readings at A, B and C.
fn process(
    (name, role, source): (String, &str, String),
    [a, b, c]: [Option<ProcSample>; 3],
    sent: u64,
) -> ProcessStats {
    let cpu = |x: Option<ProcSample>| x.and_then(|s| s.cpu_s);
    let cpu_s = cpu(a).zip(cpu(c)).map(|(a, c)| (c - a).max(0.0));
    let cpu_pct = a.zip(b).and_then(|(a, b)| {
        let wall = b.at.saturating_duration_since(a.at).as_secs_f64();
        let d = (b.cpu_s? - a.cpu_s?).max(0.0);
        (wall > 0.0).then(|| d / wall * 100.0)
    });
    ProcessStats {
        name,
        role: role.to_owned(),
        source,
        cpu_s,
        cpu_us_per_msg: cpu_s.and_then(|s| per_msg_us(s, sent)),
        cpu_pct,
        rss_bytes: c.and_then(|c| c.rss_bytes),
    }
}

/// Calls per message and µs per call of each command.
fn command_stats(
    counters: &BTreeMap<String, CmdCounter>,
    sent: u64,
) -> BTreeMap<String, CommandStats> {
    counters
        .iter()
        .map(|(name, c)| {
            (
                name.clone(),
                CommandStats {
                    calls: c.calls,
                    per_msg: if sent > 0 {
                        c.calls as f64 / sent as f64
                    } else {
                        0.0
                    },
                    us_per_call: if c.calls > 0 {
                        c.usec as f64 / c.calls as f64
                    } else {
                        0.0
                    },
                },
            )
        })
        .collect()
}

/// The report of a finished run: `shared` holds what the clients measured, `samples` what
/// the servers did, `max_lag` how late the scheduler sent at worst.
pub(super) fn run_report(
    opts: &LoadOptions,
    setup: &Setup,
    shared: &Shared,
    watched: &[Watched],
    servers: &[MetricsSource],
    samples: &Samples,
    max_lag: Duration,
) -> RunReport {
    let Samples { a, b, c } = samples;
    let total = shared.total;
    let expected = total * opts.fanout as u64;
    let mut errors = lock(&shared.errors).clone();
    // Sends neither acked nor refused in the window.
    bump(
        &mut errors,
        "timeout",
        shared.outstanding.load(Ordering::Relaxed),
    );
    let delivered = shared.delivered.load(Ordering::Relaxed);
    let e2e = lock(&shared.e2e).clone();
    let send_ack = lock(&shared.send_ack).clone();
    let e2e_timeline = shared
        .e2e_by_second
        .iter()
        .map(|h| second_latency(&lock(h)))
        .collect();
    let duration_s = opts.duration.as_secs_f64();
    let (acked, acked_while_sending, acked_per_s_while_sending) = shared.acks.report(duration_s);

    // What could not be read.
    let mut unread = Vec::new();
    for (point, at) in [a, b, c].into_iter().zip(POINTS) {
        for (w, r) in watched.iter().zip(&point.redis) {
            if let Err(why) = r {
                unread.push(format!("{} {}: {why}, at {at}", w.pool, w.index));
            }
        }
        for r in &point.servers {
            if let Err(why) = r {
                unread.push(format!("server {why}, at {at}"));
            }
        }
    }

    // Server side: Redis.
    let mut per_instance = Vec::new();
    let mut pools: BTreeMap<&str, PoolAcc> = BTreeMap::new();
    for (i, w) in watched.iter().enumerate() {
        let loaded = between(&a.redis[i], &b.redis[i]);
        let whole = between(&a.redis[i], &c.redis[i]);
        let acc = pools.entry(w.pool).or_default();
        acc.add(loaded.as_ref(), whole.as_ref());
        per_instance.push(InstanceStats {
            pool: w.pool.to_owned(),
            index: w.index,
            url: tidemark_store::redact_url(&w.url),
            evalsha_calls: whole.as_ref().map(|d| d.evalsha_calls),
            evalsha_us: whole.as_ref().map(Delta::evalsha_us),
            cpu_pct: loaded.as_ref().map(Delta::cpu_pct),
            ops_per_s: loaded.as_ref().map(Delta::ops_per_s),
            cpu_s: whole.as_ref().map(|d| d.cpu_s),
            cpu_us_per_msg: whole.as_ref().and_then(|d| per_msg_us(d.cpu_s, total)),
            commands: whole.as_ref().map(|d| command_stats(&d.by_command, total)),
        });
    }
    let pool = |name: &str| pools.get(name).cloned().unwrap_or_default();
    let (mb, core) = (pool("mailbox"), pool("core"));
    let redis_commands = pools
        .iter()
        .map(|(name, acc)| {
            (
                (*name).to_owned(),
                acc.whole().map(|w| command_stats(&w.commands, total)),
            )
        })
        .collect();

    // Server side: processes.
    let point_of = |p: &Point| Some(p.me);
    let me = [point_of(a), point_of(b), point_of(c)];
    let mut processes = Vec::new();
    if setup.in_process {
        processes.push(process(
            (
                "generator + server (one process)".into(),
                "generator+server",
                "/proc/self".into(),
            ),
            me,
            total,
        ));
    } else {
        processes.push(process(
            ("generator".into(), "generator", "/proc/self".into()),
            me,
            total,
        ));
        for (k, m) in servers.iter().enumerate() {
            let name = if servers.len() == 1 {
                "server".to_owned()
            } else {
                format!("server {k}")
            };
            let at = |p: &Point| p.servers[k].as_ref().ok().copied();
            processes.push(process(
                (name, "server", m.url.clone()),
                [at(a), at(b), at(c)],
                total,
            ));
        }
    }

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
        e2e_timeline,
        evalsha_us: PoolPair {
            mailbox: mb.whole().map(|w| w.evalsha_us()),
            core: core.whole().map(|w| w.evalsha_us()),
        },
        redis_cpu_pct: PoolPair {
            mailbox: mb.loaded().map(|l| l.cpu_pct()),
            core: core.loaded().map(|l| l.cpu_pct()),
        },
        ops_per_s: PoolPair {
            mailbox: mb.loaded().map(|l| l.ops),
            core: core.loaded().map(|l| l.ops),
        },
        mailbox_cpu_us_per_msg: mb
            .whole()
            .map(|w| per_msg_us(w.cpu_s, delivered).unwrap_or(0.0)),
        max_send_lag_ms: max_lag.as_secs_f64() * 1e3,
        errors,
        per_instance,
        processes,
        redis_commands,
        unread,
    }
}

/// Sums of one pool; a sum is only given when every instance of the pool was read.
#[derive(Debug, Clone, Default)]
struct PoolAcc {
    instances: usize,
    /// Instances read at A and B.
    loaded_read: usize,
    /// Instances read at A and C.
    whole_read: usize,
    loaded: Loaded,
    whole: Whole,
}

/// A→B sums of a pool.
#[derive(Debug, Clone, Copy, Default)]
struct Loaded {
    instances: usize,
    cpu_pct_sum: f64,
    ops: f64,
}

/// A→C sums of a pool.
#[derive(Debug, Clone, Default)]
struct Whole {
    calls: u64,
    usec: u64,
    cpu_s: f64,
    commands: BTreeMap<String, CmdCounter>,
}

impl PoolAcc {
    fn add(&mut self, loaded: Option<&Delta>, whole: Option<&Delta>) {
        self.instances += 1;
        if let Some(l) = loaded {
            self.loaded_read += 1;
            self.loaded.instances += 1;
            self.loaded.cpu_pct_sum += l.cpu_pct();
            self.loaded.ops += l.ops_per_s();
        }
        if let Some(w) = whole {
            self.whole_read += 1;
            self.whole.calls += w.evalsha_calls;
            self.whole.usec += w.evalsha_usec;
            self.whole.cpu_s += w.cpu_s;
            for (name, c) in &w.by_command {
                let sum = self.whole.commands.entry(name.clone()).or_default();
                sum.calls += c.calls;
                sum.usec += c.usec;
            }
        }
    }

    /// The A→B sums, when the pool has instances and every one was read at A and B.
    fn loaded(&self) -> Option<Loaded> {
        (self.instances > 0 && self.loaded_read == self.instances).then_some(self.loaded)
    }

    /// The A→C sums, when the pool has instances and every one was read at A and C.
    fn whole(&self) -> Option<&Whole> {
        (self.instances > 0 && self.whole_read == self.instances).then_some(&self.whole)
    }
}

impl Loaded {
    fn cpu_pct(&self) -> f64 {
        if self.instances > 0 {
            self.cpu_pct_sum / self.instances as f64
        } else {
            0.0
        }
    }
}

impl Whole {
    fn evalsha_us(&self) -> f64 {
        if self.calls > 0 {
            self.usec as f64 / self.calls as f64
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

fn second_latency(h: &Histogram<u64>) -> SecondLatency {
    let p = percentiles(h);
    SecondLatency {
        delivered: h.len(),
        p50: p.p50,
        p99: p.p99,
        max: p.max,
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
