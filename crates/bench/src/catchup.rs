//! `tidemark bench catchup`: how fast the materializers drain a backlog (issue 15, "the
//! engine's own ceiling, without WebSockets").
//!
//! 1. A fresh local deployment ([`LocalRedis`]: `core` + `mailbox` redis-servers, AOF on, the
//!    shards initialised), no service running.
//! 2. **Fill**: `records` records committed through the store's commit path
//!    ([`LogStore::commit_group`], `commit_dispatch.lua`, [`FILL_GROUP`] records per call), record `r` to shard `r % shards`
//!    with `recipients` distinct recipients of that shard (from a pool of
//!    [`USERS_PER_SHARD`] users per shard), many calls in flight per core instance. The
//!    materializers are not running: the logs only grow.
//! 3. **Catch-up**: `INFO` of every instance and this process's CPU time are read, then one
//!    materializer [`Worker`] per core instance is started (claim, resume from W, the real
//!    loop). Every 10 ms the health board (which the workers update after each step) is read;
//!    a mailbox instance is *caught up* when every one of its shards' lowest W equals the
//!    head the fill left; its `INFO` is read at that moment. When all are, everything is read
//!    again, the workers stop, and every shard's watermark is read back from Redis to check
//!    that W equals the head on every lane.
//!
//! Reported: records/s overall and per mailbox instance (its shards' records over the time
//! until it caught up), Redis CPU per instance (% and µs per record, from `used_cpu_*`),
//! commands per record by command (`commandstats`), and this process's CPU (the workers run
//! in it; the fill is not counted).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tidemark_server::health::HealthBoard;
use tidemark_server::materializer::{MaterializerOptions, Worker};
use tidemark_store::redis::dlog::{request_digest, CommitRequest, LogStore, DEFAULT_DEDUPE_TTL_S};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::ShardMap;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::{
    bar, bound_per_s, load_avg, or_dash, per_unit, round3, sample_all, thousands, Error,
    InstanceUse, LocalRedis, ProcessMark,
};

/// Distinct recipients per shard the records are addressed to.
pub const USERS_PER_SHARD: usize = 1000;

/// Records committed per `commit_dispatch` call while filling (group commit).
const FILL_GROUP: usize = 64;

/// Calls in flight per core instance while filling.
const FILL_IN_FLIGHT: usize = 16;

/// How long the catch-up may take before the run is declared failed.
const CATCHUP_LIMIT: Duration = Duration::from_secs(1800);

/// What to run.
#[derive(Debug, Clone)]
pub struct CatchupOptions {
    /// Records in the backlog (over all shards).
    pub records: u64,
    /// Recipients per record (all in the record's shard).
    pub recipients: usize,
    /// Mailbox Redis instances.
    pub mailbox: usize,
    /// Core Redis instances (one materializer worker each).
    pub core: usize,
    /// Shards.
    pub shards: u32,
    /// Watermark layout.
    pub layout: Layout,
    /// `appendfsync` of every instance.
    pub appendfsync: String,
    /// Records per shard per log read (`MaterializerOptions::batch`); `None`: the default.
    pub batch: Option<usize>,
    /// Body bytes of each record.
    pub body_bytes: usize,
    /// A label kept in the report (e.g. the commit measured).
    pub label: Option<String>,
    /// Draw progress bars on stderr.
    pub progress: bool,
}

impl Default for CatchupOptions {
    fn default() -> Self {
        CatchupOptions {
            records: 1_000_000,
            recipients: 1,
            mailbox: 1,
            core: 1,
            shards: 64,
            layout: Layout::PackedV2,
            appendfsync: "everysec".into(),
            batch: None,
            body_bytes: 64,
            label: None,
            progress: false,
        }
    }
}

/// One mailbox instance's catch-up.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MailboxCatchup {
    /// Index in the mailbox pool.
    pub index: usize,
    /// Shards on it.
    pub shards: usize,
    /// Records of those shards.
    pub records: u64,
    /// Seconds from the start of the workers until its last shard caught up.
    pub seconds: f64,
    /// `records / seconds`.
    pub records_per_s: f64,
    /// Its Redis use over those seconds, per record.
    pub redis: InstanceUse,
    /// Records/s this instance would take at 100 % of one core (`1e6 / redis.cpu_us_per_unit`):
    /// its ceiling when nothing else is short (missing when nothing was measured).
    pub redis_bound_per_s: Option<f64>,
}

/// The result of one catch-up run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CatchupReport {
    /// Always `catchup`.
    pub bench: String,
    /// The caller's label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Records in the backlog.
    pub records: u64,
    /// Recipients per record.
    pub recipients: usize,
    /// Mailbox entries written (`records × recipients`).
    pub entries: u64,
    /// Mailbox instances.
    pub mailbox: usize,
    /// Core instances.
    pub core: usize,
    /// Shards.
    pub shards: u32,
    /// Layout.
    pub layout: String,
    /// `appendfsync` of every instance.
    pub appendfsync: String,
    /// Records per shard per log read.
    pub batch: usize,
    /// Body bytes per record.
    pub body_bytes: usize,
    /// Seconds the fill took (not part of the measurement).
    pub fill_s: f64,
    /// Records committed per second while filling.
    pub fill_per_s: f64,
    /// Seconds from the start of the workers until every shard caught up.
    pub catchup_s: f64,
    /// `records / catchup_s`.
    pub records_per_s: f64,
    /// Per mailbox instance.
    pub per_mailbox: Vec<MailboxCatchup>,
    /// Per core instance, over the whole catch-up, per record of its shards.
    pub per_core: Vec<InstanceUse>,
    /// CPU seconds of this process (the workers) during the catch-up.
    pub process_cpu_s: f64,
    /// Its CPU % of one core.
    pub process_cpu_pct: f64,
    /// Its CPU µs per record.
    pub process_cpu_us_per_record: Option<f64>,
    /// The 1-minute load average of the machine at the start and at the end of the catch-up
    /// (missing when `/proc/loadavg` could not be read).
    pub load_avg: [Option<f64>; 2],
}

/// The users of each shard the records go to: `USERS_PER_SHARD` per shard, `u<i>` in order.
fn user_pools(map: &ShardMap, shards: u32) -> Vec<Vec<String>> {
    let mut pools: Vec<Vec<String>> = vec![Vec::new(); shards as usize];
    let mut full = 0;
    let mut i = 0u64;
    while full < shards as usize {
        let u = format!("u{i}");
        i += 1;
        let p = &mut pools[map.route(&u).shard as usize];
        if p.len() < USERS_PER_SHARD {
            p.push(u);
            if p.len() == USERS_PER_SHARD {
                full += 1;
            }
        }
    }
    pools
}

/// Fills the logs: every record committed; returns each shard's head.
async fn fill(
    opts: &CatchupOptions,
    map: &ShardMap,
    pools: &[Vec<String>],
    pb: &indicatif::ProgressBar,
) -> Result<BTreeMap<u32, u64>, Error> {
    let shards = opts.shards as u64;
    let body_tail = "x".repeat(opts.body_bytes.saturating_sub(10));
    let body_tail = body_tail.as_str();
    let mut per_core = Vec::new();
    for (core, url) in map.core_urls().iter().enumerate() {
        let store = LogStore::connect(url).await?;
        // groups of records of one shard: (shard, first record index, count)
        let mut groups = Vec::new();
        for s in map.shards_on_core(core) {
            let total = opts.records / shards + u64::from(u64::from(s) < opts.records % shards);
            let mut k = 0;
            while k < total {
                let n = (total - k).min(FILL_GROUP as u64);
                groups.push((s, k, n));
                k += n;
            }
        }
        per_core.push((store, groups));
    }
    let calls = per_core.into_iter().flat_map(|(store, groups)| {
        groups.into_iter().map(move |(s, k0, n)| {
            let mut store = store.clone();
            async move {
                let owned: Vec<(String, String, Vec<&str>, String)> = (k0..k0 + n)
                    .map(|k| {
                        let r = k * shards + u64::from(s);
                        let pool = &pools[s as usize];
                        let rs: Vec<&str> = (0..opts.recipients)
                            .map(|j| {
                                pool[((k as usize) * opts.recipients + j) % pool.len()].as_str()
                            })
                            .collect();
                        (
                            format!("s{}", r % 997),
                            format!("c{r}"),
                            rs,
                            format!("r{r:08}:{body_tail}"),
                        )
                    })
                    .collect();
                let digests: Vec<String> = owned
                    .iter()
                    .map(|(_, _, rs, b)| request_digest(rs, b))
                    .collect();
                let reqs: Vec<CommitRequest> = owned
                    .iter()
                    .zip(&digests)
                    .map(|((f, c, rs, b), d)| CommitRequest {
                        sender: f,
                        client_id: c,
                        recipients: rs,
                        body: b,
                        sent_at_us: 1,
                        digest: d,
                        claim_home: None,
                    })
                    .collect();
                for r in store.commit_group(s, &reqs, DEFAULT_DEDUPE_TTL_S).await? {
                    r?;
                }
                Ok::<u64, Error>(n)
            }
        })
    });
    let mut stream =
        futures::stream::iter(calls).buffer_unordered(FILL_IN_FLIGHT * map.core_urls().len());
    while let Some(r) = stream.next().await {
        pb.inc(r?);
    }
    let mut heads = BTreeMap::new();
    for (core, url) in map.core_urls().iter().enumerate() {
        let mut store = LogStore::connect(url).await?;
        for s in map.shards_on_core(core) {
            heads.insert(s, store.head(s).await?);
        }
    }
    let total: u64 = heads.values().sum();
    if total != opts.records {
        return Err(Error::Failed(format!(
            "the fill left {total} records in the logs, not {}",
            opts.records
        )));
    }
    Ok(heads)
}

/// Runs one catch-up on a fresh local deployment.
pub async fn run_catchup(opts: &CatchupOptions) -> Result<CatchupReport, Error> {
    if opts.records == 0 || opts.recipients == 0 || opts.recipients > USERS_PER_SHARD {
        return Err(Error::Invalid(format!(
            "--records must be at least 1 and --recipients 1..={USERS_PER_SHARD}"
        )));
    }
    let local = LocalRedis::start(
        opts.core,
        opts.mailbox,
        opts.shards,
        opts.layout,
        &opts.appendfsync,
    )
    .await?;
    let map = local.map.clone();
    let pools = user_pools(&map, opts.shards);

    let pb = bar(
        opts.progress,
        opts.records,
        "fill     {elapsed_precise} [{bar:30}] {pos}/{len} records committed",
    );
    let t_fill = Instant::now();
    let heads = fill(opts, &map, &pools, &pb).await?;
    let fill_s = t_fill.elapsed().as_secs_f64();
    pb.finish_and_clear();

    let mut watched = local.watch().await?;
    let mut mailboxes = Vec::new();
    for url in map.mailbox_urls() {
        mailboxes.push(MailboxStore::connect(url, map.layout()).await?);
    }
    let mut mopts = MaterializerOptions::default();
    if let Some(b) = opts.batch {
        mopts.batch = b.max(1);
    }
    let batch = mopts.batch;
    let health = Arc::new(HealthBoard::default());
    let cancel = CancellationToken::new();

    let pb = bar(
        opts.progress,
        opts.records,
        "catch-up {elapsed_precise} [{bar:30}] {pos}/{len} records materialised {msg}",
    );
    let load0 = load_avg();
    let a = sample_all(&mut watched).await?;
    let mark = ProcessMark::now();
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for core in 0..map.core_urls().len() {
        let shards = map.shards_on_core(core);
        let w = Worker::start(
            map.clone(),
            core,
            mailboxes.clone(),
            &shards,
            mopts.clone(),
            health.clone(),
        )
        .await?;
        tasks.push(tokio::spawn(w.run(cancel.clone())));
    }
    let _stop = cancel.clone().drop_guard();

    // poll the health board until every mailbox instance caught up
    let n_mb = map.mailbox_urls().len();
    let mb_shards: Vec<Vec<u32>> = (0..n_mb).map(|i| map.shards_on_mailbox(i)).collect();
    let mut done: Vec<Option<(f64, crate::engine::Sample)>> = vec![None; n_mb];
    let mut last = (Instant::now(), 0u64);
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let snap = health.snapshot();
        let w_of = |s: &u32| snap.get(s).map_or(0, |h| h.min_w.min(heads[s]));
        let applied: u64 = heads.keys().map(w_of).sum();
        if last.0.elapsed() >= Duration::from_millis(250) {
            let rate = (applied - last.1) as f64 / last.0.elapsed().as_secs_f64();
            pb.set_message(format!("{}/s", thousands(rate)));
            last = (Instant::now(), applied);
        }
        pb.set_position(applied);
        for (i, shards) in mb_shards.iter().enumerate() {
            if done[i].is_none() && shards.iter().all(|s| w_of(s) >= heads[s]) {
                let secs = t0.elapsed().as_secs_f64();
                let k = watched
                    .iter()
                    .position(|w| w.pool == "mailbox" && w.index == i)
                    .expect("every mailbox watched");
                let s = watched[k].sample().await?;
                done[i] = Some((secs, s));
            }
        }
        if done.iter().all(Option::is_some) {
            break;
        }
        if t0.elapsed() > CATCHUP_LIMIT {
            return Err(Error::Failed(format!(
                "not caught up after {CATCHUP_LIMIT:?} ({applied} of {} records)",
                opts.records
            )));
        }
        if let Some(t) = tasks.iter().position(|t| t.is_finished()) {
            let r = tasks.remove(t).await;
            return Err(Error::Failed(format!("a worker ended: {r:?}")));
        }
    }
    let catchup_s = t0.elapsed().as_secs_f64();
    let b = sample_all(&mut watched).await?;
    let (wall_s, cpu_s) = mark.since();
    pb.finish_and_clear();
    cancel.cancel();
    for t in tasks {
        let _ = t.await;
    }

    // W equals the head on every lane of every shard, read back from Redis
    for (i, shards) in mb_shards.iter().enumerate() {
        let got = mailboxes[i].read_watermarks(shards).await?;
        for (s, wm) in shards.iter().zip(got) {
            let wm = wm?;
            let (lo, hi) = (wm.lanes.min_present_w(), wm.lanes.max_present_w());
            if lo != Some(heads[s]) || hi != Some(heads[s]) {
                return Err(Error::Failed(format!(
                    "shard {s}: lanes at {lo:?}..{hi:?}, head {}",
                    heads[s]
                )));
            }
        }
    }

    let records_of = |shards: &[u32]| shards.iter().map(|s| heads[s]).sum::<u64>();
    let mut per_mailbox = Vec::new();
    for (i, shards) in mb_shards.iter().enumerate() {
        let (secs, s) = done[i].take().expect("all done");
        let k = watched
            .iter()
            .position(|w| w.pool == "mailbox" && w.index == i)
            .expect("watched");
        let records = records_of(shards);
        let redis = InstanceUse::between(&watched[k], &a[k], &s, secs, records);
        per_mailbox.push(MailboxCatchup {
            index: i,
            shards: shards.len(),
            records,
            seconds: round3(secs),
            records_per_s: round3(records as f64 / secs),
            redis_bound_per_s: bound_per_s(redis.cpu_us_per_unit),
            redis,
        });
    }
    let mut per_core = Vec::new();
    for (k, w) in watched.iter().enumerate() {
        if w.pool == "core" {
            let records = records_of(&map.shards_on_core(w.index));
            per_core.push(InstanceUse::between(w, &a[k], &b[k], catchup_s, records));
        }
    }
    Ok(CatchupReport {
        bench: "catchup".into(),
        label: opts.label.clone(),
        records: opts.records,
        recipients: opts.recipients,
        entries: opts.records * opts.recipients as u64,
        mailbox: opts.mailbox,
        core: opts.core,
        shards: opts.shards,
        layout: opts.layout.to_string(),
        appendfsync: opts.appendfsync.clone(),
        batch,
        body_bytes: opts.body_bytes,
        fill_s: round3(fill_s),
        fill_per_s: round3(opts.records as f64 / fill_s),
        catchup_s: round3(catchup_s),
        records_per_s: round3(opts.records as f64 / catchup_s),
        per_mailbox,
        per_core,
        process_cpu_s: round3(cpu_s),
        process_cpu_pct: round3(cpu_s / wall_s * 100.0),
        process_cpu_us_per_record: per_unit(cpu_s * 1e6, opts.records),
        load_avg: [load0, load_avg()],
    })
}

/// The report as text: one line overall, one per instance, the commands per record.
pub fn render(r: &CatchupReport) -> String {
    let mut out = format!(
        "catch-up of {} records ({} recipient(s) each) on {} mailbox + {} core, {} shards, {}: \
         {:.2} s, {} records/s; tidemark process {:.0}% CPU, {} µs/record; load average \
         {} → {}\n",
        thousands(r.records as f64),
        r.recipients,
        r.mailbox,
        r.core,
        r.shards,
        r.layout,
        r.catchup_s,
        thousands(r.records_per_s),
        r.process_cpu_pct,
        or_dash(r.process_cpu_us_per_record, |x| format!("{x:.2}")),
        or_dash(r.load_avg[0], |x| format!("{x:.1}")),
        or_dash(r.load_avg[1], |x| format!("{x:.1}")),
    );
    for m in &r.per_mailbox {
        out += &format!(
            "  mailbox {}: {} records in {:.2} s = {} records/s; Redis CPU {}%, {} µs/record \
             (at 100% of a core: {} records/s)\n",
            m.index,
            thousands(m.records as f64),
            m.seconds,
            thousands(m.records_per_s),
            or_dash(m.redis.cpu_pct, |x| format!("{x:.0}")),
            or_dash(m.redis.cpu_us_per_unit, |x| format!("{x:.2}")),
            or_dash(m.redis_bound_per_s, thousands),
        );
        out += &commands_line(&m.redis);
    }
    for c in &r.per_core {
        out += &format!(
            "  core {}: Redis CPU {}%, {} µs/record\n",
            c.index,
            or_dash(c.cpu_pct, |x| format!("{x:.0}")),
            or_dash(c.cpu_us_per_unit, |x| format!("{x:.2}")),
        );
        out += &commands_line(c);
    }
    out
}

/// `    commands/unit: evalsha 1.00 × 7.1 µs, …`
pub(crate) fn commands_line(u: &InstanceUse) -> String {
    let mut parts: Vec<(&String, &crate::engine::CommandUse)> = u.commands.iter().collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.1.calls));
    let parts: Vec<String> = parts
        .iter()
        .map(|(n, c)| {
            let per = or_dash(c.calls_per_unit, |x| format!("{x:.4}"));
            format!("{n} {per} × {:.2} µs", c.us_per_call)
        })
        .collect();
    format!("    per unit: {}\n", parts.join(", "))
}

/// The table of a catch-up report, one row per run (what `tidemark bench report FILE` prints
/// for it, and what `docs/performance.md` shows).
pub fn markdown_table(runs: &[CatchupReport]) -> String {
    let mut out = String::from(
        "| run | records/s | mailbox Redis CPU | mailbox Redis µs/record | at 100% of a core | \
         tidemark µs/record | tidemark CPU | load average |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        // one mailbox instance per row: the figures of the first, the others in the file
        let Some(m) = r.per_mailbox.first() else {
            continue;
        };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {:.0}% | {} |\n",
            r.label.as_deref().unwrap_or("—"),
            thousands(m.records_per_s),
            or_dash(m.redis.cpu_pct, |x| format!("{x:.0}%")),
            or_dash(m.redis.cpu_us_per_unit, |x| format!("{x:.2}µs")),
            or_dash(m.redis_bound_per_s, thousands),
            or_dash(r.process_cpu_us_per_record, |x| format!("{x:.2}µs")),
            r.process_cpu_pct,
            or_dash(r.load_avg[0], |x| format!("{x:.1}")),
        );
    }
    out
}
