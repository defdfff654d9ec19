//! What the engine benchmarks ([`crate::catchup`], [`crate::commit`]) share: a fresh local
//! set of redis-servers and its [`ShardMap`], `INFO` samples of every instance (CPU, commands,
//! per-command `commandstats`), this process's CPU time, and the JSON file of runs.
//!
//! Neither benchmark opens a WebSocket: they drive the engine's own code (the materializer
//! workers, the gateway's commit path) in this process, so "the tidemark process" in their
//! reports is this process.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tidemark_redis_proc::{RedisOptions, RedisProcess};
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{ShardMap, Topology};
use tokio::time::Instant;

/// Errors of the engine benchmarks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options cannot be run.
    #[error("invalid options: {0}")]
    Invalid(String),
    /// A redis-server could not be started.
    #[error(transparent)]
    RedisProc(#[from] tidemark_redis_proc::Error),
    /// The deployment could not be prepared (topology, identity, watermarks).
    #[error(transparent)]
    Run(#[from] tidemark_server::run::Error),
    /// A store call failed.
    #[error(transparent)]
    Store(#[from] tidemark_store::Error),
    /// A materializer worker failed.
    #[error(transparent)]
    Materializer(#[from] tidemark_server::materializer::Error),
    /// A gateway component failed to start.
    #[error(transparent)]
    Gateway(#[from] tidemark_server::gateway::GatewayError),
    /// The topology is not valid.
    #[error(transparent)]
    Topology(#[from] tidemark_store::topology::TopologyError),
    /// `INFO` of an instance failed.
    #[error("redis {url}: {source}")]
    Redis {
        /// The instance (without password).
        url: String,
        /// Why.
        #[source]
        source: redis::RedisError,
    },
    /// The run did not complete as it should (a shard never caught up, a commit failed…).
    #[error("{0}")]
    Failed(String),
    /// Files.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// JSON.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// A fresh local deployment without the service: `core` + `mailbox` redis-servers (AOF on,
/// as `tidemark up` runs them) under a temporary directory, the deployment identity recorded
/// and every shard's watermark initialised. Everything is removed on drop.
pub struct LocalRedis {
    /// The core instances.
    pub core: Vec<RedisProcess>,
    /// The mailbox instances.
    pub mailbox: Vec<RedisProcess>,
    /// The topology over them.
    pub map: ShardMap,
    // dropped last: the servers' data dirs live in it
    _dir: tempfile::TempDir,
}

impl LocalRedis {
    /// Starts the instances and prepares the shards (as `tidemark up` does before serving).
    pub async fn start(
        core: usize,
        mailbox: usize,
        shards: u32,
        layout: Layout,
        appendfsync: &str,
    ) -> Result<LocalRedis, Error> {
        if core == 0 || mailbox == 0 || shards == 0 {
            return Err(Error::Invalid(
                "--core, --mailbox and --shards must be at least 1".into(),
            ));
        }
        let dir = tempfile::Builder::new()
            .prefix("tidemark-engine-")
            .tempdir()?;
        let start = |name: String| {
            RedisProcess::start_with(RedisOptions {
                data_dir: Some(dir.path().join(name)),
                appendonly: true,
                appendfsync: appendfsync.to_string(),
                ..Default::default()
            })
        };
        let core: Vec<RedisProcess> = (0..core)
            .map(|i| start(format!("core-{i}")))
            .collect::<Result<_, _>>()?;
        let mailbox: Vec<RedisProcess> = (0..mailbox)
            .map(|i| start(format!("mailbox-{i}")))
            .collect::<Result<_, _>>()?;
        let map = Topology::new(
            shards,
            layout,
            core.iter().map(RedisProcess::url).collect(),
            mailbox.iter().map(RedisProcess::url).collect(),
        )
        .validate()?;
        tidemark_server::run::check_identity(&map).await?;
        tidemark_server::run::init_missing(&map).await?;
        Ok(LocalRedis {
            core,
            mailbox,
            map,
            _dir: dir,
        })
    }

    /// Watchers of every instance: the core pool first, then the mailbox pool.
    pub async fn watch(&self) -> Result<Vec<Watched>, Error> {
        let mut out = Vec::new();
        for (i, p) in self.core.iter().enumerate() {
            out.push(Watched::connect("core", i, &p.url()).await?);
        }
        for (i, p) in self.mailbox.iter().enumerate() {
            out.push(Watched::connect("mailbox", i, &p.url()).await?);
        }
        Ok(out)
    }
}

/// One Redis instance whose `INFO` is sampled.
pub struct Watched {
    /// `core` or `mailbox`.
    pub pool: &'static str,
    /// Index in its pool.
    pub index: usize,
    url: String,
    conn: redis::aio::MultiplexedConnection,
}

/// Counters of one instance at one instant.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// `used_cpu_sys + used_cpu_user`, seconds.
    pub cpu_s: f64,
    /// `total_commands_processed`.
    pub commands: u64,
    /// `commandstats`: command → (calls, usec).
    pub by_command: BTreeMap<String, (u64, u64)>,
}

impl Watched {
    /// Connects to `url` (only `INFO` is sent on it).
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
            url: url.to_string(),
            conn,
        })
    }

    /// The instance's URL (with its password: redact before printing).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// `INFO commandstats cpu stats`, parsed.
    pub async fn sample(&mut self) -> Result<Sample, Error> {
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
        Ok(parse_info(&text))
    }
}

/// The fields used from an `INFO` reply (missing ones read as 0).
pub fn parse_info(text: &str) -> Sample {
    let mut s = Sample::default();
    for line in text.lines() {
        let Some((key, value)) = line.trim_end().split_once(':') else {
            continue;
        };
        if let Some(cmd) = key.strip_prefix("cmdstat_") {
            let (mut calls, mut usec) = (0, 0);
            for kv in value.split(',') {
                match kv.split_once('=') {
                    Some(("calls", v)) => calls = v.parse().unwrap_or(0),
                    Some(("usec", v)) => usec = v.parse().unwrap_or(0),
                    _ => {}
                }
            }
            s.by_command.insert(cmd.to_string(), (calls, usec));
            continue;
        }
        match key {
            "used_cpu_sys" | "used_cpu_user" => s.cpu_s += value.parse::<f64>().unwrap_or(0.0),
            "total_commands_processed" => s.commands = value.parse().unwrap_or(0),
            _ => {}
        }
    }
    s
}

/// Samples every watched instance, in order.
pub async fn sample_all(watched: &mut [Watched]) -> Result<Vec<Sample>, Error> {
    let mut out = Vec::with_capacity(watched.len());
    for w in watched {
        out.push(w.sample().await?);
    }
    Ok(out)
}

/// What one instance did between two samples, charged to `units` (records, commits).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct InstanceUse {
    /// `core` or `mailbox`.
    pub pool: String,
    /// Index in its pool.
    pub index: usize,
    /// Seconds between the samples.
    pub wall_s: f64,
    /// CPU seconds (`used_cpu_sys + used_cpu_user`).
    pub cpu_s: f64,
    /// CPU % of one core over the interval (missing when the samples were not apart).
    pub cpu_pct: Option<f64>,
    /// CPU µs per unit (missing when there was no unit to charge it to).
    pub cpu_us_per_unit: Option<f64>,
    /// Commands processed per unit (missing when there was no unit).
    pub commands_per_unit: Option<f64>,
    /// Per command: calls per unit and server-side µs per call (`commandstats`).
    pub commands: BTreeMap<String, CommandUse>,
}

/// One command's share of an interval.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CommandUse {
    /// Calls in the interval.
    #[serde(default)]
    pub calls: u64,
    /// Calls per unit (6 decimals; missing when there was no unit).
    pub calls_per_unit: Option<f64>,
    /// Server-side µs per call.
    pub us_per_call: f64,
}

impl InstanceUse {
    /// The use of `w` from `a` to `b` (`wall_s` apart), charged to `units`.
    pub fn between(w: &Watched, a: &Sample, b: &Sample, wall_s: f64, units: u64) -> InstanceUse {
        InstanceUse::of(w.pool, w.index, a, b, wall_s, units)
    }

    /// The use of instance `index` of `pool` from `a` to `b` (`wall_s` apart), charged to
    /// `units`; a figure per unit is missing when `units` is 0.
    pub fn of(
        pool: &str,
        index: usize,
        a: &Sample,
        b: &Sample,
        wall_s: f64,
        units: u64,
    ) -> InstanceUse {
        // a figure per unit is missing, not 0, when there was nothing to charge it to
        let per = |x: f64| (units > 0).then(|| x / units as f64);
        let cpu_s = (b.cpu_s - a.cpu_s).max(0.0);
        let mut commands = BTreeMap::new();
        for (name, &(calls, usec)) in &b.by_command {
            let (c0, u0) = a.by_command.get(name).copied().unwrap_or((0, 0));
            let (dc, du) = (calls.saturating_sub(c0), usec.saturating_sub(u0));
            if dc == 0 || name == "info" {
                continue;
            }
            commands.insert(
                name.clone(),
                CommandUse {
                    calls: dc,
                    calls_per_unit: per(dc as f64).map(|x| (x * 1e6).round() / 1e6),
                    us_per_call: round3(du as f64 / dc as f64),
                },
            );
        }
        InstanceUse {
            pool: pool.to_string(),
            index,
            wall_s: round3(wall_s),
            cpu_s: round3(cpu_s),
            cpu_pct: (wall_s > 0.0).then(|| round3(cpu_s / wall_s * 100.0)),
            cpu_us_per_unit: per(cpu_s * 1e6).map(round3),
            commands_per_unit: per(b.commands.saturating_sub(a.commands) as f64).map(round3),
            commands,
        }
    }
}

/// This process's CPU time (user + system), seconds.
pub fn process_cpu_s() -> f64 {
    // SAFETY: getrusage only writes the struct passed by pointer.
    unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut u) != 0 {
            return 0.0;
        }
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        tv(u.ru_utime) + tv(u.ru_stime)
    }
}

/// A process CPU reading and the wall clock, taken together.
#[derive(Debug, Clone, Copy)]
pub struct ProcessMark {
    at: Instant,
    cpu_s: f64,
}

impl ProcessMark {
    /// Now.
    pub fn now() -> ProcessMark {
        ProcessMark {
            at: Instant::now(),
            cpu_s: process_cpu_s(),
        }
    }

    /// (wall seconds, CPU seconds) since `self`.
    pub fn since(&self) -> (f64, f64) {
        (
            self.at.elapsed().as_secs_f64(),
            (process_cpu_s() - self.cpu_s).max(0.0),
        )
    }
}

/// The 1-minute load average (`/proc/loadavg`), missing when unreadable: the engine
/// benchmarks share the machine with whatever else runs, and record how busy it was.
pub fn load_avg() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
}

/// Units per second one instance would reach at 100 % of one core, at the CPU per unit
/// measured (`1e6 / cpu_us_per_unit`; missing when nothing was measured).
pub fn bound_per_s(cpu_us_per_unit: Option<f64>) -> Option<f64> {
    cpu_us_per_unit
        .filter(|&us| us > 0.0)
        .map(|us| round3(1e6 / us))
}

/// `x / n`, missing when `n` is 0 (a figure per unit with no unit is not 0).
pub fn per_unit(x: f64, n: u64) -> Option<f64> {
    (n > 0).then(|| round3(x / n as f64))
}

/// A figure that may be missing, as text: `fmt` of it, or `—`.
pub fn or_dash(x: Option<f64>, fmt: impl Fn(f64) -> String) -> String {
    x.map_or_else(|| "—".to_owned(), fmt)
}

/// `x` rounded to 3 decimals (the JSON files stay readable).
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Writes `run` to `path` as `{"runs":[…]}`; with `append`, after the runs the file already
/// holds (a missing file is created).
pub fn write_runs<T: Serialize>(path: &Path, run: &T, append: bool) -> Result<(), Error> {
    let mut runs: Vec<serde_json::Value> = Vec::new();
    if append && path.exists() {
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        match v.get("runs").and_then(|r| r.as_array()) {
            Some(r) => runs = r.clone(),
            None => {
                return Err(Error::Invalid(format!(
                    "{}: not a {{\"runs\":[…]}} file",
                    path.display()
                )))
            }
        }
    }
    runs.push(serde_json::to_value(run)?);
    let text = serde_json::to_string_pretty(&serde_json::json!({ "runs": runs }))?;
    std::fs::write(path, text + "\n")?;
    Ok(())
}

/// Which engine benchmark wrote a `{"runs":[…]}` file: the `bench` field of its first run
/// (`catchup`, `commit`); `None` for a load report (no such field) or anything else.
pub fn report_kind(text: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let kind = v.get("runs")?.get(0)?.get("bench")?.as_str()?;
    matches!(kind, "catchup" | "commit").then(|| kind.to_string())
}

/// The runs of an engine report file (`{"runs":[…]}`).
pub fn runs_from_json<T: for<'de> Deserialize<'de>>(text: &str) -> Result<Vec<T>, Error> {
    #[derive(Deserialize)]
    struct File<T> {
        runs: Vec<T>,
    }
    Ok(serde_json::from_str::<File<T>>(text)?.runs)
}

/// A progress bar on stderr (hidden when `show` is false).
pub fn bar(show: bool, len: u64, template: &str) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::with_draw_target(
        Some(len),
        indicatif::ProgressDrawTarget::stderr(),
    );
    pb.set_style(
        indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb
}

/// `n` with thousands separators.
pub fn thousands(n: f64) -> String {
    crate::load::group_thousands(n, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_info() {
        let text = "# Commandstats\r\ncmdstat_get:calls=3,usec=4,usec_per_call=1.33,rejected_calls=0,failed_calls=0\r\n\
                    cmdstat_evalsha:calls=1000,usec=186510,usec_per_call=186.51,rejected_calls=0,failed_calls=0\r\n\
                    \r\n# CPU\r\nused_cpu_sys:1.500000\r\nused_cpu_user:2.250000\r\nused_cpu_sys_children:9.0\r\n\
                    \r\n# Stats\r\ntotal_commands_processed:4242\r\n";
        let s = parse_info(text);
        assert_eq!(s.commands, 4242);
        assert_eq!(s.by_command["evalsha"], (1000, 186_510));
        assert_eq!(s.by_command["get"], (3, 4));
        assert!((s.cpu_s - 3.75).abs() < 1e-9);
    }
}
