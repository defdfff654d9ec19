//! The measurement: one isolated round of an item is `CONFIG RESETSTAT`, `calls_per_round`
//! calls pipelined [`PIPELINE`] at a time (every reply checked), then `INFO commandstats`,
//! whose `cmdstat_evalsha` gives the server-side µs per call; the count must match exactly
//! (no other client may run `EVALSHA` meanwhile). [`measure`] loads every script, runs one
//! warm-up round of every item, then interleaves the measured rounds (round r of every item
//! before round r+1 of any) and keeps each item's median.

use std::collections::BTreeMap;

use redis::aio::MultiplexedConnection;
use redis::{RedisResult, Value};

use super::checks::write_blobs;
use super::items::{items, Item};
use super::{Error, MailboxStore};

/// Commands per pipeline.
pub const PIPELINE: usize = 500;

/// `cmdstat_evalsha` of `INFO commandstats`: (calls, usec, failed + rejected calls).
pub(super) fn parse_evalsha_stats(info: &str) -> Option<(u64, u64, u64)> {
    let line = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("cmdstat_evalsha:"))?;
    let mut calls = None;
    let mut usec = None;
    let mut errors = 0;
    for kv in line.split(',') {
        let (k, v) = kv.split_once('=')?;
        match k {
            "calls" => calls = v.parse().ok(),
            "usec" => usec = v.parse().ok(),
            "failed_calls" | "rejected_calls" => errors += v.parse::<u64>().ok()?,
            _ => {}
        }
    }
    Some((calls?, usec?, errors))
}

/// A field of `INFO server`.
pub(super) fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|l| {
        l.trim()
            .strip_prefix(field)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::to_string)
    })
}

/// Median; the mean of the two middle values for an even count.
pub(super) fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The connections of a run and its calls per round.
pub(super) struct Bench {
    pub(super) conn: MultiplexedConnection,
    pub(super) store: MailboxStore,
    pub(super) calls: usize,
}

/// How a round's calls ended.
enum RoundEnd {
    Done,
    NoScript,
}

impl Bench {
    /// `SCRIPT LOAD`s the item's script, checking the SHA1 it answers.
    async fn load(&mut self, item: &Item) -> Result<(), Error> {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&item.source)
            .query_async(&mut self.conn)
            .await?;
        if sha != item.sha {
            return Err(Error::ScriptLoad {
                item: item.label.clone(),
                got: sha,
                expected: item.sha.clone(),
            });
        }
        Ok(())
    }

    /// Runs the round's calls pipelined and checks every reply.
    async fn calls(&mut self, item: &Item) -> Result<RoundEnd, Error> {
        let mut i = 0;
        while i < self.calls {
            let end = (i + PIPELINE).min(self.calls);
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for k in i..end {
                pipe.add_command(item.cmd(k));
            }
            let replies: Vec<RedisResult<Value>> = pipe.query_async(&mut self.conn).await?;
            for (k, r) in (i..end).zip(&replies) {
                match r {
                    Ok(v) => item.check(k, v)?,
                    Err(e) if e.code() == Some("NOSCRIPT") => return Ok(RoundEnd::NoScript),
                    Err(e) => {
                        return Err(Error::NotApplied {
                            item: item.label.clone(),
                            call: k,
                            expected: "a reply".into(),
                            reply: e.to_string(),
                        })
                    }
                }
            }
            i = end;
        }
        Ok(RoundEnd::Done)
    }

    /// One isolated round: prepare, reset stats, run, read µs per call.
    async fn round(&mut self, item: &Item) -> Result<f64, Error> {
        for _attempt in 0..2 {
            item.prepare(&mut self.store, &mut self.conn).await?;
            redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async::<()>(&mut self.conn)
                .await?;
            if let RoundEnd::NoScript = self.calls(item).await? {
                // The script cache was emptied (restart, SCRIPT FLUSH): load and redo the round.
                self.load(item).await?;
                continue;
            }
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut self.conn)
                .await?;
            let stats_err = |detail: String| Error::Stats {
                item: item.label.clone(),
                detail,
            };
            let (calls, usec, errors) = parse_evalsha_stats(&info)
                .ok_or_else(|| stats_err("no parsable cmdstat_evalsha line".into()))?;
            if calls != self.calls as u64 || errors != 0 {
                return Err(stats_err(format!(
                    "counted {calls} EVALSHA calls ({errors} failed/rejected), made {}: \
                     another client is using the server",
                    self.calls
                )));
            }
            return Ok(usec as f64 / calls as f64);
        }
        Err(Error::NoScript {
            item: item.label.clone(),
        })
    }
}

/// Sets up, warms up, and measures every item; label → median µs per call.
pub(super) async fn measure(
    bench: &mut Bench,
    rounds: usize,
) -> Result<BTreeMap<String, f64>, Error> {
    let items = items();
    write_blobs(&mut bench.conn).await?;

    for item in &items {
        bench.load(item).await?;
    }
    // Warm-up round of every item, discarded.
    for item in &items {
        bench.round(item).await?;
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); items.len()];
    for _ in 0..rounds {
        for (item, s) in items.iter().zip(samples.iter_mut()) {
            s.push(bench.round(item).await?);
        }
    }
    Ok(items
        .iter()
        .zip(&samples)
        .map(|(item, s)| (item.label.clone(), median(s)))
        .collect())
}
