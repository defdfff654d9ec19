//! Server-side counters of one Redis instance: `INFO commandstats`, `INFO cpu`, `INFO stats`,
//! read with retries ([`ReadPolicy`]): a read that still fails is reported as missing, never
//! as the failure of the run.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;
use tokio::time::Instant;

use super::Error;

/// How a server-side figure is read at each sampling point (`INFO` of a Redis instance, a
/// gateway's `/metrics`): up to `tries` attempts, each bounded by `timeout`, with a pause of
/// `backoff` after the first failure, doubling up to `max_backoff`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadPolicy {
    /// Attempts (at least 1).
    pub tries: u32,
    /// Limit of one attempt (connect included).
    pub timeout: Duration,
    /// Pause after the first failed attempt.
    pub backoff: Duration,
    /// Largest pause.
    pub max_backoff: Duration,
}

impl Default for ReadPolicy {
    /// 3 tries of at most 2 s each, 200 ms then 1 s apart.
    fn default() -> Self {
        ReadPolicy {
            tries: 3,
            timeout: Duration::from_secs(2),
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl ReadPolicy {
    /// Runs `attempt` (given the attempt number, from 0) until it succeeds or `tries` attempts
    /// have failed or timed out; the error is the last one, with the attempt count.
    pub(crate) async fn run<T, F, Fut>(&self, mut attempt: F) -> Result<T, String>
    where
        F: FnMut(u32) -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        let tries = self.tries.max(1);
        let mut pause = self.backoff;
        let mut last = String::new();
        for k in 0..tries {
            if k > 0 {
                tokio::time::sleep(pause).await;
                pause = (pause * 5).min(self.max_backoff);
            }
            match tokio::time::timeout(self.timeout, attempt(k)).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => last = e,
                Err(_) => last = format!("no answer within {:?}", self.timeout),
            }
        }
        Err(format!(
            "{last} ({tries} {})",
            if tries == 1 { "try" } else { "tries" }
        ))
    }
}

/// One command's counters (`cmdstat_<name>`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct CmdCounter {
    pub calls: u64,
    pub usec: u64,
}

/// Counters read at one instant.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    pub at: Instant,
    /// `cmdstat_evalsha` calls.
    pub evalsha_calls: u64,
    /// `cmdstat_evalsha` usec.
    pub evalsha_usec: u64,
    /// `used_cpu_sys + used_cpu_user`, seconds.
    pub cpu_s: f64,
    /// `total_commands_processed`.
    pub commands: u64,
    /// Every `cmdstat_<name>` line, by name (`evalsha`, `xreadgroup`, `client|setinfo`, …).
    pub by_command: BTreeMap<String, CmdCounter>,
}

/// One instance being watched.
pub(crate) struct Watched {
    pub pool: &'static str,
    pub index: usize,
    pub url: String,
    policy: ReadPolicy,
    /// `None` after a failed read: the next read connects again.
    conn: Option<MultiplexedConnection>,
}

impl Watched {
    /// Connects (one attempt per try of `policy`): an instance that cannot be reached at the
    /// start is an error of the options, not a missing figure.
    pub async fn connect(
        pool: &'static str,
        index: usize,
        url: &str,
        policy: ReadPolicy,
    ) -> Result<Watched, Error> {
        let client = redis::Client::open(url).map_err(|source| Error::Redis {
            url: tidemark_store::redact_url(url),
            source,
        })?;
        let conn = policy
            .run(|_| connect(&client, policy.timeout))
            .await
            .map_err(|why| Error::Unreadable(format!("redis {}: {why}", redact(url))))?;
        Ok(Watched {
            pool,
            index,
            url: url.to_owned(),
            policy,
            conn: Some(conn),
        })
    }

    /// One reading, retried per the policy (a failed attempt drops the connection and the
    /// next one connects again); `Err` says why the figure is missing.
    pub async fn sample(&mut self) -> Result<Sample, String> {
        let policy = self.policy;
        let url = self.url.clone();
        let slot = &mut self.conn;
        let result = policy
            .run(|_| {
                let taken = slot.take();
                let url = url.clone();
                async move {
                    let mut conn = match taken {
                        Some(c) => c,
                        None => {
                            let client =
                                redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
                            connect(&client, policy.timeout).await?
                        }
                    };
                    // One INFO with three sections: the counters are read at (nearly) the
                    // same instant.
                    let text: String = redis::cmd("INFO")
                        .arg("commandstats")
                        .arg("cpu")
                        .arg("stats")
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok((parse_info(&text, Instant::now()), conn))
                }
            })
            .await;
        match result {
            Ok((sample, conn)) => {
                self.conn = Some(conn);
                Ok(sample)
            }
            Err(why) => Err(format!("redis {}: {why}", redact(&self.url))),
        }
    }
}

fn redact(url: &str) -> String {
    tidemark_store::redact_url(url)
}

/// A multiplexed connection whose connect and replies are bounded by `timeout` (the
/// crate's default reply limit, 500 ms, is what failed whole runs on a busy machine).
async fn connect(
    client: &redis::Client,
    timeout: Duration,
) -> Result<MultiplexedConnection, String> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .map_err(|e| e.to_string())
}

/// Parses the fields used from an `INFO` reply (missing fields read as 0: e.g. no
/// `cmdstat_evalsha` line before the first call), with [`crate::engine::parse_info`], the
/// one parser of the crate, and stamps it with `at`.
pub(crate) fn parse_info(text: &str, at: Instant) -> Sample {
    let parsed = crate::engine::parse_info(text);
    let (evalsha_calls, evalsha_usec) = parsed
        .by_command
        .get("evalsha")
        .copied()
        .unwrap_or_default();
    Sample {
        at,
        evalsha_calls,
        evalsha_usec,
        cpu_s: parsed.cpu_s,
        commands: parsed.commands,
        by_command: parsed
            .by_command
            .into_iter()
            .map(|(name, (calls, usec))| (name, CmdCounter { calls, usec }))
            .collect(),
    }
}

/// Differences between two samples of one instance.
#[derive(Debug, Clone, Default)]
pub(crate) struct Delta {
    pub wall_s: f64,
    pub evalsha_calls: u64,
    pub evalsha_usec: u64,
    pub cpu_s: f64,
    pub commands: u64,
    /// Per command (only those called in between).
    pub by_command: BTreeMap<String, CmdCounter>,
}

impl Delta {
    pub fn between(a: &Sample, b: &Sample) -> Delta {
        let mut by_command = BTreeMap::new();
        for (name, cb) in &b.by_command {
            let ca = a.by_command.get(name).copied().unwrap_or_default();
            let d = CmdCounter {
                calls: cb.calls.saturating_sub(ca.calls),
                usec: cb.usec.saturating_sub(ca.usec),
            };
            if d.calls > 0 {
                by_command.insert(name.clone(), d);
            }
        }
        Delta {
            wall_s: b.at.saturating_duration_since(a.at).as_secs_f64(),
            evalsha_calls: b.evalsha_calls.saturating_sub(a.evalsha_calls),
            evalsha_usec: b.evalsha_usec.saturating_sub(a.evalsha_usec),
            cpu_s: (b.cpu_s - a.cpu_s).max(0.0),
            commands: b.commands.saturating_sub(a.commands),
            by_command,
        }
    }

    pub fn cpu_pct(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.cpu_s / self.wall_s * 100.0
        } else {
            0.0
        }
    }

    pub fn ops_per_s(&self) -> f64 {
        if self.wall_s > 0.0 {
            self.commands as f64 / self.wall_s
        } else {
            0.0
        }
    }

    pub fn evalsha_us(&self) -> f64 {
        if self.evalsha_calls > 0 {
            self.evalsha_usec as f64 / self.evalsha_calls as f64
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_info() {
        let text = "# Commandstats\r\ncmdstat_get:calls=3,usec=4,usec_per_call=1.33,rejected_calls=0,failed_calls=0\r\n\
                    cmdstat_evalsha:calls=1000,usec=186510,usec_per_call=186.51,rejected_calls=0,failed_calls=0\r\n\
                    cmdstat_client|setinfo:calls=2,usec=1,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n\
                    \r\n# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:2.250000\r\nused_cpu_sys_children:9.0\r\n\
                    used_cpu_sys_main_thread:1.0\r\n\r\n# Stats\r\ntotal_commands_processed:4242\r\n";
        let s = parse_info(text, Instant::now());
        assert_eq!(
            (s.evalsha_calls, s.evalsha_usec, s.commands),
            (1000, 186_510, 4242)
        );
        assert!((s.cpu_s - 3.75).abs() < 1e-9);
        assert_eq!(
            s.by_command.keys().map(String::as_str).collect::<Vec<_>>(),
            ["client|setinfo", "evalsha", "get"]
        );
        assert_eq!(s.by_command["get"], CmdCounter { calls: 3, usec: 4 });
        let empty = parse_info("", s.at);
        assert_eq!((empty.evalsha_calls, empty.commands), (0, 0));

        let later = parse_info(
            "cmdstat_get:calls=3,usec=4\r\ncmdstat_evalsha:calls=1010,usec=186610\r\ncmdstat_xadd:calls=5,usec=50\r\n",
            s.at,
        );
        let d = Delta::between(&s, &later);
        assert_eq!(
            d.by_command.into_iter().collect::<Vec<_>>(),
            [
                (
                    "evalsha".to_owned(),
                    CmdCounter {
                        calls: 10,
                        usec: 100
                    }
                ),
                ("xadd".to_owned(), CmdCounter { calls: 5, usec: 50 }),
            ],
            "only what was called in between"
        );
    }

    #[tokio::test]
    async fn retries_then_reports_why() {
        let policy = ReadPolicy {
            tries: 3,
            timeout: Duration::from_millis(100),
            backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(50),
        };
        let mut calls = 0;
        let ok = policy
            .run(|k| {
                calls += 1;
                async move {
                    if k < 2 {
                        Err(format!("fail {k}"))
                    } else {
                        Ok(k)
                    }
                }
            })
            .await;
        assert_eq!((ok, calls), (Ok(2), 3));
        let err = policy
            .run(|k| async move { Err::<(), _>(format!("fail {k}")) })
            .await;
        assert_eq!(err.unwrap_err(), "fail 2 (3 tries)");
        let start = Instant::now();
        let err = policy
            .run(|_| std::future::pending::<Result<(), String>>())
            .await
            .unwrap_err();
        assert_eq!(err, "no answer within 100ms (3 tries)");
        // 3 × 100 ms of timeouts, 20 ms and 50 ms of pauses
        assert!(
            start.elapsed() >= Duration::from_millis(370),
            "{:?}",
            start.elapsed()
        );
    }
}
