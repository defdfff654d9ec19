//! `tidemark bench commit`: commits per second through the gateway's commit path, without
//! WebSockets (issue 15, "the engine's own ceiling").
//!
//! A fresh local deployment ([`LocalRedis`]; no materializer runs, so the logs only grow) and
//! the gateway's [`CommitPath`] in this process — what a WebSocket or HTTP send calls after
//! admission: the id claimed on the sender's shard, then `commit_dispatch` on each shard the
//! message touches. `senders` tasks play connections: each commits its sends one after
//! another, as a WebSocket connection does (a new id each, `recipients` recipients drawn
//! from 10,000 users by a seeded RNG). With `rate` `None` ("max") each sends its next message
//! as soon as the last one is committed (closed loop); with a rate, the sends are paced to
//! that aggregate rate (a sender that falls behind sends at once).
//!
//! After `warmup`, `INFO` of every instance and this process's CPU time are read; the window
//! lasts `duration`; they are read again. Reported: commits/s overall and per core instance
//! (the shard commits of its shards), the commit latency (P50/P99), Redis CPU per instance
//! (% and µs per commit), commands per commit by command, this process's CPU, and every
//! failed commit by code. Admission (per-user rates, commit permits) is not part of the path
//! measured.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tidemark_server::gateway::CommitPath;
use tidemark_server::health::HealthBoard;
use tidemark_store::redis::dlog::WaitPolicy;
use tidemark_store::redis::watermark::Layout;
use tokio::time::Instant;

use crate::catchup::commands_line;
use crate::engine::{
    bar, bound_per_s, load_avg, or_dash, per_unit, round3, sample_all, thousands, Error,
    InstanceUse, LocalRedis, ProcessMark,
};

/// Users the recipients are drawn from.
const RECIPIENT_POOL: usize = 10_000;

/// What to run.
#[derive(Debug, Clone)]
pub struct CommitOptions {
    /// Aggregate sends per second; `None`: as fast as the senders go (`--rate max`).
    pub rate: Option<f64>,
    /// Measured window.
    pub duration: Duration,
    /// Sending before the window (not measured).
    pub warmup: Duration,
    /// Concurrent senders (connections), each one send at a time.
    pub senders: usize,
    /// Recipients per send.
    pub recipients: usize,
    /// Core Redis instances.
    pub core: usize,
    /// Shards.
    pub shards: u32,
    /// `appendfsync` of every instance.
    pub appendfsync: String,
    /// Body bytes of each send.
    pub body_bytes: usize,
    /// RNG seed of the recipient choice.
    pub seed: u64,
    /// A label kept in the report.
    pub label: Option<String>,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

impl Default for CommitOptions {
    fn default() -> Self {
        CommitOptions {
            rate: None,
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(2),
            senders: 1000,
            recipients: 1,
            core: 1,
            shards: 64,
            appendfsync: "everysec".into(),
            body_bytes: 64,
            seed: 1,
            label: None,
            progress: false,
        }
    }
}

/// One core instance's commits.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CoreCommits {
    /// Index in the core pool.
    pub index: usize,
    /// Shard commits on its shards in the window.
    pub commits: u64,
    /// Per second.
    pub commits_per_s: f64,
    /// Its Redis use over the window, per shard commit.
    pub redis: InstanceUse,
    /// Commits/s this instance would take at 100 % of one core (`1e6 /
    /// redis.cpu_us_per_unit`): its ceiling when nothing else is short (missing when nothing
    /// was measured).
    pub redis_bound_per_s: Option<f64>,
}

/// The result of one commit run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CommitReport {
    /// Always `commit`.
    pub bench: String,
    /// The caller's label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Offered rate (`None`: max).
    pub rate: Option<f64>,
    /// Measured seconds.
    pub duration_s: f64,
    /// Concurrent senders.
    pub senders: usize,
    /// Recipients per send.
    pub recipients: usize,
    /// Core instances.
    pub core: usize,
    /// Shards.
    pub shards: u32,
    /// `appendfsync` of every instance.
    pub appendfsync: String,
    /// Body bytes per send.
    pub body_bytes: usize,
    /// Sends committed in the window.
    pub sends: u64,
    /// Per second.
    pub sends_per_s: f64,
    /// Shard commits in the window (a send touching k shards counts k).
    pub commits: u64,
    /// Per second.
    pub commits_per_s: f64,
    /// Commit latency of a send (its claim and every shard's commit), ms: `p50`, `p99`,
    /// `p999`, `max`; from the send's intended time when paced (`--rate N`: a sender that
    /// fell behind is charged its wait), from its start at `--rate max`. Empty when nothing
    /// was committed in the window.
    pub latency_ms: BTreeMap<String, f64>,
    /// Failed sends by code (whole run).
    pub errors: BTreeMap<String, u64>,
    /// Per core instance.
    pub per_core: Vec<CoreCommits>,
    /// The (idle) mailbox instance, for completeness.
    pub per_mailbox: Vec<InstanceUse>,
    /// CPU seconds of this process in the window.
    pub process_cpu_s: f64,
    /// Its CPU % of one core.
    pub process_cpu_pct: f64,
    /// Its CPU µs per send (missing when nothing was sent).
    pub process_cpu_us_per_send: Option<f64>,
    /// Shard commits per `commit_dispatch` call (group commit): commits / `EVALSHA` calls of
    /// the core pool (missing when there was no call).
    pub commits_per_call: Option<f64>,
    /// The 1-minute load average of the machine at the start and at the end of the window
    /// (missing when `/proc/loadavg` could not be read).
    pub load_avg: [Option<f64>; 2],
}

/// One sender's schedule. Paced (`--rate N`), each sender's share of the rate is a fixed
/// interval, the senders offset from one another; a send's latency counts from its intended
/// time, so that a sender held up by a slow commit is charged the wait (no coordinated
/// omission), and it then sends at once until it is back on schedule. At `--rate max` a send
/// goes as soon as the last one is answered, and its latency counts from then.
struct Pacer {
    /// The next send's intended time (paced).
    next: Instant,
    /// Between one sender's sends (paced); `None` at `--rate max`.
    interval: Option<Duration>,
}

impl Pacer {
    /// Sender `i` of `senders` sharing `rate` sends/s, from `start`.
    fn new(start: Instant, rate: Option<f64>, i: usize, senders: usize) -> Pacer {
        let interval = rate.map(|r| Duration::from_secs_f64(senders as f64 / r));
        let offset = interval.map_or(Duration::ZERO, |iv| iv.mul_f64(i as f64 / senders as f64));
        Pacer {
            next: start + offset,
            interval,
        }
    }

    /// Waits for the next send's turn and returns the time its latency counts from.
    async fn turn(&mut self) -> Instant {
        match self.interval {
            Some(iv) => {
                let intended = self.next;
                tokio::time::sleep_until(intended).await;
                self.next += iv;
                intended
            }
            None => Instant::now(),
        }
    }
}

struct Counters {
    /// Shard commits per core instance, counted while `measuring`.
    per_core: Vec<AtomicU64>,
    sends: AtomicU64,
    measuring: AtomicBool,
    stop: AtomicBool,
    all_sends: AtomicU64,
}

/// Runs one commit benchmark on a fresh local deployment.
pub async fn run_commit(opts: &CommitOptions) -> Result<CommitReport, Error> {
    if opts.senders == 0 || opts.recipients == 0 || opts.recipients > 64 {
        return Err(Error::Invalid(
            "--senders must be at least 1 and --recipients 1..=64".into(),
        ));
    }
    if opts.rate.is_some_and(|r| r.is_nan() || r <= 0.0) {
        return Err(Error::Invalid("--rate must be above 0 or `max`".into()));
    }
    let local = LocalRedis::start(
        opts.core,
        1,
        opts.shards,
        Layout::PackedV2,
        &opts.appendfsync,
    )
    .await?;
    let map = local.map.clone();
    let path = CommitPath::connect(
        map.clone(),
        &WaitPolicy::default(),
        Arc::new(HealthBoard::default()),
    )
    .await?;
    let mut watched = local.watch().await?;
    let users: Arc<Vec<String>> = Arc::new((0..RECIPIENT_POOL).map(|i| format!("u{i}")).collect());
    let core_of_shard: Arc<Vec<usize>> =
        Arc::new(map.all_shards().map(|s| map.core_of(s)).collect());
    let counters = Arc::new(Counters {
        per_core: (0..opts.core).map(|_| AtomicU64::new(0)).collect(),
        sends: AtomicU64::new(0),
        measuring: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        all_sends: AtomicU64::new(0),
    });
    let body_tail = "x".repeat(opts.body_bytes.saturating_sub(12));
    let start = Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::with_capacity(opts.senders);
    for i in 0..opts.senders {
        let (path, users, core_of_shard, counters) = (
            path.clone(),
            users.clone(),
            core_of_shard.clone(),
            counters.clone(),
        );
        let (body_tail, opts) = (body_tail.clone(), opts.clone());
        tasks.push(tokio::spawn(async move {
            let sender = format!("b{i}");
            let mut rng = StdRng::seed_from_u64(opts.seed.wrapping_mul(1_000_003) + i as u64);
            let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("valid");
            let mut errors: BTreeMap<String, u64> = BTreeMap::new();
            let mut pacer = Pacer::new(start, opts.rate, i, opts.senders);
            let mut n = 0u64;
            tokio::time::sleep_until(start).await;
            while !counters.stop.load(Ordering::Relaxed) {
                let t = pacer.turn().await;
                let mut to: Vec<String> = Vec::with_capacity(opts.recipients);
                while to.len() < opts.recipients {
                    let u = &users[rng.random_range(0..users.len())];
                    if !to.contains(u) {
                        to.push(u.clone());
                    }
                }
                let id = format!("m{n}");
                let body = format!("{sender}:{n:06}:{body_tail}");
                n += 1;
                let r = path.commit(&sender, &id, to, body).await;
                let measuring = counters.measuring.load(Ordering::Relaxed);
                counters.all_sends.fetch_add(1, Ordering::Relaxed);
                match r {
                    Ok(offsets) => {
                        if measuring {
                            let _ = hist.record(t.elapsed().as_micros() as u64);
                            counters.sends.fetch_add(1, Ordering::Relaxed);
                            for s in offsets.keys() {
                                counters.per_core[core_of_shard[*s as usize]]
                                    .fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Err((code, _)) => *errors.entry(code.as_str().to_string()).or_default() += 1,
                }
            }
            (hist, errors)
        }));
    }

    let total = opts.warmup + opts.duration;
    let pb = bar(
        opts.progress,
        total.as_secs().max(1),
        "commit {elapsed_precise} [{bar:30}] {pos}/{len} s {msg}",
    );
    let ticker = {
        let (pb, counters) = (pb.clone(), counters.clone());
        tokio::spawn(async move {
            let mut last = (Instant::now(), 0u64);
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if counters.stop.load(Ordering::Relaxed) {
                    return;
                }
                let n = counters.all_sends.load(Ordering::Relaxed);
                let rate = (n - last.1) as f64 / last.0.elapsed().as_secs_f64();
                last = (Instant::now(), n);
                pb.set_position(start.elapsed().as_secs());
                pb.set_message(format!("{} sends/s", thousands(rate)));
            }
        })
    };
    tokio::time::sleep_until(start + opts.warmup).await;
    let load0 = load_avg();
    let a = sample_all(&mut watched).await?;
    let mark = ProcessMark::now();
    counters.measuring.store(true, Ordering::SeqCst);
    tokio::time::sleep(opts.duration).await;
    counters.measuring.store(false, Ordering::SeqCst);
    let (wall_s, cpu_s) = mark.since();
    let b = sample_all(&mut watched).await?;
    counters.stop.store(true, Ordering::SeqCst);
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).expect("valid");
    let mut errors: BTreeMap<String, u64> = BTreeMap::new();
    for t in tasks {
        let (h, e) = t
            .await
            .map_err(|e| Error::Failed(format!("a sender ended: {e}")))?;
        let _ = hist.add(&h);
        for (k, v) in e {
            *errors.entry(k).or_default() += v;
        }
    }
    let _ = ticker.await;
    pb.finish_and_clear();

    let sends = counters.sends.load(Ordering::SeqCst);
    let per_core_commits: Vec<u64> = counters
        .per_core
        .iter()
        .map(|c| c.load(Ordering::SeqCst))
        .collect();
    let commits: u64 = per_core_commits.iter().sum();
    let mut per_core = Vec::new();
    let mut per_mailbox = Vec::new();
    let mut evalsha = 0u64;
    for (k, w) in watched.iter().enumerate() {
        if w.pool == "core" {
            let n = per_core_commits[w.index];
            let redis = InstanceUse::between(w, &a[k], &b[k], wall_s, n);
            evalsha += redis.commands.get("evalsha").map_or(0, |c| c.calls);
            per_core.push(CoreCommits {
                index: w.index,
                commits: n,
                commits_per_s: round3(n as f64 / wall_s),
                redis_bound_per_s: bound_per_s(redis.cpu_us_per_unit),
                redis,
            });
        } else {
            per_mailbox.push(InstanceUse::between(w, &a[k], &b[k], wall_s, sends));
        }
    }
    let latency_ms = latency_ms(&hist);
    drop(local);
    Ok(CommitReport {
        bench: "commit".into(),
        label: opts.label.clone(),
        rate: opts.rate,
        duration_s: round3(wall_s),
        senders: opts.senders,
        recipients: opts.recipients,
        core: opts.core,
        shards: opts.shards,
        appendfsync: opts.appendfsync.clone(),
        body_bytes: opts.body_bytes,
        sends,
        sends_per_s: round3(sends as f64 / wall_s),
        commits,
        commits_per_s: round3(commits as f64 / wall_s),
        latency_ms,
        errors,
        per_core,
        per_mailbox,
        process_cpu_s: round3(cpu_s),
        process_cpu_pct: round3(cpu_s / wall_s * 100.0),
        process_cpu_us_per_send: per_unit(cpu_s * 1e6, sends),
        commits_per_call: per_unit(commits as f64, evalsha),
        load_avg: [load0, load_avg()],
    })
}

/// The percentiles of `hist` in ms; none when it is empty (an empty histogram reads 0, which
/// is not a latency).
fn latency_ms(hist: &hdrhistogram::Histogram<u64>) -> BTreeMap<String, f64> {
    if hist.is_empty() {
        return BTreeMap::new();
    }
    let q = |p: f64| round3(hist.value_at_quantile(p) as f64 / 1000.0);
    BTreeMap::from([
        ("p50".to_string(), q(0.5)),
        ("p99".to_string(), q(0.99)),
        ("p999".to_string(), q(0.999)),
        ("max".to_string(), round3(hist.max() as f64 / 1000.0)),
    ])
}

/// A latency percentile of `r` in ms as text, `—` when missing.
fn latency(r: &CommitReport, p: &str) -> String {
    or_dash(r.latency_ms.get(p).copied(), |x| format!("{x:.2}"))
}

/// The report as text.
pub fn render(r: &CommitReport) -> String {
    let rate = r.rate.map_or("max".to_string(), thousands);
    let mut out = format!(
        "commits at rate {rate}, {} senders, {} core, {} shards: {} sends/s, {} shard commits/s; \
         {} commits per call; latency P50 {} ms, P99 {} ms; tidemark process {:.0}% \
         CPU, {} µs/send; load average {} → {}\n",
        r.senders,
        r.core,
        r.shards,
        thousands(r.sends_per_s),
        thousands(r.commits_per_s),
        or_dash(r.commits_per_call, |x| format!("{x:.1}")),
        latency(r, "p50"),
        latency(r, "p99"),
        r.process_cpu_pct,
        or_dash(r.process_cpu_us_per_send, |x| format!("{x:.2}")),
        or_dash(r.load_avg[0], |x| format!("{x:.1}")),
        or_dash(r.load_avg[1], |x| format!("{x:.1}")),
    );
    if !r.errors.is_empty() {
        out += &format!("  errors: {:?}\n", r.errors);
    }
    for c in &r.per_core {
        out += &format!(
            "  core {}: {} commits/s; Redis CPU {}%, {} µs/commit (at 100% of a core: {} \
             commits/s)\n",
            c.index,
            thousands(c.commits_per_s),
            or_dash(c.redis.cpu_pct, |x| format!("{x:.0}")),
            or_dash(c.redis.cpu_us_per_unit, |x| format!("{x:.2}")),
            or_dash(c.redis_bound_per_s, thousands),
        );
        out += &commands_line(&c.redis);
    }
    out
}

/// The table of a commit report, one row per run (what `tidemark bench report FILE` prints
/// for it, and what `docs/performance.md` shows).
pub fn markdown_table(runs: &[CommitReport]) -> String {
    let mut out = String::from(
        "| run | commits/s | commits per call | core Redis CPU | core Redis µs/commit | \
         at 100% of a core | tidemark µs/send | latency P50 / P99 | errors | load average |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let Some(c) = r.per_core.first() else {
            continue;
        };
        let errors = if r.errors.is_empty() {
            "none".to_string()
        } else {
            r.errors
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} ms | {} | {} |\n",
            r.label.as_deref().unwrap_or("—"),
            thousands(c.commits_per_s),
            or_dash(r.commits_per_call, |x| format!("{x:.1}")),
            or_dash(c.redis.cpu_pct, |x| format!("{x:.0}%")),
            or_dash(c.redis.cpu_us_per_unit, |x| format!("{x:.2}µs")),
            or_dash(c.redis_bound_per_s, thousands),
            or_dash(r.process_cpu_us_per_send, |x| format!("{x:.2}µs")),
            or_dash(r.latency_ms.get("p50").copied(), |x| format!("{x:.1}")),
            or_dash(r.latency_ms.get("p99").copied(), |x| format!("{x:.1}")),
            errors,
            or_dash(r.load_avg[0], |x| format!("{x:.1}")),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A paced sender held up by a slow commit is charged from the send's intended time:
    /// with sends due every 10 ms and a commit that took 35 ms, the next send's latency counts
    /// from 10 ms, not from when the sender got round to it.
    #[tokio::test(start_paused = true)]
    async fn a_paced_send_counts_from_its_intended_time() {
        let start = Instant::now();
        let mut pacer = Pacer::new(start, Some(100.0), 0, 1);
        assert_eq!(pacer.turn().await, start);
        tokio::time::sleep(Duration::from_millis(35)).await; // a slow commit
        let t = pacer.turn().await;
        assert_eq!(t, start + Duration::from_millis(10));
        assert_eq!(Instant::now() - t, Duration::from_millis(25));
        // behind schedule: the next ones go at once, each from its own intended time
        assert_eq!(pacer.turn().await, start + Duration::from_millis(20));
        assert_eq!(pacer.turn().await, start + Duration::from_millis(30));
        assert_eq!(Instant::now(), start + Duration::from_millis(35));
        // back on schedule: it waits again
        assert_eq!(pacer.turn().await, start + Duration::from_millis(40));
        assert_eq!(Instant::now(), start + Duration::from_millis(40));
        // unpaced: from the moment of the send
        let mut max = Pacer::new(start, None, 3, 8);
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(max.turn().await, Instant::now());
    }

    /// A run that committed nothing shows its per-send figures as missing, not as 0.
    #[test]
    fn figures_with_nothing_to_divide_are_missing_not_zero() {
        let hist = hdrhistogram::Histogram::<u64>::new(3).unwrap();
        assert!(latency_ms(&hist).is_empty());
        let a = crate::engine::Sample::default();
        let b = crate::engine::Sample {
            cpu_s: 0.5,
            commands: 10,
            ..Default::default()
        };
        let redis = InstanceUse::of("core", 0, &a, &b, 10.0, 0);
        assert_eq!(redis.cpu_us_per_unit, None);
        assert_eq!(redis.commands_per_unit, None);
        assert_eq!(redis.cpu_pct, Some(5.0));
        let r = CommitReport {
            bench: "commit".into(),
            label: None,
            rate: Some(10.0),
            duration_s: 10.0,
            senders: 1,
            recipients: 1,
            core: 1,
            shards: 1,
            appendfsync: "everysec".into(),
            body_bytes: 10,
            sends: 0,
            sends_per_s: 0.0,
            commits: 0,
            commits_per_s: 0.0,
            latency_ms: latency_ms(&hist),
            errors: BTreeMap::from([("internal".to_string(), 3)]),
            per_core: vec![CoreCommits {
                index: 0,
                commits: 0,
                commits_per_s: 0.0,
                redis_bound_per_s: bound_per_s(redis.cpu_us_per_unit),
                redis,
            }],
            per_mailbox: vec![],
            process_cpu_s: 0.1,
            process_cpu_pct: 1.0,
            process_cpu_us_per_send: per_unit(0.1 * 1e6, 0),
            commits_per_call: per_unit(0.0, 0),
            load_avg: [None, Some(1.5)],
        };
        let text = render(&r);
        assert!(
            text.contains("— commits per call; latency P50 — ms, P99 — ms"),
            "{text}"
        );
        assert!(text.contains("— µs/send; load average — → 1.5"), "{text}");
        assert!(
            text.contains("Redis CPU 5%, — µs/commit (at 100% of a core: — commits/s)"),
            "{text}"
        );
        let table = markdown_table(std::slice::from_ref(&r));
        assert!(
            table.contains("| — | 0 | — | 5% | — | — | — | — / — ms | internal 3 | — |"),
            "{table}"
        );
        // and the JSON says null, which reads back as missing
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["commits_per_call"].is_null(), "{json}");
        assert!(json["per_core"][0]["redis"]["cpu_us_per_unit"].is_null());
        let back: CommitReport = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
    }
}
