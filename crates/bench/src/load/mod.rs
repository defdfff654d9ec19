//! The end-to-end load generator of ADR-0015's "Measured" table (SYSTEM.md §6).
//!
//! [`run_load`] drives `clients` WebSocket clients at an aggregate `rate` (messages/s) for
//! `duration` against a deployment — by default a fresh local one per layout
//! ([`Target::Local`]: its own redis-servers under a new temporary data dir, the gateway and
//! the materializers in this process) — and returns one [`RunReport`] per layout.
//! [`markdown_table`] lays them out like the ADR, [`to_json`] gives the machine-readable form,
//! [`run_ladder`] / [`ladder_table`] repeat it over (mailbox, core, rate) steps;
//! [`run_load_isolated`] / [`run_ladder_isolated`] run each layout and step in a child
//! process of its own.
//!
//! # Method
//!
//! - **Open loop.** Every client connects first. Then message `i` has the intended send time
//!   `t0 + i / rate`; one scheduler task waits for that instant and queues the `send` from
//!   client `i % clients` to `fanout` distinct other clients chosen by a seeded RNG (same seed,
//!   same traffic, for every layout). It never waits for an ack: the `send_ack` (or the
//!   `error` with the send's id) comes back on the sender's event stream, which the
//!   sender's receiving task reads (no task, timer or waiter per message: the generator's
//!   own CPU is part of what a local run measures). A scheduler that falls behind sends
//!   late, but latency still counts from the intended time (no coordinated omission), and
//!   `max_send_lag_ms` reports how late the generator itself was.
//! - **One clock.** All times are [`tokio::time::Instant`]s relative to `t0`. The body of
//!   message `i` is `i:<i>`; a receiver computes `deliver time − (t0 + i / rate)`.
//!   SEND_ACK latency is `ack time − intended time`. Both go to HDR histograms in µs
//!   (3 significant figures).
//! - **Window.** Sending stops at `t0 + duration`; deliveries and acks are counted until
//!   `t0 + duration + drain_grace` (earlier if every (message, recipient) pair and every ack
//!   has arrived). `delivered_in_window_pct` = pairs delivered in the window / pairs sent
//!   (`sent × fanout`); a send the server refused counts as not delivered. `send_acked`
//!   counts the acks of the whole window; `acked_per_s_while_sending` =
//!   `send_acked_while_sending / duration`, where only acks that arrived by
//!   `t0 + duration` count: acks of the drain grace are not throughput. (Reports written
//!   before had `committed_per_s` = `send_acked / duration` instead, which equals the offered
//!   rate whenever every send is eventually acked.)
//! - **Server side.** `INFO commandstats`, `INFO cpu` and `INFO stats` of every Redis instance
//!   at `t0` (A), at the end of sending (B) and at the end of the window (C). Redis CPU % and
//!   ops/s use A→B (the loaded interval); µs per `EVALSHA` (Δusec / Δcalls, summed over a
//!   pool) and mailbox CPU µs per message (Δcpu of the pool / pairs delivered) use A→C, so the
//!   backlog worked off during the drain is charged to the messages that caused it. CPU % is
//!   `Δ(used_cpu_sys + used_cpu_user) / Δwall × 100`, **averaged over the pool's instances**
//!   (100 % = one instance saturating one core); every instance is in `per_instance`.
//!   `INFO commandstats` also gives every command's calls per message sent and µs per call,
//!   per instance and per pool (A→C; commands a Lua script calls are counted too).
//! - **Processes.** Each OS process the run can see, at the same A, B and C: this one
//!   (`/proc/self`: user + system CPU, resident memory) and, for a remote target, each
//!   gateway's `/metrics` (`process_cpu_seconds_total`, `process_resident_memory_bytes`;
//!   derived from the gateway's URL unless given). CPU µs per message sent (A→C), CPU %
//!   (A→B), RSS at C. A local target runs the deployment in this process: its figure is the
//!   generator and the server together, and is named so.
//! - **Readings never lose a run.** Every `INFO` and `/metrics` reading is retried
//!   ([`ReadPolicy`]: 3 tries of at most 2 s, 200 ms then 1 s apart); one that still fails
//!   leaves the figures that need it `None` (`null` in the JSON, `—` in the tables) and is
//!   listed in `unread`. A pool figure needs every instance of the pool.
//! - **Errors** by code: `error` frames and failed sends (the server's code, e.g.
//!   `overloaded`), acks not received in the window (`timeout`), closed connections
//!   (`closed`), bodies not produced by this run (`foreign_body`), a message delivered to a
//!   client again under another seq (`duplicate`: not counted as delivered).

mod driver;
mod info;
mod isolated;
mod procs;
pub(crate) use procs::self_sample;
mod report;

use std::collections::BTreeMap;
use std::time::Duration;

use tidemark_store::redis::watermark::Layout;

pub use info::ReadPolicy;
pub use isolated::{run_ladder_isolated, run_load_isolated};
pub use procs::metrics_url_of;
pub use report::{
    cpu_table, from_json, group_thousands, has_cpu_table, ladder_table, markdown_table,
    parse_steps, to_json, CommandStats, InstanceStats, LadderStep, Percentiles, PoolPair,
    ProcessStats, RunReport, SecondLatency, CURVE_PERCENTILES,
};

/// ρ the ladder sizes pools for (ADR-0014: instance count from ρ ≤ 0.65).
pub const TARGET_RHO: f64 = 0.65;

/// What to load and how hard.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Connected clients (each one WebSocket connection, user `lg<run>-<i>`).
    pub clients: usize,
    /// Aggregate send rate, messages per second.
    pub rate: f64,
    /// How long messages are sent.
    pub duration: Duration,
    /// Recipients per message (distinct, never the sender).
    pub fanout: usize,
    /// Seed of the recipient choice (the same traffic for every layout).
    pub seed: u64,
    /// How long after the last send deliveries still count.
    pub drain_grace: Duration,
    /// Where the service runs.
    pub target: Target,
    /// One run per layout ([`Target::Local`]); a remote target has exactly one.
    pub layouts: Vec<Layout>,
    /// Draw indicatif progress bars on stderr.
    pub progress: bool,
    /// How each server-side reading (`INFO`, `/metrics`) is tried at each sampling point; a
    /// reading that still fails leaves its figures missing (`None`), never fails the run.
    pub read_policy: ReadPolicy,
    /// A local deployment's commit linger (ADR-0045); `None`: the gateway's default.
    pub commit_linger: Option<Duration>,
    /// A local deployment's ack interval (ADR-0074); `None`: the gateway's default.
    pub ack_interval: Option<Duration>,
    /// A local deployment's materializer read linger (ADR-0042); `None`: the materializer's
    /// default.
    pub read_linger: Option<Duration>,
}

impl Default for LoadOptions {
    /// The ADR's run: 1,000 clients, 10,000 msg/s, 60 s, fanout 1, packed-v2, local 4 + 4.
    fn default() -> Self {
        LoadOptions {
            clients: 1000,
            rate: 10_000.0,
            duration: Duration::from_secs(60),
            fanout: 1,
            seed: 1,
            drain_grace: Duration::from_secs(5),
            target: Target::default(),
            layouts: vec![Layout::PackedV2],
            progress: false,
            read_policy: ReadPolicy::default(),
            commit_linger: None,
            ack_interval: None,
            read_linger: None,
        }
    }
}

/// The deployment under load.
#[derive(Debug, Clone)]
pub enum Target {
    /// A fresh local deployment per run (`tidemark up` in-process, temporary data dir,
    /// dev auth), torn down afterwards.
    Local {
        /// Mailbox Redis instances.
        mailbox: usize,
        /// Core Redis instances.
        core: usize,
        /// Shards.
        shards: u32,
        /// `appendfsync` of every instance (`everysec` for benchmarks; `always` is the
        /// "nothing lost after SEND_ACK" production setting).
        appendfsync: String,
    },
    /// A running deployment.
    Remote {
        /// Gateway WebSocket URLs: clients are spread over them round-robin (several nodes).
        ws_urls: Vec<String>,
        /// HMAC secret to mint bearer tokens; `None`: dev auth (`?user=`).
        token_secret: Option<Vec<u8>>,
        /// Mailbox Redis URLs (for `INFO`; may be empty).
        mailbox_urls: Vec<String>,
        /// Core Redis URLs (for `INFO`; may be empty).
        core_urls: Vec<String>,
        /// Each gateway's `/metrics` (its process's CPU and memory), one per gateway process;
        /// empty: `http://host:port/metrics` of each of `ws_urls` ([`metrics_url_of`]).
        metrics_urls: Vec<String>,
    },
}

impl Default for Target {
    fn default() -> Self {
        Target::Local {
            mailbox: 4,
            core: 4,
            shards: 64,
            appendfsync: "everysec".into(),
        }
    }
}

/// Errors of the load generator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The options cannot be run.
    #[error("invalid load options: {0}")]
    Invalid(String),
    /// A ladder step that does not parse as `M+C@R`.
    #[error("bad ladder step {step:?}: {reason} (expected M+C@R, e.g. 1+1@5000)")]
    BadStep {
        /// The step as given.
        step: String,
        /// What is wrong.
        reason: String,
    },
    /// The local deployment failed to start or to stop.
    #[error("local deployment: {0}")]
    Deployment(#[from] tidemark_server::run::Error),
    /// A client could not connect.
    #[error("client {user}: {source}")]
    Client {
        /// The client's user.
        user: String,
        /// Why.
        #[source]
        source: tidemark_client::Error,
    },
    /// A Redis instance could not be reached before the run (after every retry).
    #[error("{0}")]
    Unreadable(String),
    /// A Redis URL that does not parse.
    #[error("redis {url}: {source}")]
    Redis {
        /// The instance.
        url: String,
        /// Why.
        #[source]
        source: redis::RedisError,
    },
    /// Temporary directory or other I/O.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// A run in a child process ([`run_load_isolated`]) failed or left no readable report.
    #[error("{0}")]
    Child(String),
}

impl Error {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &str {
        match self {
            Error::Invalid(_) => "invalid_options",
            Error::BadStep { .. } => "bad_step",
            Error::Deployment(e) => e.code(),
            Error::Client { source, .. } => source.code(),
            Error::Redis { .. } | Error::Unreadable(_) => "redis",
            Error::Io(_) => "io",
            Error::Child(_) => "child",
        }
    }
}

/// Runs the load once per layout of `opts.layouts`, each against a fresh local deployment
/// (new temporary data dir, same seed), or once against a remote one.
///
/// A local deployment starts redis-server processes whose parent-death signal is bound to
/// the calling thread: await this from the runtime's top-level future (`block_on` in `main`
/// or `#[tokio::test]`), not from a spawned task.
pub async fn run_load(opts: &LoadOptions) -> Result<Vec<RunReport>, Error> {
    validate(opts)?;
    let mut out = Vec::new();
    match local_runs(opts) {
        Some(locals) => {
            for local in &locals {
                out.push(driver::run_local(opts, local).await?);
            }
        }
        None => {
            if opts.layouts.len() != 1 {
                return Err(Error::Invalid(
                    "a remote deployment has one layout: give exactly one (it only labels the run)"
                        .into(),
                ));
            }
            out.push(driver::run_remote(opts, opts.layouts[0]).await?);
        }
    }
    Ok(out)
}

/// One fresh local deployment per layout of `opts`, in order; `None` for a remote target.
fn local_runs(opts: &LoadOptions) -> Option<Vec<driver::Local>> {
    let Target::Local {
        mailbox,
        core,
        shards,
        appendfsync,
    } = &opts.target
    else {
        return None;
    };
    Some(
        opts.layouts
            .iter()
            .map(|&layout| driver::Local {
                mailbox: *mailbox,
                core: *core,
                shards: *shards,
                appendfsync: appendfsync.clone(),
                layout,
            })
            .collect(),
    )
}

/// Runs every step (for every layout of `base.layouts`) on a fresh local deployment of
/// `step.mailbox` + `step.core` instances at `step.rate`; everything else from `base`
/// (shards and `appendfsync` from its [`Target::Local`]). Same threading rule as
/// [`run_load`].
pub async fn run_ladder(base: &LoadOptions, steps: &[LadderStep]) -> Result<Vec<RunReport>, Error> {
    let mut out = Vec::new();
    for opts in ladder_options(base, steps)? {
        out.extend(run_load(&opts).await?);
    }
    Ok(out)
}

/// The options of every step of a ladder: `base` with the step's instance counts and rate.
fn ladder_options(base: &LoadOptions, steps: &[LadderStep]) -> Result<Vec<LoadOptions>, Error> {
    let Target::Local {
        shards,
        appendfsync,
        ..
    } = &base.target
    else {
        return Err(Error::Invalid(
            "a ladder starts its own deployments: the target must be local".into(),
        ));
    };
    if steps.is_empty() {
        return Err(Error::Invalid("a ladder needs at least one step".into()));
    }
    Ok(steps
        .iter()
        .map(|step| LoadOptions {
            rate: step.rate,
            target: Target::Local {
                mailbox: step.mailbox,
                core: step.core,
                shards: *shards,
                appendfsync: appendfsync.clone(),
            },
            ..base.clone()
        })
        .collect())
}

fn validate(opts: &LoadOptions) -> Result<(), Error> {
    let bad = |s: &str| Err(Error::Invalid(s.into()));
    if opts.clients < 2 {
        return bad("at least 2 clients (a client never sends to itself)");
    }
    if opts.fanout == 0 || opts.fanout >= opts.clients || opts.fanout > 100 {
        return bad("fanout must be 1..=100 and below the number of clients");
    }
    if !(opts.rate.is_finite() && opts.rate > 0.0) {
        return bad("rate must be a positive number of messages per second");
    }
    if opts.duration.is_zero() {
        return bad("duration must be positive");
    }
    if opts.layouts.is_empty() {
        return bad("give at least one layout");
    }
    let total = opts.rate * opts.duration.as_secs_f64();
    if !(1.0..=1e9).contains(&total) {
        return bad("rate × duration must be between 1 and 10^9 messages");
    }
    if let Target::Local {
        mailbox,
        core,
        shards,
        ..
    } = &opts.target
    {
        if *mailbox == 0 || *core == 0 || *shards == 0 {
            return bad("a local deployment needs ≥ 1 mailbox, ≥ 1 core instance and ≥ 1 shard");
        }
    }
    Ok(())
}

/// Adds `n` to the count of `code`.
pub(crate) fn bump(errors: &mut BTreeMap<String, u64>, code: &str, n: u64) {
    if n > 0 {
        *errors.entry(code.to_owned()).or_default() += n;
    }
}

/// What `tidemark bench load|ladder` prints: the ADR's table (and the ladder table), one
/// summary line per run; writes the JSON report and the plots when asked. Returns the text.
pub fn render(
    runs: &[RunReport],
    ladder: bool,
    json: Option<&std::path::Path>,
    plot_dir: Option<&std::path::Path>,
) -> Result<String, Error> {
    use std::fmt::Write as _;
    let mut out = markdown_table(runs);
    out.push('\n');
    if has_cpu_table(runs) {
        out.push_str(&cpu_table(runs));
        out.push('\n');
    }
    if ladder {
        out.push_str(&ladder_table(runs));
        out.push('\n');
    }
    for r in runs {
        for why in &r.unread {
            let _ = writeln!(out, "{} not read (its figures are —): {why}", r.layout);
        }
        if !r.errors.is_empty() {
            let _ = writeln!(out, "{} errors: {:?}", r.layout, r.errors);
        }
        let _ = writeln!(
            out,
            "{}: sent {} acked {} ({} while sending) delivered {}/{}, e2e max {:.1} ms, generator lag max {:.1} ms",
            r.layout,
            r.sent,
            r.send_acked,
            r.send_acked_while_sending
                .map_or_else(|| "—".to_owned(), |n| n.to_string()),
            r.delivered,
            r.expected,
            r.e2e_ms.max,
            r.max_send_lag_ms
        );
    }
    if let Some(path) = json {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        let text = serde_json::to_string_pretty(&to_json(runs)).expect("JSON of a report");
        std::fs::write(path, text + "\n")?;
        let _ = writeln!(out, "wrote {}", path.display());
    }
    if let Some(dir) = plot_dir {
        let files = crate::plot::write_plots(dir, runs, ladder)
            .map_err(|e| Error::Invalid(format!("plots: {e}")))?;
        for f in files {
            let _ = writeln!(out, "wrote {}", f.display());
        }
    }
    Ok(out)
}
