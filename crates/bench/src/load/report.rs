//! What a run reports, and its tables: [`markdown_table`] (ADR-0015's "Measured" table),
//! [`ladder_table`], [`to_json`] / [`from_json`]; and the ladder's step syntax
//! ([`parse_steps`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use tidemark_store::redis::watermark::Layout;

use super::{Error, TARGET_RHO};

/// The percentiles (in %) of the latency curves kept in a [`RunReport`]
/// (`e2e_curve`, `send_ack_curve`); 100 is the maximum.
pub const CURVE_PERCENTILES: [f64; 11] = [
    50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 99.999, 100.0,
];

/// Latency summary, milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Largest value.
    pub max: f64,
}

/// The e2e latency of the messages intended in one second of a run, ms (two significant
/// digits); `delivered` counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct SecondLatency {
    /// Messages of that second delivered in the window.
    pub delivered: u64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest value.
    pub max: f64,
}

/// One figure for each pool of Redis instances; `None` (`null`) when it could not be read
/// (an `INFO` of one of the pool's instances failed at a sampling point it needs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct PoolPair {
    /// The mailbox instances.
    pub mailbox: Option<f64>,
    /// The core instances.
    pub core: Option<f64>,
}

/// One Redis command over a run (A→C), from `INFO commandstats`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct CommandStats {
    /// Calls.
    pub calls: u64,
    /// Calls per message sent.
    pub per_msg: f64,
    /// Server-side µs per call.
    pub us_per_call: f64,
}

/// One OS process over a run: the load generator (`/proc/self`), a gateway (its `/metrics`:
/// `process_cpu_seconds_total`, `process_resident_memory_bytes`), or both when the
/// deployment runs inside the generator's process (a local target). `None` (`null`): not
/// read.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ProcessStats {
    /// How the tables name it: `generator`, `server` (`server 0`, `server 1`, … with several
    /// gateways), `generator + server (one process)`.
    pub name: String,
    /// `generator`, `server` or `generator+server`.
    pub role: String,
    /// Where it was read: `/proc/self` or the metrics URL.
    pub source: String,
    /// CPU seconds (user + system) over the run and drain (A→C).
    pub cpu_s: Option<f64>,
    /// CPU µs per message sent (A→C).
    pub cpu_us_per_msg: Option<f64>,
    /// CPU % while sending (A→B; 100 = one core).
    pub cpu_pct: Option<f64>,
    /// Resident memory at the end of the window (C), bytes.
    pub rss_bytes: Option<u64>,
}

/// One Redis instance over a run. A figure is `None` (`null`) when the `INFO` it needs
/// could not be read (see [`RunReport::unread`]).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct InstanceStats {
    /// `mailbox` or `core`.
    pub pool: String,
    /// Index within its pool.
    pub index: usize,
    /// `redis://host:port/`.
    pub url: String,
    /// `EVALSHA` calls over the run and drain (A→C).
    pub evalsha_calls: Option<u64>,
    /// Server-side µs per `EVALSHA` (A→C).
    pub evalsha_us: Option<f64>,
    /// CPU % of this instance while sending (A→B; 100 = one core).
    pub cpu_pct: Option<f64>,
    /// Commands per second while sending (A→B).
    pub ops_per_s: Option<f64>,
    /// CPU seconds over the run and drain (A→C).
    pub cpu_s: Option<f64>,
    /// CPU µs per message sent (A→C). Absent from reports written before it existed.
    #[serde(default)]
    pub cpu_us_per_msg: Option<f64>,
    /// Every command called over the run and drain (A→C), by name. Absent from reports
    /// written before it existed.
    #[serde(default)]
    pub commands: Option<BTreeMap<String, CommandStats>>,
}

/// The result of one run (one layout, one deployment).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct RunReport {
    /// Watermark layout of the deployment (`packed-v1` / `packed-v2`).
    pub layout: Layout,
    /// `local` or `remote`.
    pub target: String,
    /// Mailbox Redis instances (for a remote target: the URLs given).
    pub mailbox_instances: usize,
    /// Core Redis instances (for a remote target: the URLs given).
    pub core_instances: usize,
    /// Shards (0 when unknown: remote target).
    pub shards: u32,
    /// Connected clients.
    pub clients: usize,
    /// Intended aggregate rate, messages/s.
    pub rate: f64,
    /// Sending time, seconds.
    pub duration_s: f64,
    /// Recipients per message.
    pub fanout: usize,
    /// RNG seed of the recipients.
    pub seed: u64,
    /// `send` frames queued (messages).
    pub sent: u64,
    /// `send_ack`s received by the end of the window (`t0 + duration + drain_grace`), the
    /// drain grace included.
    pub send_acked: u64,
    /// `send_ack`s that arrived while sending, i.e. by `t0 + duration` (a subset of
    /// `send_acked`: an ack that arrives during the drain grace is not counted).
    ///
    /// `None` in reports written before this field existed: those carry `committed_per_s`
    /// instead (`send_acked / duration_s`, acks of the drain grace included), which is not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_acked_while_sending: Option<u64>,
    /// `send_acked_while_sending / duration_s`: the rate at which the service acked sends
    /// while load was offered. Below the offered rate by about `rate × SEND_ACK latency /
    /// duration` even when nothing is refused; far below it when the service falls behind.
    /// `None` in reports written before this field existed (see `send_acked_while_sending`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked_per_s_while_sending: Option<f64>,
    /// (message, recipient) pairs delivered in the window (duplicates dropped).
    pub delivered: u64,
    /// (message, recipient) pairs sent: `sent × fanout`.
    pub expected: u64,
    /// `delivered / expected × 100`.
    pub delivered_in_window_pct: f64,
    /// End-to-end latency (intended send → deliver), ms.
    pub e2e_ms: Percentiles,
    /// SEND_ACK latency (intended send → ack), ms.
    pub send_ack_ms: Percentiles,
    /// `(percentile, ms)` at each of [`CURVE_PERCENTILES`] (empty when nothing arrived).
    pub e2e_curve: Vec<(f64, f64)>,
    /// Same for SEND_ACK.
    pub send_ack_curve: Vec<(f64, f64)>,
    /// The e2e latency of the messages intended in each second of the run, in order (the
    /// first is second 0 of sending): when the slow ones were sent. Empty in reports
    /// written before it existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub e2e_timeline: Vec<SecondLatency>,
    /// Server-side µs per `EVALSHA`, per pool (A→C).
    pub evalsha_us: PoolPair,
    /// Redis CPU %, mean over the pool's instances (A→B).
    pub redis_cpu_pct: PoolPair,
    /// Commands per second, summed over the pool (A→B).
    pub ops_per_s: PoolPair,
    /// Mailbox-pool CPU µs per delivered (message, recipient) pair (A→C).
    pub mailbox_cpu_us_per_msg: Option<f64>,
    /// How late the scheduler queued a send at worst (the generator's own lag), ms.
    pub max_send_lag_ms: f64,
    /// Errors by code.
    pub errors: BTreeMap<String, u64>,
    /// Every Redis instance.
    pub per_instance: Vec<InstanceStats>,
    /// The OS processes the run could see: the generator and each gateway, or one combined
    /// process for a local target. Empty in reports written before it existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<ProcessStats>,
    /// Per pool (`mailbox`, `core`), every command called over the run and drain (A→C),
    /// summed over the pool's instances; `None` when an instance's `INFO` was not read.
    /// Empty in reports written before it existed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub redis_commands: BTreeMap<String, Option<BTreeMap<String, CommandStats>>>,
    /// The reads that failed after every retry (instance or URL, sampling point, why): the
    /// figures that need them are `None`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unread: Vec<String>,
}

impl RunReport {
    /// `M+C`, e.g. `4+4`.
    pub fn instances_label(&self) -> String {
        format!("{}+{}", self.mailbox_instances, self.core_instances)
    }

    /// Instances of a pool that keep ρ ≤ [`TARGET_RHO`] at this rate:
    /// `ceil(instances × cpu_pct / 100 / 0.65)`, at least 1.
    pub fn instances_for_rho(instances: usize, cpu_pct: f64) -> usize {
        Self::instances_for_rho_of(instances, Some(cpu_pct)).unwrap_or(1)
    }

    /// [`instances_for_rho`](Self::instances_for_rho) of a CPU % that may be missing.
    pub fn instances_for_rho_of(instances: usize, cpu_pct: Option<f64>) -> Option<usize> {
        let cpu_pct = cpu_pct?;
        let need = (instances as f64 * cpu_pct / 100.0 / TARGET_RHO).ceil();
        Some(if need.is_finite() && need >= 1.0 {
            need as usize
        } else {
            1
        })
    }
}

/// `{"runs":[…]}`: every field of every [`RunReport`].
pub fn to_json(runs: &[RunReport]) -> serde_json::Value {
    serde_json::json!({ "runs": runs })
}

/// The runs of a report [`to_json`] wrote (`{"runs":[…]}`), also one written before
/// `send_acked_while_sending` existed (those fields are then `None`; its `committed_per_s`
/// is ignored).
pub fn from_json(text: &str) -> Result<Vec<RunReport>, serde_json::Error> {
    #[derive(serde::Deserialize)]
    struct File {
        runs: Vec<RunReport>,
    }
    Ok(serde_json::from_str::<File>(text)?.runs)
}

/// A number with `,` thousands separators and `decimals` decimals (`10,657.4`; negative
/// numbers with `−`), as in the tables.
pub fn group_thousands(x: f64, decimals: usize) -> String {
    let s = format!("{:.*}", decimals, x.abs());
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i.to_owned(), Some(f.to_owned())),
        None => (s, None),
    };
    let mut out = String::new();
    for (k, c) in int.chars().enumerate() {
        if k > 0 && (int.len() - k) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if let Some(f) = frac {
        out.push('.');
        out.push_str(&f);
    }
    if x < 0.0 && out.chars().any(|c| c.is_ascii_digit() && c != '0') {
        out.insert(0, '−');
    }
    out
}

/// Milliseconds as in the ADR: `91.3ms`, `10,657.4ms`; 2 decimals below 10 ms.
pub(crate) fn ms(x: f64) -> String {
    format!("{}ms", group_thousands(x, if x < 10.0 { 2 } else { 1 }))
}

fn pct(x: f64) -> String {
    if x == 100.0 || x == 0.0 {
        format!("{x:.0}%")
    } else if x > 99.9 && x < 100.0 {
        format!("{x:.2}%")
    } else {
        format!("{x:.1}%")
    }
}

fn us(x: f64) -> String {
    format!("{}µs", group_thousands(x, 2))
}

fn per_s(x: f64) -> String {
    format!("{}/s", group_thousands(x, 0))
}

/// `—` for a figure a report does not hold (a field that older reports lack).
fn or_dash(x: Option<f64>, fmt: fn(f64) -> String) -> String {
    x.map_or_else(|| "—".to_owned(), fmt)
}

fn count_or_dash(n: Option<usize>) -> String {
    n.map_or_else(|| "—".to_owned(), |n| n.to_string())
}

/// Errors by code, e.g. `overloaded 31,178`; `none` when there were none.
fn errors_cell(errors: &BTreeMap<String, u64>) -> String {
    if errors.is_empty() {
        return "none".into();
    }
    errors
        .iter()
        .map(|(code, n)| format!("{code} {}", group_thousands(*n as f64, 0)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn delta(v1: f64, v2: f64) -> String {
    if v1 == 0.0 || !v1.is_finite() || !v2.is_finite() {
        return "—".into();
    }
    let d = (v2 - v1) / v1 * 100.0;
    if d >= 0.0 {
        format!("+{}%", group_thousands(d, 1))
    } else {
        format!("{}%", group_thousands(d, 1))
    }
}

/// Column headers: the layout; when a layout repeats, with its `M+C@rate` (a ladder), or
/// numbered when even that repeats.
fn headers(runs: &[RunReport]) -> Vec<String> {
    let step = |r: &RunReport| format!("{}@{}", r.instances_label(), group_thousands(r.rate, 0));
    runs.iter()
        .enumerate()
        .map(|(i, r)| {
            let same: Vec<&RunReport> = runs.iter().filter(|o| o.layout == r.layout).collect();
            if same.len() == 1 {
                r.layout.to_string()
            } else if same.iter().filter(|o| step(o) == step(r)).count() == 1 {
                format!("{} {}", r.layout, step(r))
            } else {
                format!("{} #{}", r.layout, i + 1)
            }
        })
        .collect()
}

/// A row of [`markdown_table`]: its name, the figure (`None`: the report does not hold it),
/// and how it is written.
type Row = (
    &'static str,
    fn(&RunReport) -> Option<f64>,
    fn(f64) -> String,
);

/// The rows of [`markdown_table`], in order (the `errors` row follows them).
const ROWS: [Row; 10] = [
    ("evalsha (mailbox)", |r| r.evalsha_us.mailbox, us),
    ("mailbox Redis CPU", |r| r.redis_cpu_pct.mailbox, pct),
    ("end-to-end P50", |r| Some(r.e2e_ms.p50), ms),
    ("end-to-end P99", |r| Some(r.e2e_ms.p99), ms),
    ("SEND_ACK P99", |r| Some(r.send_ack_ms.p99), ms),
    (
        "delivered within window",
        |r| Some(r.delivered_in_window_pct),
        pct,
    ),
    (
        "acked while sending",
        |r| r.acked_per_s_while_sending,
        per_s,
    ),
    ("mailbox CPU per message", |r| r.mailbox_cpu_us_per_msg, us),
    ("evalsha (core)", |r| r.evalsha_us.core, us),
    ("core Redis CPU", |r| r.redis_cpu_pct.core, pct),
];

/// ADR-0015's "Measured" table: one row per metric, one column per run, and a
/// `Δ v2 vs v1` column (relative change of packed-v2 against packed-v1, first run of each)
/// when both layouts are present. The last row, `errors`, has every error and refusal by
/// code (e.g. `overloaded`); `—` stands for a figure the report does not hold (older reports
/// have no `acked_per_s_while_sending`; a figure whose reading failed is missing).
///
/// Reports that hold [`RunReport::processes`] get a row `<process> CPU per message` for
/// each process (the generator, the server, or both in one process) and `<process> RSS at
/// end` for each server, before `errors`; older reports have neither.
pub fn markdown_table(runs: &[RunReport]) -> String {
    let v1 = runs.iter().find(|r| r.layout == Layout::PackedV1);
    let v2 = runs.iter().find(|r| r.layout == Layout::PackedV2);
    let both = v1.zip(v2);
    let mut out = String::new();
    let _ = write!(out, "| metric |");
    for h in headers(runs) {
        let _ = write!(out, " {h} |");
    }
    if both.is_some() {
        out.push_str(" Δ v2 vs v1 |");
    }
    out.push_str("\n|---|");
    for _ in runs {
        out.push_str("---|");
    }
    if both.is_some() {
        out.push_str("---|");
    }
    out.push('\n');
    let mut row = |name: &str, get: &dyn Fn(&RunReport) -> Option<f64>, fmt: fn(f64) -> String| {
        let _ = write!(out, "| {name} |");
        for r in runs {
            let _ = write!(out, " {} |", or_dash(get(r), fmt));
        }
        if let Some((a, b)) = both {
            let d = get(a).zip(get(b)).map_or("—".into(), |(a, b)| delta(a, b));
            let _ = write!(out, " {d} |");
        }
        out.push('\n');
    };
    for (name, get, fmt) in ROWS {
        row(name, &get, fmt);
    }
    for (name, role) in process_names(runs) {
        let process = |r: &RunReport| r.processes.iter().find(|p| p.name == name).cloned();
        row(
            &format!("{name} CPU per message"),
            &|r| process(r).and_then(|p| p.cpu_us_per_msg),
            us,
        );
        if role != "generator" {
            row(
                &format!("{name} RSS at end"),
                &|r| process(r).and_then(|p| p.rss_bytes).map(|b| b as f64),
                mib,
            );
        }
    }
    out.push_str("| errors |");
    for r in runs {
        let _ = write!(out, " {} |", errors_cell(&r.errors));
    }
    if both.is_some() {
        out.push_str(" — |");
    }
    out.push('\n');
    out
}

/// Every process name of `runs` with its role, in order of first appearance.
fn process_names(runs: &[RunReport]) -> Vec<(String, String)> {
    let mut names: Vec<(String, String)> = Vec::new();
    for p in runs.iter().flat_map(|r| &r.processes) {
        if !names.iter().any(|(n, _)| *n == p.name) {
            names.push((p.name.clone(), p.role.clone()));
        }
    }
    names
}

/// Bytes as `123.4 MiB`.
fn mib(bytes: f64) -> String {
    format!("{} MiB", group_thousands(bytes / (1024.0 * 1024.0), 1))
}

/// Calls per message with 3 decimals; `<0.001` for fewer calls than that, but some.
fn calls_per_msg(x: f64) -> String {
    if x > 0.0 && x < 0.0005 {
        "<0.001".into()
    } else {
        group_thousands(x, 3)
    }
}

/// Whether [`cpu_table`] has anything to show for `runs`.
pub fn has_cpu_table(runs: &[RunReport]) -> bool {
    runs.iter()
        .any(|r| !r.processes.is_empty() || !r.redis_commands.is_empty())
}

/// Where the CPU of a message goes, per message sent, one column per run: each process
/// (CPU µs per message, CPU % while sending, RSS at the end), each Redis instance (CPU µs
/// per message), and per pool every command called (calls per message × server-side µs per
/// call, most frequent first). `—`: not read. Empty for reports without
/// [`RunReport::processes`] or [`RunReport::redis_commands`] (older ones).
pub fn cpu_table(runs: &[RunReport]) -> String {
    if !has_cpu_table(runs) {
        return String::new();
    }
    let mut out = String::from("| per message sent |");
    for h in headers(runs) {
        let _ = write!(out, " {h} |");
    }
    out.push_str("\n|---|");
    for _ in runs {
        out.push_str("---|");
    }
    out.push('\n');
    let mut row = |name: &str, cell: &dyn Fn(&RunReport) -> String| {
        let _ = write!(out, "| {name} |");
        for r in runs {
            let _ = write!(out, " {} |", cell(r));
        }
        out.push('\n');
    };
    for (name, _) in process_names(runs) {
        let process = |r: &RunReport| r.processes.iter().find(|p| p.name == name).cloned();
        row(&format!("{name}: CPU"), &|r| {
            or_dash(process(r).and_then(|p| p.cpu_us_per_msg), us)
        });
        row(&format!("{name}: CPU while sending"), &|r| {
            or_dash(process(r).and_then(|p| p.cpu_pct), pct)
        });
        row(&format!("{name}: RSS at end"), &|r| {
            or_dash(process(r).and_then(|p| p.rss_bytes).map(|b| b as f64), mib)
        });
    }
    let mut instances: Vec<(String, usize)> = Vec::new();
    for i in runs.iter().flat_map(|r| &r.per_instance) {
        if !instances.iter().any(|(p, n)| *p == i.pool && *n == i.index) {
            instances.push((i.pool.clone(), i.index));
        }
    }
    for (pool, index) in instances {
        row(&format!("{pool} Redis {index}: CPU"), &|r| {
            let i = r
                .per_instance
                .iter()
                .find(|i| i.pool == pool && i.index == index);
            or_dash(i.and_then(|i| i.cpu_us_per_msg), us)
        });
    }
    let mut pools: Vec<&str> = Vec::new();
    for r in runs {
        for p in r.redis_commands.keys() {
            if !pools.contains(&p.as_str()) {
                pools.push(p);
            }
        }
    }
    // mailbox before core, as in the other tables
    pools.sort_by_key(|p| (*p != "mailbox", *p != "core", p.to_string()));
    for pool in pools {
        let of = |r: &RunReport| r.redis_commands.get(pool).cloned().flatten();
        let mut commands: Vec<(String, f64)> = Vec::new();
        for cmds in runs.iter().filter_map(of) {
            for (name, c) in cmds {
                match commands.iter_mut().find(|(n, _)| *n == name) {
                    Some((_, most)) => *most = most.max(c.per_msg),
                    None => commands.push((name, c.per_msg)),
                }
            }
        }
        commands.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        if commands.is_empty() {
            row(&format!("{pool} Redis commands"), &|_| "—".to_owned());
        }
        for (name, _) in commands {
            row(&format!("{pool} `{name}` calls × µs"), &|r| match of(r) {
                None => "—".to_owned(),
                Some(cmds) => cmds.get(&name).map_or_else(
                    || "0".to_owned(),
                    |c| format!("{} × {}", calls_per_msg(c.per_msg), us(c.us_per_call)),
                ),
            });
        }
    }
    out
}

/// The capacity ladder: per run, `M+C`, rate, the result, and per pool the instance count
/// that keeps ρ ≤ 0.65 at that rate (`ceil(instances × CPU% / 100 / 0.65)`, CPU% being the
/// mean per instance).
pub fn ladder_table(runs: &[RunReport]) -> String {
    let layouts = runs.iter().any(|r| r.layout != runs[0].layout);
    let mut out = String::from("| mailbox + core |");
    if layouts {
        out.push_str(" layout |");
    }
    out.push_str(
        " rate | result | mailbox for ρ ≤ 0.65 | core for ρ ≤ 0.65 |\n|---|---|---|---|---|",
    );
    if layouts {
        out.push_str("---|");
    }
    out.push('\n');
    for r in runs {
        let _ = write!(out, "| {} |", r.instances_label());
        if layouts {
            let _ = write!(out, " {} |", r.layout);
        }
        let _ = writeln!(
            out,
            " {} | end-to-end P99 {}, {} delivered, acked while sending {}, errors: {}, mailbox CPU {}, core CPU {} | {} | {} |",
            group_thousands(r.rate, 0),
            ms(r.e2e_ms.p99),
            pct(r.delivered_in_window_pct),
            or_dash(r.acked_per_s_while_sending, per_s),
            errors_cell(&r.errors),
            or_dash(r.redis_cpu_pct.mailbox, pct),
            or_dash(r.redis_cpu_pct.core, pct),
            count_or_dash(RunReport::instances_for_rho_of(
                r.mailbox_instances,
                r.redis_cpu_pct.mailbox
            )),
            count_or_dash(RunReport::instances_for_rho_of(
                r.core_instances,
                r.redis_cpu_pct.core
            )),
        );
    }
    out
}

/// One step of a capacity ladder: `M+C@R`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LadderStep {
    /// Mailbox Redis instances.
    pub mailbox: usize,
    /// Core Redis instances.
    pub core: usize,
    /// Aggregate rate, messages/s.
    pub rate: f64,
}

/// Parses `M+C@R[,M+C@R…]`, e.g. `1+1@2000,1+1@5000,2+1@8000` (`R` may end in `k`:
/// `10k` = 10000). Spaces around items are ignored.
pub fn parse_steps(s: &str) -> Result<Vec<LadderStep>, Error> {
    let mut steps = Vec::new();
    for item in s.split(',') {
        let item = item.trim();
        let bad = |reason: &str| Error::BadStep {
            step: item.to_owned(),
            reason: reason.to_owned(),
        };
        if item.is_empty() {
            return Err(bad("empty step"));
        }
        let (pools, rate) = item.split_once('@').ok_or_else(|| bad("no @RATE"))?;
        let (m, c) = pools
            .split_once('+')
            .ok_or_else(|| bad("no MAILBOX+CORE"))?;
        let count = |x: &str, what: &str| -> Result<usize, Error> {
            match x.trim().parse::<usize>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(bad(&format!("{what} must be a whole number ≥ 1"))),
            }
        };
        let mailbox = count(m, "the mailbox instance count")?;
        let core = count(c, "the core instance count")?;
        let rate = rate.trim();
        let (num, mul) = match rate.strip_suffix(['k', 'K']) {
            Some(n) => (n, 1000.0),
            None => (rate, 1.0),
        };
        let rate = num
            .parse::<f64>()
            .ok()
            .map(|r| r * mul)
            .filter(|r| r.is_finite() && *r > 0.0)
            .ok_or_else(|| bad("the rate must be a positive number"))?;
        steps.push(LadderStep {
            mailbox,
            core,
            rate,
        });
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_numbers() {
        assert_eq!(group_thousands(10657.44, 1), "10,657.4");
        assert_eq!(group_thousands(999.0, 0), "999");
        assert_eq!(group_thousands(1_234_567.0, 0), "1,234,567");
        assert_eq!(group_thousands(-17.24, 1), "−17.2");
        assert_eq!(group_thousands(-0.01, 1), "0.0");
        assert_eq!(ms(91.34), "91.3ms");
        assert_eq!(ms(1.234), "1.23ms");
        assert_eq!(delta(225.35, 186.51), "−17.2%");
        assert_eq!(delta(0.0, 1.0), "—");
        assert_eq!(pct(100.0), "100%");
        assert_eq!(pct(99.3), "99.3%");
        assert_eq!(pct(99.95), "99.95%");
        assert_eq!(calls_per_msg(1.0204), "1.020");
        assert_eq!(calls_per_msg(0.0001), "<0.001");
        assert_eq!(calls_per_msg(0.0), "0.000");
    }

    #[test]
    fn rho_sizing() {
        assert_eq!(RunReport::instances_for_rho(4, 85.8), 6);
        assert_eq!(RunReport::instances_for_rho(8, 67.3), 9);
        assert_eq!(RunReport::instances_for_rho(1, 0.0), 1);
        assert_eq!(RunReport::instances_for_rho(1, 65.0), 1);
    }
}
