//! Server-side counters of one Redis instance: `INFO commandstats`, `INFO cpu`, `INFO stats`.

use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

use super::Error;

/// Counters read at one instant.
#[derive(Debug, Clone, Copy)]
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
}

/// One instance being watched.
pub(crate) struct Watched {
    pub pool: &'static str,
    pub index: usize,
    pub url: String,
    conn: MultiplexedConnection,
}

impl Watched {
    pub async fn connect(pool: &'static str, index: usize, url: &str) -> Result<Watched, Error> {
        let err = |source| Error::Redis {
            url: tidemark_store::redact_url(url),
            source,
        };
        let client = redis::Client::open(url).map_err(err)?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(err)?;
        Ok(Watched {
            pool,
            index,
            url: url.to_owned(),
            conn,
        })
    }

    pub async fn sample(&mut self) -> Result<Sample, Error> {
        // One INFO with three sections: the counters are read at (nearly) the same instant.
        let text: String = redis::cmd("INFO")
            .arg("commandstats")
            .arg("cpu")
            .arg("stats")
            .query_async(&mut self.conn)
            .await
            .map_err(|source| Error::Redis {
                url: tidemark_store::redact_url(&self.url),
                source,
            })?;
        let at = Instant::now();
        Ok(parse_info(&text, at))
    }
}

/// Parses the fields used from an `INFO` reply (missing fields read as 0: e.g. no
/// `cmdstat_evalsha` line before the first call).
pub(crate) fn parse_info(text: &str, at: Instant) -> Sample {
    let mut s = Sample {
        at,
        evalsha_calls: 0,
        evalsha_usec: 0,
        cpu_s: 0.0,
        commands: 0,
    };
    for line in text.lines() {
        let Some((key, value)) = line.trim_end().split_once(':') else {
            continue;
        };
        match key {
            "cmdstat_evalsha" => {
                for kv in value.split(',') {
                    match kv.split_once('=') {
                        Some(("calls", v)) => s.evalsha_calls = v.parse().unwrap_or(0),
                        Some(("usec", v)) => s.evalsha_usec = v.parse().unwrap_or(0),
                        _ => {}
                    }
                }
            }
            "used_cpu_sys" | "used_cpu_user" => s.cpu_s += value.parse::<f64>().unwrap_or(0.0),
            "total_commands_processed" => s.commands = value.parse().unwrap_or(0),
            _ => {}
        }
    }
    s
}

/// Differences between two samples of one instance.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Delta {
    pub wall_s: f64,
    pub evalsha_calls: u64,
    pub evalsha_usec: u64,
    pub cpu_s: f64,
    pub commands: u64,
}

impl Delta {
    pub fn between(a: &Sample, b: &Sample) -> Delta {
        Delta {
            wall_s: b.at.saturating_duration_since(a.at).as_secs_f64(),
            evalsha_calls: b.evalsha_calls.saturating_sub(a.evalsha_calls),
            evalsha_usec: b.evalsha_usec.saturating_sub(a.evalsha_usec),
            cpu_s: (b.cpu_s - a.cpu_s).max(0.0),
            commands: b.commands.saturating_sub(a.commands),
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
                    \r\n# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:2.250000\r\nused_cpu_sys_children:9.0\r\n\
                    used_cpu_sys_main_thread:1.0\r\n\r\n# Stats\r\ntotal_commands_processed:4242\r\n";
        let s = parse_info(text, Instant::now());
        assert_eq!(
            (s.evalsha_calls, s.evalsha_usec, s.commands),
            (1000, 186_510, 4242)
        );
        assert!((s.cpu_s - 3.75).abs() < 1e-9);
        let empty = parse_info("", s.at);
        assert_eq!((empty.evalsha_calls, empty.commands), (0, 0));
    }
}
