//! The result of a run: [`LuaBenchReport`] (medians of server-side µs per `EVALSHA`), built
//! from the measured labels by [`build_report`], and its two outputs, the human-readable
//! table ([`LuaBenchReport::to_table`]) and JSON ([`LuaBenchReport::to_json`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::checks::{BLOB_FULL_KEY, CHECKS};
use super::items::BATCH_RECORDS;

/// Layout names, as used in the report.
const V1: &str = "packed-v1";
const V2: &str = "packed-v2";

/// Result of one run: medians of server-side µs per `EVALSHA` call.
#[derive(Debug, Clone, Serialize)]
pub struct LuaBenchReport {
    /// `redis_version` of the measured server.
    pub redis_version: String,
    /// `return 0`.
    pub noop_evalsha_us: f64,
    /// Script name (file name without `.lua`) → `{"packed-v1": µs, "packed-v2": µs}`.
    /// `advance_log_watermarks` is per call of [`BATCH_RECORDS`] records.
    pub scripts: BTreeMap<String, BTreeMap<String, f64>>,
    /// `two_sub`, `rep`, `byte_loop`, `length`: µs of the check itself (HGET + check minus
    /// HGET only; may be slightly negative when the check costs less than the noise).
    pub uniform_checks_us: BTreeMap<String, f64>,
    /// Measured rounds per item.
    pub rounds: usize,
    /// Calls per round.
    pub calls_per_round: usize,
    /// Raw µs of the uniform-check scripts and their baselines (`hget_1216`, `hget_19`).
    #[serde(skip)]
    uniform_raw_us: BTreeMap<String, f64>,
}

/// The report of one run from its medians (item label → µs per call): scripts by layout, the
/// uniform checks net of their HGET-only baseline.
pub(super) fn build_report(
    redis_version: String,
    m: &BTreeMap<String, f64>,
    rounds: usize,
    calls_per_round: usize,
) -> LuaBenchReport {
    let mut scripts: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for (label, &us) in m {
        if let Some((script, layout)) = label.split_once('/') {
            scripts
                .entry(script.to_string())
                .or_default()
                .insert(layout.to_string(), us);
        }
    }
    let mut uniform_checks_us = BTreeMap::new();
    let mut uniform_raw_us = BTreeMap::new();
    for name in ["hget_1216", "hget_19"] {
        uniform_raw_us.insert(name.to_string(), m[name]);
    }
    for (name, _, key) in CHECKS {
        let base = if key == BLOB_FULL_KEY {
            m["hget_1216"]
        } else {
            m["hget_19"]
        };
        uniform_raw_us.insert(name.to_string(), m[name]);
        uniform_checks_us.insert(name.to_string(), m[name] - base);
    }
    LuaBenchReport {
        redis_version,
        noop_evalsha_us: m["noop"],
        scripts,
        uniform_checks_us,
        rounds,
        calls_per_round,
        uniform_raw_us,
    }
}

/// Script order of the table (the ADR's order).
const SCRIPT_ORDER: [&str; 5] = [
    "materialize_fresh_single_recipient",
    "advance_log_watermark",
    "advance_log_watermarks",
    "read_log_watermarks",
    "gc_completed_dispatch",
];

impl LuaBenchReport {
    /// Raw µs of the uniform-check scripts (HGET + check) and of their HGET-only baselines
    /// (`hget_1216`, `hget_19`); `uniform_checks_us` is the difference.
    pub fn uniform_raw_us(&self) -> &BTreeMap<String, f64> {
        &self.uniform_raw_us
    }

    /// A human-readable table of the report.
    pub fn to_table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "Lua micro-benchmark — redis {}, {} calls/round, median of {} rounds,\n\
             server-side µs per EVALSHA call (INFO commandstats)\n",
            self.redis_version, self.calls_per_round, self.rounds
        );
        let w = SCRIPT_ORDER.iter().map(|s| s.len()).max().unwrap_or(0) + 2;
        let _ = writeln!(
            t,
            "{:<w$} {:>13} {:>13} {:>9}",
            "script", "packed-v1 µs", "packed-v2 µs", "v2/v1"
        );
        let _ = writeln!(t, "{}", "-".repeat(w + 38));
        let get = |s: &str, l: &str| self.scripts.get(s).and_then(|m| m.get(l)).copied();
        let names = SCRIPT_ORDER
            .iter()
            .map(|s| s.to_string())
            .chain(
                self.scripts
                    .keys()
                    .filter(|k| !SCRIPT_ORDER.contains(&k.as_str()))
                    .cloned(),
            )
            .collect::<Vec<_>>();
        for name in &names {
            let (v1, v2) = (get(name, V1), get(name, V2));
            let _ = writeln!(
                t,
                "{:<w$} {:>13} {:>13} {:>9}",
                name,
                fmt_us(v1),
                fmt_us(v2),
                fmt_ratio(v1, v2)
            );
            if name == "advance_log_watermarks" {
                let per = |x: Option<f64>| x.map(|v| v / BATCH_RECORDS as f64);
                let _ = writeln!(
                    t,
                    "{:<w$} {:>13} {:>13}",
                    format!("  per record ({BATCH_RECORDS}/call)"),
                    fmt_us(per(v1)),
                    fmt_us(per(v2)),
                );
            }
        }
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "no-op EVALSHA (return 0): {:.2} µs",
            self.noop_evalsha_us
        );
        let hot = SCRIPT_ORDER[0];
        let ratio = |x: Option<f64>| match x {
            Some(v) if self.noop_evalsha_us > 0.0 => format!("{:.1}×", v / self.noop_evalsha_us),
            _ => "-".into(),
        };
        let net = |x: Option<f64>| match x {
            Some(v) => format!("{:.2}", v - self.noop_evalsha_us),
            None => "-".into(),
        };
        let _ = writeln!(
            t,
            "hot path ({hot}) / no-op: packed-v1 {}, packed-v2 {}; \
             above no-op: packed-v1 {} µs, packed-v2 {} µs",
            ratio(get(hot, V1)),
            ratio(get(hot, V2)),
            net(get(hot, V1)),
            net(get(hot, V2)),
        );
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "uniform checks (HGET + check; check = raw − HGET-only baseline)"
        );
        let _ = writeln!(
            t,
            "{:<28} {:>10} {:>12} {:>10}",
            "check", "raw µs", "baseline µs", "check µs"
        );
        let _ = writeln!(t, "{}", "-".repeat(63));
        for (name, _, key) in CHECKS {
            let (label, base) = if key == BLOB_FULL_KEY {
                (format!("{name} (1216-byte blob)"), "hget_1216")
            } else {
                (format!("{name} (19-byte blob)"), "hget_19")
            };
            let _ = writeln!(
                t,
                "{:<28} {:>10} {:>12} {:>10}",
                label,
                fmt_us(self.uniform_raw_us.get(name).copied()),
                fmt_us(self.uniform_raw_us.get(base).copied()),
                fmt_us(self.uniform_checks_us.get(name).copied()),
            );
        }
        t
    }

    /// The report as JSON:
    /// `{"redis_version", "calls_per_round", "rounds", "noop_evalsha_us",
    /// "scripts": {name: {"packed-v1", "packed-v2"}},
    /// "uniform_checks_us": {"two_sub", "rep", "byte_loop", "length"}}`
    /// (`calls_per_round` and `rounds` are missing from reports written before they were added,
    /// e.g. `docs/perf/lua.json`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "redis_version": self.redis_version,
            "calls_per_round": self.calls_per_round,
            "rounds": self.rounds,
            "noop_evalsha_us": self.noop_evalsha_us,
            "scripts": self.scripts,
            "uniform_checks_us": self.uniform_checks_us,
        })
    }
}

fn fmt_us(x: Option<f64>) -> String {
    match x {
        Some(v) => format!("{v:.2}"),
        None => "-".into(),
    }
}

fn fmt_ratio(v1: Option<f64>, v2: Option<f64>) -> String {
    match (v1, v2) {
        (Some(a), Some(b)) if a > 0.0 => format!("{:.2}", b / a),
        _ => "-".into(),
    }
}
