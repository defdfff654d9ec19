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

/// One figure for each pool of Redis instances.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, serde::Deserialize)]
pub struct PoolPair {
    /// The mailbox instances.
    pub mailbox: f64,
    /// The core instances.
    pub core: f64,
}

/// One Redis instance over a run.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct InstanceStats {
    /// `mailbox` or `core`.
    pub pool: String,
    /// Index within its pool.
    pub index: usize,
    /// `redis://host:port/`.
    pub url: String,
    /// `EVALSHA` calls over the run and drain (A→C).
    pub evalsha_calls: u64,
    /// Server-side µs per `EVALSHA` (A→C).
    pub evalsha_us: f64,
    /// CPU % of this instance while sending (A→B; 100 = one core).
    pub cpu_pct: f64,
    /// Commands per second while sending (A→B).
    pub ops_per_s: f64,
    /// CPU seconds over the run and drain (A→C).
    pub cpu_s: f64,
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
    /// Server-side µs per `EVALSHA`, per pool (A→C).
    pub evalsha_us: PoolPair,
    /// Redis CPU %, mean over the pool's instances (A→B).
    pub redis_cpu_pct: PoolPair,
    /// Commands per second, summed over the pool (A→B).
    pub ops_per_s: PoolPair,
    /// Mailbox-pool CPU µs per delivered (message, recipient) pair (A→C).
    pub mailbox_cpu_us_per_msg: f64,
    /// How late the scheduler queued a send at worst (the generator's own lag), ms.
    pub max_send_lag_ms: f64,
    /// Errors by code.
    pub errors: BTreeMap<String, u64>,
    /// Every Redis instance.
    pub per_instance: Vec<InstanceStats>,
}

impl RunReport {
    /// `M+C`, e.g. `4+4`.
    pub fn instances_label(&self) -> String {
        format!("{}+{}", self.mailbox_instances, self.core_instances)
    }

    /// Instances of a pool that keep ρ ≤ [`TARGET_RHO`] at this rate:
    /// `ceil(instances × cpu_pct / 100 / 0.65)`, at least 1.
    pub fn instances_for_rho(instances: usize, cpu_pct: f64) -> usize {
        let need = (instances as f64 * cpu_pct / 100.0 / TARGET_RHO).ceil();
        if need.is_finite() && need >= 1.0 {
            need as usize
        } else {
            1
        }
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
    ("evalsha (mailbox)", |r| Some(r.evalsha_us.mailbox), us),
    ("mailbox Redis CPU", |r| Some(r.redis_cpu_pct.mailbox), pct),
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
    (
        "mailbox CPU per message",
        |r| Some(r.mailbox_cpu_us_per_msg),
        us,
    ),
    ("evalsha (core)", |r| Some(r.evalsha_us.core), us),
    ("core Redis CPU", |r| Some(r.redis_cpu_pct.core), pct),
];

/// ADR-0015's "Measured" table: one row per metric, one column per run, and a
/// `Δ v2 vs v1` column (relative change of packed-v2 against packed-v1, first run of each)
/// when both layouts are present. The last row, `errors`, has every error and refusal by
/// code (e.g. `overloaded`); `—` stands for a figure the report does not hold (older reports
/// have no `acked_per_s_while_sending`).
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
    for (name, get, fmt) in ROWS {
        let _ = write!(out, "| {name} |");
        for r in runs {
            let _ = write!(out, " {} |", or_dash(get(r), fmt));
        }
        if let Some((a, b)) = both {
            let d = get(a).zip(get(b)).map_or("—".into(), |(a, b)| delta(a, b));
            let _ = write!(out, " {d} |");
        }
        out.push('\n');
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
            pct(r.redis_cpu_pct.mailbox),
            pct(r.redis_cpu_pct.core),
            RunReport::instances_for_rho(r.mailbox_instances, r.redis_cpu_pct.mailbox),
            RunReport::instances_for_rho(r.core_instances, r.redis_cpu_pct.core),
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
    }

    #[test]
    fn rho_sizing() {
        assert_eq!(RunReport::instances_for_rho(4, 85.8), 6);
        assert_eq!(RunReport::instances_for_rho(8, 67.3), 9);
        assert_eq!(RunReport::instances_for_rho(1, 0.0), 1);
        assert_eq!(RunReport::instances_for_rho(1, 65.0), 1);
    }
}
