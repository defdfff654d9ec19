//! `tidemark bench …`: the Lua micro-benchmark, the open-loop load and its capacity ladder, the
//! idle cost of connected clients, and the tables of a saved report. Argument parsing and printing only; the benchmarks, and
//! running each layout in a child process of its own, are `tidemark_bench`.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use tidemark_bench::idle;
use tidemark_bench::load::{self, LoadOptions, Target};
use tidemark_store::redis::watermark::Layout;

use super::args::{EngineReportArgs, LocalSizeArgs};

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Lua micro-benchmark: server-side µs per call of each script, v1 and v2.
    Lua(LuaArgs),
    /// Open-loop load: the ADR's measurement table, layouts side by side.
    Load(LoadArgs),
    /// Capacity ladder: the load repeated over M+C@R steps.
    Ladder(LadderArgs),
    /// Idle cost: N clients connected and sending nothing for T seconds (server CPU and RSS,
    /// Redis commands/s by command).
    Idle(IdleArgs),
    /// The tables (and, with --plot, the figures) of a JSON report that `bench
    /// load|ladder|catchup|commit --json` wrote, without running anything.
    Report(ReportArgs),
    /// Materializer catch-up: fill the logs with N committed records while no materializer
    /// runs, then start them and measure records/s until W reaches the head everywhere.
    Catchup(CatchupArgs),
    /// Commits/s through the gateway's commit path (no WebSockets), per core instance.
    Commit(CommitArgs),
    /// A yardstick, not a server: a WebSocket relay of the client protocol with no Redis
    /// (nothing is stored), for `bench load --target`: the floor of the socket work per
    /// message. Runs until Ctrl-C.
    Relay(RelayArgs),
}

#[derive(Args)]
pub struct RelayArgs {
    /// Address to listen on (`/v1/ws` with `?user=`, and `/metrics`).
    #[arg(long, default_value = "127.0.0.1:8091")]
    listen: std::net::SocketAddr,
}

#[derive(Args)]
pub struct CatchupArgs {
    /// Records in the backlog (over all shards).
    #[arg(long, default_value_t = 1_000_000)]
    records: u64,
    /// Recipients per record (all in the record's shard).
    #[arg(long, default_value_t = 1)]
    recipients: usize,
    #[command(flatten)]
    size: LocalSizeArgs,
    /// Watermark layout.
    #[arg(long, default_value = "packed-v2", value_parser = tidemark_ops::parse_layout)]
    layout: Layout,
    /// appendfsync of every instance.
    #[arg(long, default_value = "everysec")]
    appendfsync: String,
    /// Records per shard per log read (default: the materializer's).
    #[arg(long)]
    batch: Option<usize>,
    /// Body bytes of each record.
    #[arg(long, default_value_t = 64)]
    body_bytes: usize,
    #[command(flatten)]
    out: EngineReportArgs,
}

#[derive(Args)]
pub struct CommitArgs {
    /// Aggregate sends per second, or `max` (each sender sends as soon as its last send
    /// committed).
    #[arg(long, default_value = "max")]
    rate: String,
    /// Seconds measured.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Seconds of sending before the measurement.
    #[arg(long, default_value_t = 2)]
    warmup: u64,
    /// Concurrent senders (connections: one send at a time each).
    #[arg(long, default_value_t = 1000)]
    senders: usize,
    /// Recipients per send.
    #[arg(long, default_value_t = 1)]
    recipients: usize,
    /// Local deployment: core Redis instances.
    #[arg(long, default_value_t = 1)]
    core: usize,
    /// Local deployment: shards.
    #[arg(long, default_value_t = 64)]
    shards: u32,
    /// appendfsync of every instance.
    #[arg(long, default_value = "everysec")]
    appendfsync: String,
    /// Body bytes of each send.
    #[arg(long, default_value_t = 64)]
    body_bytes: usize,
    /// RNG seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    out: EngineReportArgs,
}

#[derive(Args)]
pub struct ReportArgs {
    /// The JSON report (`{"runs":[…]}`).
    json: std::path::PathBuf,
    /// Also the ladder table (ρ ≤ 0.65 sizing per step).
    #[arg(long)]
    ladder: bool,
    /// Redraw the PNG and SVG plots into this directory.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

#[derive(Args, Clone)]
pub struct LoadArgs {
    /// WebSocket clients.
    #[arg(long, default_value_t = 1000)]
    clients: usize,
    /// Aggregate messages per second.
    #[arg(long, default_value_t = 10000.0)]
    rate: f64,
    /// Seconds of load.
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// Recipients per message.
    #[arg(long, default_value_t = 1)]
    fanout: usize,
    /// RNG seed (same for every layout).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Seconds after the window during which deliveries still count.
    #[arg(long, default_value_t = 5)]
    drain_grace: u64,
    /// Layouts, each run on a fresh deployment.
    #[arg(long, value_delimiter = ',', default_value = "packed-v2", value_parser = tidemark_ops::parse_layout)]
    layouts: Vec<Layout>,
    #[command(flatten)]
    size: LocalSizeArgs,
    /// Local deployment: appendfsync.
    #[arg(long, default_value = "everysec")]
    appendfsync: String,
    /// Local deployment: the gateway's commit linger in microseconds (`serve
    /// --commit-linger-us`, ADR-0045); default: the gateway's.
    #[arg(long)]
    commit_linger_us: Option<u64>,
    /// Local deployment: the gateway's ack interval in milliseconds (`serve
    /// --ack-interval-ms`, ADR-0074); default: the gateway's.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    ack_interval_ms: Option<u64>,
    /// Local deployment: the materializers' read linger in milliseconds (`serve
    /// --read-linger-ms`, ADR-0042); default: the materializer's.
    #[arg(long)]
    read_linger_ms: Option<u64>,
    /// A running deployment's gateways instead (ws://…/v1/ws, comma-separated: clients are
    /// spread over them round-robin). The generator then runs on one thread.
    #[arg(long, value_delimiter = ',')]
    target: Option<Vec<String>>,
    /// With --target: token secret file (else dev auth).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// With --target: mailbox Redis URLs for INFO.
    #[arg(long, value_delimiter = ',')]
    mailbox_urls: Vec<String>,
    /// With --target: core Redis URLs for INFO.
    #[arg(long, value_delimiter = ',')]
    core_urls: Vec<String>,
    /// With --target: each gateway process's /metrics (http://host:port/metrics, e.g. its
    /// --admin-listen), for its CPU and memory per message; default: /metrics on the host
    /// and port of each --target URL.
    #[arg(long, value_delimiter = ',')]
    metrics_url: Vec<String>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write PNG and SVG plots into this directory.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Internal: write the raw run reports here instead of printing (one child per layout).
    #[arg(long, hide = true)]
    report_out: Option<std::path::PathBuf>,
}

#[derive(Args)]
pub struct LadderArgs {
    /// Steps M+C@R, comma-separated (e.g. 1+1@2000,1+1@5000,2+2@10000).
    #[arg(long)]
    steps: String,
    #[command(flatten)]
    load: LoadArgs,
}

/// The load generator's options from the flags (a secret file is read here).
fn load_options(a: &LoadArgs) -> anyhow::Result<LoadOptions> {
    let target = match &a.target {
        Some(ws_urls) => Target::Remote {
            ws_urls: ws_urls.clone(),
            token_secret: match &a.secret_file {
                Some(p) => Some(
                    tidemark_protocol::secret::load(
                        Some(p),
                        tidemark_protocol::secret::SECRET_ENV_VAR,
                    )?
                    .into_bytes(),
                ),
                None => None,
            },
            mailbox_urls: a.mailbox_urls.clone(),
            core_urls: a.core_urls.clone(),
            metrics_urls: a.metrics_url.clone(),
        },
        None => Target::Local {
            mailbox: a.size.mailbox,
            core: a.size.core,
            shards: a.size.shards,
            appendfsync: a.appendfsync.clone(),
        },
    };
    Ok(LoadOptions {
        clients: a.clients,
        rate: a.rate,
        duration: std::time::Duration::from_secs(a.duration),
        fanout: a.fanout,
        seed: a.seed,
        drain_grace: std::time::Duration::from_secs(a.drain_grace),
        target,
        layouts: a.layouts.clone(),
        progress: !a.no_progress,
        read_policy: load::ReadPolicy::default(),
        commit_linger: a.commit_linger_us.map(std::time::Duration::from_micros),
        ack_interval: a.ack_interval_ms.map(std::time::Duration::from_millis),
        read_linger: a.read_linger_ms.map(std::time::Duration::from_millis),
    })
}

#[derive(Args)]
pub struct IdleArgs {
    /// WebSocket clients (each its own user), connected and then idle.
    #[arg(long, default_value_t = 1000)]
    clients: usize,
    /// Seconds of the measured idle window.
    #[arg(long, default_value_t = 30)]
    duration: u64,
    /// Seconds to wait after the last client connected, before the window.
    #[arg(long, default_value_t = 2)]
    settle: u64,
    #[command(flatten)]
    size: LocalSizeArgs,
    /// Local deployment: appendfsync.
    #[arg(long, default_value = "everysec")]
    appendfsync: String,
    /// Local deployment: the gateway's commit linger in microseconds (`serve
    /// --commit-linger-us`, ADR-0045); default: the gateway's.
    #[arg(long)]
    commit_linger_us: Option<u64>,
    /// A running deployment's gateways instead (ws://…/v1/ws, comma-separated: clients are
    /// spread over them round-robin).
    #[arg(long, value_delimiter = ',')]
    target: Option<Vec<String>>,
    /// With --target: token secret file (else dev auth).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// With --target: the deployment file (`tidemark up` writes DATA_DIR/tidemark.toml) to
    /// take the Redis URLs from, instead of --mailbox-urls/--core-urls.
    #[arg(long, conflicts_with_all = ["mailbox_urls", "core_urls"])]
    config: Option<std::path::PathBuf>,
    /// With --target: mailbox Redis URLs for INFO.
    #[arg(long, value_delimiter = ',')]
    mailbox_urls: Vec<String>,
    /// With --target: core Redis URLs for INFO.
    #[arg(long, value_delimiter = ',')]
    core_urls: Vec<String>,
    /// With --target: each gateway's /metrics URL (plain http; e.g. its --admin-listen).
    /// Default: http://HOST:PORT/metrics of each --target.
    #[arg(long, value_delimiter = ',')]
    metrics_url: Vec<String>,
    /// Local addresses to connect from, round-robin (comma-separated). Default for a
    /// loopback target: 127.0.0.2, 127.0.0.3, … (one per 10,000 clients).
    #[arg(long, value_delimiter = ',')]
    source_addrs: Option<Vec<std::net::IpAddr>>,
    /// Clients connecting at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
}

/// `bench idle`'s options from the flags (a secret or deployment file is read here).
fn idle_options(a: &IdleArgs) -> anyhow::Result<idle::IdleOptions> {
    let target = match &a.target {
        Some(ws_urls) => {
            let (mailbox_urls, core_urls) = match &a.config {
                Some(path) => {
                    let t = tidemark_store::topology::Topology::from_file(path)?;
                    (t.mailbox, t.core)
                }
                None => (a.mailbox_urls.clone(), a.core_urls.clone()),
            };
            Target::Remote {
                ws_urls: ws_urls.clone(),
                token_secret: match &a.secret_file {
                    Some(p) => Some(
                        tidemark_protocol::secret::load(
                            Some(p),
                            tidemark_protocol::secret::SECRET_ENV_VAR,
                        )?
                        .into_bytes(),
                    ),
                    None => None,
                },
                mailbox_urls,
                core_urls,
                // bench idle reads its own --metrics-url (opts.metrics_urls)
                metrics_urls: Vec::new(),
            }
        }
        None => Target::Local {
            mailbox: a.size.mailbox,
            core: a.size.core,
            shards: a.size.shards,
            appendfsync: a.appendfsync.clone(),
        },
    };
    Ok(idle::IdleOptions {
        clients: a.clients,
        duration: std::time::Duration::from_secs(a.duration),
        settle: std::time::Duration::from_secs(a.settle),
        target,
        source_addrs: a.source_addrs.clone(),
        metrics_urls: a.metrics_url.clone(),
        concurrency: a.concurrency,
        progress: !a.no_progress,
    })
}

#[derive(Args)]
pub struct LuaArgs {
    /// Redis to use (default: start a private redis-server).
    #[arg(long)]
    redis: Option<String>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Script calls timed per round and variant.
    #[arg(long, default_value_t = 20000)]
    calls: usize,
    /// Rounds (the report keeps the median).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
}

/// Runs a load against a remote deployment on a single-threaded runtime of its own: every
/// task of the generator (scheduler, readers, writers, receivers) on one thread, so that
/// waking a task never wakes another thread.
async fn on_one_thread(opts: LoadOptions) -> anyhow::Result<Vec<load::RunReport>> {
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(rt.block_on(load::run_load(&opts))?)
    })
    .await?
}

/// Runs one `tidemark bench` command.
pub async fn run(cmd: BenchCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCmd::Load(a) => {
            let opts = load_options(&a)?;
            let runs = if a.target.is_none() && a.layouts.len() > 1 {
                // each layout in a fresh process of its own (see `run_load_isolated`)
                load::run_load_isolated(&std::env::current_exe()?, &opts)?
            } else if a.target.is_some() {
                on_one_thread(opts).await?
            } else {
                load::run_load(&opts).await?
            };
            if let Some(path) = &a.report_out {
                std::fs::write(path, serde_json::to_string(&runs)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            let text = load::render(&runs, false, a.json.as_deref(), a.plot.as_deref())?;
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
        BenchCmd::Ladder(a) => {
            let steps = load::parse_steps(&a.steps)?;
            let opts = load_options(&a.load)?;
            let runs = if a.load.target.is_none() {
                // every step and layout in a fresh process (see `bench load`)
                load::run_ladder_isolated(&std::env::current_exe()?, &opts, &steps)?
            } else {
                load::run_ladder(&opts, &steps).await?
            };
            let text = load::render(&runs, true, a.load.json.as_deref(), a.load.plot.as_deref())?;
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
        BenchCmd::Idle(a) => {
            let report = idle::run_idle(&idle_options(&a)?).await?;
            print!("{}", idle::render(&report));
            if let Some(path) = &a.json {
                if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                    std::fs::create_dir_all(parent)?;
                }
                std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
                println!("wrote {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchCmd::Report(a) => {
            let text = std::fs::read_to_string(&a.json)
                .map_err(|e| anyhow::anyhow!("{}: {e}", a.json.display()))?;
            // the engine benchmarks' files: their own table
            match tidemark_bench::engine::report_kind(&text).as_deref() {
                Some("catchup") => {
                    let runs = tidemark_bench::engine::runs_from_json(&text)?;
                    print!("{}", tidemark_bench::catchup::markdown_table(&runs));
                    return Ok(ExitCode::SUCCESS);
                }
                Some("commit") => {
                    let runs = tidemark_bench::engine::runs_from_json(&text)?;
                    print!("{}", tidemark_bench::commit::markdown_table(&runs));
                    return Ok(ExitCode::SUCCESS);
                }
                _ => {}
            }
            let runs =
                load::from_json(&text).map_err(|e| anyhow::anyhow!("{}: {e}", a.json.display()))?;
            let text = load::render(&runs, a.ladder, None, a.plot.as_deref())?;
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
        BenchCmd::Relay(a) => {
            tidemark_bench::relay::run_relay(
                a.listen,
                |addr| {
                    println!(
                        "relay (not a Tidemark server: nothing is stored) on ws://{addr}/v1/ws"
                    )
                },
                async {
                    let _ = tokio::signal::ctrl_c().await;
                },
            )
            .await?;
            Ok(ExitCode::SUCCESS)
        }
        BenchCmd::Catchup(a) => {
            let opts = tidemark_bench::catchup::CatchupOptions {
                records: a.records,
                recipients: a.recipients,
                mailbox: a.size.mailbox,
                core: a.size.core,
                shards: a.size.shards,
                layout: a.layout,
                appendfsync: a.appendfsync,
                batch: a.batch,
                body_bytes: a.body_bytes,
                label: a.out.label.clone(),
                progress: !a.out.no_progress,
            };
            let report = tidemark_bench::catchup::run_catchup(&opts).await?;
            print!("{}", tidemark_bench::catchup::render(&report));
            a.out.write(&report)?;
            Ok(ExitCode::SUCCESS)
        }
        BenchCmd::Commit(a) => {
            let rate =
                match a.rate.as_str() {
                    "max" => None,
                    r => Some(r.parse::<f64>().map_err(|_| {
                        anyhow::anyhow!("--rate: {r:?} is neither a number nor `max`")
                    })?),
                };
            let opts = tidemark_bench::commit::CommitOptions {
                rate,
                duration: std::time::Duration::from_secs(a.duration),
                warmup: std::time::Duration::from_secs(a.warmup),
                senders: a.senders,
                recipients: a.recipients,
                core: a.core,
                shards: a.shards,
                appendfsync: a.appendfsync,
                body_bytes: a.body_bytes,
                seed: a.seed,
                label: a.out.label.clone(),
                progress: !a.out.no_progress,
            };
            let report = tidemark_bench::commit::run_commit(&opts).await?;
            print!("{}", tidemark_bench::commit::render(&report));
            a.out.write(&report)?;
            Ok(ExitCode::SUCCESS)
        }
        BenchCmd::Lua(a) => {
            let report = tidemark_bench::lua::run(&tidemark_bench::LuaBenchOptions {
                redis_url: a.redis,
                calls_per_round: a.calls,
                rounds: a.rounds,
            })
            .await?;
            print!("{}", report.to_table());
            if let Some(path) = a.json {
                std::fs::write(&path, serde_json::to_string_pretty(&report.to_json())?)?;
                eprintln!("wrote {}", path.display());
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
