//! The `tidemark` command: parses arguments and calls the library crates. Nothing else.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tidemark_server::config::Topology;
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::{MaterializerOptions, RandomChunkFault};
use tidemark_server::run;
use tidemark_store::ops;
use tidemark_store::redis::watermark::Layout;
use tokio_util::sync::CancellationToken;

/// Exit status for a corrupt watermark (scripts rely on it).
const EXIT_CORRUPT: u8 = 3;
/// Exit status for a missing watermark.
const EXIT_MISSING: u8 = 4;

#[derive(Parser)]
#[command(
    name = "tidemark",
    version,
    about = "Tidemark: gap-free mailbox delivery on Redis"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Watermark operations (wm:{s} on a mailbox Redis).
    #[command(subcommand)]
    Wm(WmCmd),
    /// Shard ownership operations.
    #[command(subcommand)]
    Shard(ShardCmd),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Run Tidemark locally: starts its own redis-server processes, gateway and materializers.
    Up(UpArgs),
    /// Run the gateway and materializers against Redis instances started elsewhere.
    Serve(ServeArgs),
    /// Mint a bearer token (HMAC-SHA256, user + expiry).
    Token(TokenArgs),
    /// Send one message and print its offsets.
    Send(SendArgs),
    /// Print deliveries as they arrive.
    Tail(TailArgs),
    /// Follow one message from its commit in dlog:{s} to every mailbox entry.
    Trace(TraceArgs),
}

#[derive(Args)]
struct TokenArgs {
    #[arg(long)]
    user: String,
    /// Lifetime: e.g. 3600, 90s, 15m, 24h, 7d.
    #[arg(long, default_value = "24h", value_parser = parse_duration)]
    ttl: std::time::Duration,
    /// File holding the secret (else env TIDEMARK_TOKEN_SECRET).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
}

#[derive(Args, Clone)]
struct ClientAuthArgs {
    /// Gateway WebSocket URL.
    #[arg(long, default_value = "ws://127.0.0.1:7400/v1/ws")]
    url: String,
    /// Bearer token.
    #[arg(long, env = "TIDEMARK_TOKEN", conflicts_with = "dev_user")]
    token: Option<String>,
    /// Connect as this user without a token (server must run with --dev-auth).
    #[arg(long, alias = "user")]
    dev_user: Option<String>,
}

#[derive(Args)]
struct SendArgs {
    #[command(flatten)]
    auth: ClientAuthArgs,
    /// Recipients (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', required = true)]
    to: Vec<String>,
    /// Client message id (default: generated). Resending with the same id is deduplicated.
    #[arg(long)]
    id: Option<String>,
    /// Message body.
    body: String,
}

#[derive(Args)]
struct TailArgs {
    #[command(flatten)]
    auth: ClientAuthArgs,
    /// Restart the stream after this seq (default: after the last acked one).
    #[arg(long)]
    after: Option<u64>,
    /// Acknowledge each delivered message (lets the server trim the mailbox).
    #[arg(long)]
    ack: bool,
}

#[derive(Args)]
struct TraceArgs {
    /// Core Redis URL holding the shard's log (one instance; else use --config).
    #[arg(long, required_unless_present = "config")]
    core: Option<String>,
    /// Mailbox Redis URL holding the shard (one instance; else use --config).
    #[arg(long, required_unless_present = "config")]
    mailbox: Option<String>,
    /// Shards of the deployment (lanes are routed with it).
    #[arg(long, required_unless_present = "config")]
    shards: Option<u32>,
    /// TOML deployment file: the shard's instances come from its tables.
    #[arg(long, conflicts_with_all = ["core", "mailbox", "shards"])]
    config: Option<std::path::PathBuf>,
    #[arg(long)]
    shard: u32,
    #[arg(long)]
    offset: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let (num, mul) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1),
        Some((i, 'm')) => (&s[..i], 60),
        Some((i, 'h')) => (&s[..i], 3600),
        Some((i, 'd')) => (&s[..i], 86400),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("bad duration {s:?} (e.g. 90s, 15m, 24h, 7d)"))?;
    Ok(std::time::Duration::from_secs(n * mul))
}

fn client_auth(a: &ClientAuthArgs) -> anyhow::Result<tidemark_client::Auth> {
    match (&a.token, &a.dev_user) {
        (Some(t), _) => Ok(tidemark_client::Auth::Token(t.clone())),
        (None, Some(u)) => Ok(tidemark_client::Auth::DevUser(u.clone())),
        (None, None) => anyhow::bail!("give --token (or TIDEMARK_TOKEN) or --dev-user NAME"),
    }
}

#[derive(Args)]
struct UpArgs {
    /// Mailbox Redis instances.
    #[arg(long, default_value_t = 1)]
    mailbox: usize,
    /// Core Redis instances.
    #[arg(long, default_value_t = 1)]
    core: usize,
    /// Shards (fixed for a data dir).
    #[arg(long, default_value_t = 64)]
    shards: u32,
    /// Gateway listen address.
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: std::net::SocketAddr,
    /// Data directory (AOF files, deployment file, token secret).
    #[arg(long, default_value = "./data")]
    data_dir: std::path::PathBuf,
    /// Accept `?user=NAME` without a token (development only).
    #[arg(long)]
    dev_auth: bool,
    /// Watermark layout to write.
    #[arg(long, default_value = "packed-v2", value_parser = ops::parse_layout)]
    layout: Layout,
    /// appendfsync of every instance: always (default: nothing acknowledged is lost), everysec.
    #[arg(long, default_value = "always")]
    appendfsync: String,
    #[command(flatten)]
    limits: GatewayLimitArgs,
}

#[derive(Args)]
struct ServeArgs {
    /// Core Redis URLs.
    #[arg(long, value_delimiter = ',', required_unless_present = "config")]
    core: Vec<String>,
    /// Mailbox Redis URLs.
    #[arg(long, value_delimiter = ',', required_unless_present = "config")]
    mailbox: Vec<String>,
    /// Shards.
    #[arg(long, required_unless_present = "config")]
    shards: Option<u32>,
    /// TOML deployment file (shards, layout, instances, static shard tables).
    #[arg(long, conflicts_with_all = ["core", "mailbox", "shards"])]
    config: Option<std::path::PathBuf>,
    /// Gateway listen address.
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: std::net::SocketAddr,
    /// Accept `?user=NAME` without a token (development only).
    #[arg(long)]
    dev_auth: bool,
    /// Watermark layout to write (without --config).
    #[arg(long, default_value = "packed-v2", value_parser = ops::parse_layout)]
    layout: Layout,
    /// File holding the token secret (else env TIDEMARK_TOKEN_SECRET).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// Own only these shards (comma-separated); default all.
    #[arg(long, value_delimiter = ',')]
    own_shards: Option<Vec<u32>>,
    /// Fault injection for fault runs: fail this percentage of lane chunk writes.
    #[arg(long, hide = true, default_value_t = 0)]
    fault_chunk_fail_pct: u8,
    #[command(flatten)]
    limits: GatewayLimitArgs,
}

/// Limits on slow, idle and greedy clients (`serve` and `up`; docs/operations.md, ADR-0025).
#[derive(Args)]
struct GatewayLimitArgs {
    /// Most open client connections (WebSockets included); beyond: HTTP 503 `overloaded`.
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// A request head (or body) must arrive within this time, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    header_read_timeout: std::time::Duration,
    /// Ping a WebSocket client after this much silence.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    ws_ping_interval: std::time::Duration,
    /// Close a WebSocket (4002) from which nothing, not even a pong, arrived for this long.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    ws_idle_timeout: std::time::Duration,
    /// Bytes of outbound frames one WebSocket may have queued (e.g. 65536, 64k, 1m).
    #[arg(long, default_value = "64k", value_parser = parse_bytes)]
    max_queued_bytes: usize,
    /// Close a WebSocket (4003) whose frames waited this long for room; drop an HTTP
    /// response whose writes made no progress for this long.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    slow_client_grace: std::time::Duration,
    /// Bytes of mailbox entries in one `GET /v1/mailbox` page (e.g. 1m).
    #[arg(long, default_value = "1m", value_parser = parse_bytes)]
    max_page_bytes: usize,
    /// Most open WebSockets of one user; beyond: HTTP 429 `too_many_connections`.
    #[arg(long, default_value_t = 16)]
    max_connections_per_user: usize,
    /// Most commits in flight for one user (0: an eighth of the gateway's 4096).
    #[arg(long, default_value_t = 0)]
    max_inflight_commits_per_user: usize,
    /// Sends per second one user may make (0: no limit); beyond: `rate_limited`.
    #[arg(long, default_value_t = 0.0)]
    send_rate_per_user: f64,
    /// Sends one user may make at once before the rate applies (0: one second's worth).
    #[arg(long, default_value_t = 0)]
    send_burst_per_user: u32,
}

/// A byte count: a number, optionally followed by k or m (KiB, MiB).
fn parse_bytes(s: &str) -> Result<usize, String> {
    let lower = s.to_ascii_lowercase();
    let (num, mul) = match lower.strip_suffix('k') {
        Some(n) => (n, 1024),
        None => match lower.strip_suffix('m') {
            Some(n) => (n, 1024 * 1024),
            None => (lower.as_str(), 1),
        },
    };
    num.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("bad byte count {s:?} (e.g. 262144, 256k, 1m)"))
}

impl GatewayLimitArgs {
    /// Gateway options with these limits (and defaults for everything else).
    fn options(&self) -> GatewayOptions {
        GatewayOptions {
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            ping_interval: self.ws_ping_interval,
            idle_timeout: self.ws_idle_timeout,
            max_queued_bytes: self.max_queued_bytes,
            slow_client_grace: self.slow_client_grace,
            max_page_bytes: self.max_page_bytes,
            max_connections_per_user: self.max_connections_per_user,
            max_inflight_commits_per_user: self.max_inflight_commits_per_user,
            send_rate_per_user: self.send_rate_per_user,
            send_burst_per_user: self.send_burst_per_user,
            ..GatewayOptions::default()
        }
    }
}

#[derive(Subcommand)]
enum WmCmd {
    /// Create fresh watermarks (all lanes present at offset 0) for shards 0..S.
    Init {
        #[arg(long)]
        redis: String,
        #[arg(long)]
        shards: u32,
        #[arg(long, default_value = "packed-v2", value_parser = ops::parse_layout)]
        layout: Layout,
        #[arg(long, default_value_t = 1)]
        epoch: u64,
        /// Overwrite existing watermarks.
        #[arg(long)]
        force: bool,
    },
    /// Show one shard's watermark (read through read_log_watermarks.lua).
    Inspect {
        #[arg(long)]
        redis: String,
        #[arg(long)]
        shard: u32,
        #[arg(long)]
        json: bool,
    },
    /// Offline downgrade to packed-v1 (19 -> 1216 bytes). Stop every owner first.
    Downgrade {
        #[arg(long)]
        redis: String,
        #[arg(long, conflicts_with = "all", required_unless_present = "all")]
        shard: Option<u32>,
        #[arg(long)]
        all: bool,
    },
    /// Check every watermark on the given instances; non-zero exit when any is bad.
    Verify {
        /// One or more mailbox Redis URLs (comma-separated or repeated).
        #[arg(long, value_delimiter = ',', required = true)]
        redis: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ShardCmd {
    /// Raise a shard's epoch so a running old owner fails closed on its next script.
    Fence {
        #[arg(long)]
        redis: String,
        #[arg(long)]
        shard: u32,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Lua micro-benchmark: server-side µs per call of each script, v1 and v2.
    Lua(LuaArgs),
    /// Open-loop load: the ADR's measurement table, layouts side by side.
    Load(LoadArgs),
    /// Capacity ladder: the load repeated over M+C@R steps.
    Ladder(LadderArgs),
}

#[derive(Args, Clone)]
struct LoadArgs {
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
    #[arg(long, value_delimiter = ',', default_value = "packed-v2", value_parser = ops::parse_layout)]
    layouts: Vec<Layout>,
    /// Local deployment: mailbox Redis instances.
    #[arg(long, default_value_t = 1)]
    mailbox: usize,
    /// Local deployment: core Redis instances.
    #[arg(long, default_value_t = 1)]
    core: usize,
    /// Local deployment: shards.
    #[arg(long, default_value_t = 64)]
    shards: u32,
    /// Local deployment: appendfsync.
    #[arg(long, default_value = "everysec")]
    appendfsync: String,
    /// A running deployment's gateway instead (ws://…/v1/ws).
    #[arg(long)]
    target: Option<String>,
    /// With --target: token secret file (else dev auth).
    #[arg(long)]
    secret_file: Option<std::path::PathBuf>,
    /// With --target: mailbox Redis URLs for INFO.
    #[arg(long, value_delimiter = ',')]
    mailbox_urls: Vec<String>,
    /// With --target: core Redis URLs for INFO.
    #[arg(long, value_delimiter = ',')]
    core_urls: Vec<String>,
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
struct LadderArgs {
    /// Steps M+C@R, comma-separated (e.g. 1+1@2000,1+1@5000,2+2@10000).
    #[arg(long)]
    steps: String,
    #[command(flatten)]
    load: LoadArgs,
}

/// Runs `tidemark bench load` for one layout in a child process and reads its reports back.
fn run_layout_in_child(
    a: &LoadArgs,
    layout: Layout,
) -> anyhow::Result<Vec<tidemark_bench::load::RunReport>> {
    let out = std::env::temp_dir().join(format!(
        "tidemark-bench-{}-{}.json",
        std::process::id(),
        layout
    ));
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.args(["bench", "load", "--layouts", layout.as_str()])
        .args(["--clients", &a.clients.to_string()])
        .args(["--rate", &a.rate.to_string()])
        .args(["--duration", &a.duration.to_string()])
        .args(["--fanout", &a.fanout.to_string()])
        .args(["--seed", &a.seed.to_string()])
        .args(["--drain-grace", &a.drain_grace.to_string()])
        .args(["--mailbox", &a.mailbox.to_string()])
        .args(["--core", &a.core.to_string()])
        .args(["--shards", &a.shards.to_string()])
        .args(["--appendfsync", &a.appendfsync])
        .arg("--report-out")
        .arg(&out);
    if a.no_progress {
        cmd.arg("--no-progress");
    }
    let status = cmd.status()?;
    anyhow::ensure!(status.success(), "bench load for {layout} failed: {status}");
    let text = std::fs::read_to_string(&out)?;
    let _ = std::fs::remove_file(&out);
    Ok(serde_json::from_str(&text)?)
}

fn load_options(a: &LoadArgs) -> anyhow::Result<tidemark_bench::load::LoadOptions> {
    use tidemark_bench::load::{LoadOptions, Target};
    let target = match &a.target {
        Some(ws_url) => Target::Remote {
            ws_url: ws_url.clone(),
            token_secret: match &a.secret_file {
                Some(p) => Some(std::fs::read_to_string(p)?.trim_end().as_bytes().to_vec()),
                None => None,
            },
            mailbox_urls: a.mailbox_urls.clone(),
            core_urls: a.core_urls.clone(),
        },
        None => Target::Local {
            mailbox: a.mailbox,
            core: a.core,
            shards: a.shards,
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
    })
}

#[derive(Args)]
struct LuaArgs {
    /// Redis to use (default: start a private redis-server).
    #[arg(long)]
    redis: Option<String>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 20000)]
    calls: usize,
    #[arg(long, default_value_t = 7)]
    rounds: usize,
}

fn store_exit(e: &tidemark_store::Error) -> ExitCode {
    if e.is_corrupt() {
        eprintln!("corrupt: {e}");
        ExitCode::from(EXIT_CORRUPT)
    } else if e.code() == "no_watermark" {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_MISSING)
    } else {
        eprintln!("error: {e}");
        ExitCode::FAILURE
    }
}

async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.cmd {
        Cmd::Wm(WmCmd::Init {
            redis,
            shards,
            layout,
            epoch,
            force,
        }) => match ops::wm_init(&redis, shards, layout, epoch, force).await {
            Ok(n) => {
                println!("initialised {n} shard(s) on {redis}: layout {layout}, epoch {epoch}");
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => Ok(store_exit(&e)),
        },
        Cmd::Wm(WmCmd::Inspect { redis, shard, json }) => {
            match ops::wm_inspect(&redis, shard).await {
                Ok(wm) => {
                    if json {
                        println!("{}", ops::inspect_json(shard, &wm));
                    } else {
                        print!("{}", ops::inspect_human(shard, &wm));
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => Ok(store_exit(&e)),
            }
        }
        Cmd::Wm(WmCmd::Downgrade { redis, shard, all }) => {
            eprintln!(
                "downgrade is offline: every owner (materializer) of these shards must be stopped"
            );
            let shards = if all {
                ops::discover_shards(&redis).await?
            } else {
                vec![shard.expect("clap requires --shard or --all")]
            };
            match ops::wm_downgrade(&redis, &shards).await {
                Ok(done) => {
                    for (s, wm) in done {
                        println!(
                            "shard {s}: {} ({} bytes) -> packed-v1 (1216 bytes), epoch {}",
                            wm.layout, wm.blob_len, wm.epoch
                        );
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => Ok(store_exit(&e)),
            }
        }
        Cmd::Wm(WmCmd::Verify { redis }) => {
            let (checked, findings) = ops::wm_verify(&redis).await?;
            for f in &findings {
                println!("{} shard {}: {}", f.url, f.shard, f.problem);
            }
            println!(
                "{checked} watermark(s) checked, {} problem(s)",
                findings.len()
            );
            Ok(if findings.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_CORRUPT)
            })
        }
        Cmd::Shard(ShardCmd::Fence { redis, shard }) => match ops::shard_fence(&redis, shard).await
        {
            Ok(epoch) => {
                println!("shard {shard}: epoch raised to {epoch}; older owners are fenced");
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => Ok(store_exit(&e)),
        },
        Cmd::Token(a) => {
            if !tidemark_protocol::is_valid_user_id(&a.user) {
                anyhow::bail!("--user must be 1..=128 bytes");
            }
            let secret = tidemark_client::read_secret(
                a.secret_file.as_deref(),
                tidemark_client::SECRET_ENV_VAR,
            )?;
            println!("{}", tidemark_client::make_token(&secret, &a.user, a.ttl));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Send(a) => {
            let auth = client_auth(&a.auth)?;
            let id = a.id.unwrap_or_else(tidemark_client::new_message_id);
            let offsets =
                tidemark_client::send_once(&a.auth.url, &auth, a.to, a.body, Some(id.clone()))
                    .await?;
            let list: Vec<String> = offsets
                .iter()
                .map(|(s, o)| format!("shard {s} offset {o}"))
                .collect();
            println!("sent {id}: {}", list.join(", "));
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Tail(a) => {
            let auth = client_auth(&a.auth)?;
            tidemark_client::tail(&a.auth.url, &auth, a.after, a.ack, |e| {
                println!("{}", tidemark_client::format_entry(e));
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench(BenchCmd::Load(a)) => {
            let runs = if a.target.is_none() && a.layouts.len() > 1 {
                // Each layout in a fresh process of its own: at saturation, runs made one after
                // another in one process were order-dependent (the second was always slower).
                let mut runs = Vec::new();
                for layout in &a.layouts {
                    runs.extend(run_layout_in_child(&a, *layout)?);
                }
                runs
            } else {
                tidemark_bench::load::run_load(&load_options(&a)?).await?
            };
            if let Some(path) = &a.report_out {
                std::fs::write(path, serde_json::to_string(&runs)?)?;
                return Ok(ExitCode::SUCCESS);
            }
            let text =
                tidemark_bench::load::render(&runs, false, a.json.as_deref(), a.plot.as_deref())?;
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench(BenchCmd::Ladder(a)) => {
            let steps = tidemark_bench::load::parse_steps(&a.steps)?;
            let runs = if a.load.target.is_none() {
                // every step and layout in a fresh process (see `bench load`)
                let mut runs = Vec::new();
                for step in &steps {
                    let mut args = a.load.clone();
                    args.mailbox = step.mailbox;
                    args.core = step.core;
                    args.rate = step.rate;
                    for layout in &a.load.layouts {
                        runs.extend(run_layout_in_child(&args, *layout)?);
                    }
                }
                runs
            } else {
                tidemark_bench::load::run_ladder(&load_options(&a.load)?, &steps).await?
            };
            let text = tidemark_bench::load::render(
                &runs,
                true,
                a.load.json.as_deref(),
                a.load.plot.as_deref(),
            )?;
            print!("{text}");
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Up(a) => run_up(a).await,
        Cmd::Serve(a) => run_serve(a).await,
        Cmd::Trace(a) => run_trace(a).await,
        Cmd::Bench(BenchCmd::Lua(a)) => {
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

fn shutdown_token() -> CancellationToken {
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        eprintln!("stopping...");
        c.cancel();
    });
    cancel
}

async fn run_up(a: UpArgs) -> anyhow::Result<ExitCode> {
    if !tidemark_redis_proc::redis_server_available() {
        eprintln!("error: {}", tidemark_redis_proc::Error::NotInstalled);
        return Ok(ExitCode::FAILURE);
    }
    let secret = run::load_or_create_secret(&a.data_dir)?;
    let cancel = shutdown_token();
    let up = run::up(
        run::UpOptions {
            mailbox: a.mailbox,
            core: a.core,
            shards: a.shards,
            layout: a.layout,
            listen: a.listen,
            data_dir: a.data_dir.clone(),
            gateway: GatewayOptions {
                dev_auth: a.dev_auth,
                token_secret: Some(secret),
                ..a.limits.options()
            },
            materializer: Default::default(),
            appendfsync: a.appendfsync,
        },
        cancel,
    )
    .await?;
    for line in up.endpoint_lines() {
        println!("{line}");
    }
    println!(
        "token secret in {}; mint a token with: tidemark token --user NAME --secret-file {}",
        a.data_dir.join("token.secret").display(),
        a.data_dir.join("token.secret").display()
    );
    println!("Ctrl-C stops Tidemark and its redis-servers.");
    let run::Up {
        core,
        mailbox,
        running,
        ..
    } = up;
    let res = running.wait().await;
    drop(core);
    drop(mailbox);
    res?;
    Ok(ExitCode::SUCCESS)
}

async fn run_serve(a: ServeArgs) -> anyhow::Result<ExitCode> {
    let topology = match &a.config {
        Some(path) => Topology::from_file(path)?,
        None => Topology::new(
            a.shards.expect("clap requires --shards"),
            a.layout,
            a.core.clone(),
            a.mailbox.clone(),
        ),
    };
    let secret = match &a.secret_file {
        Some(p) => Some(std::fs::read_to_string(p)?.trim_end().as_bytes().to_vec()),
        None => std::env::var("TIDEMARK_TOKEN_SECRET")
            .ok()
            .map(|s| s.into_bytes()),
    };
    if secret.is_none() && !a.dev_auth {
        anyhow::bail!(
            "no token secret: give --secret-file or TIDEMARK_TOKEN_SECRET (or --dev-auth)"
        );
    }
    let cancel = shutdown_token();
    let running = run::serve(
        run::ServeOptions {
            topology: topology.clone(),
            listen: a.listen,
            gateway: GatewayOptions {
                dev_auth: a.dev_auth,
                token_secret: secret,
                ..a.limits.options()
            },
            materializer: MaterializerOptions {
                fault: (a.fault_chunk_fail_pct > 0).then(|| {
                    std::sync::Arc::new(RandomChunkFault {
                        percent: a.fault_chunk_fail_pct,
                    })
                        as std::sync::Arc<dyn tidemark_server::materializer::ChunkFault>
                }),
                ..Default::default()
            },
            owned_shards: a.own_shards,
        },
        cancel,
    )
    .await?;
    println!("gateway  {}", running.ws_url());
    for (i, u) in topology.core.iter().enumerate() {
        println!("core     {i} {u}");
    }
    for (i, u) in topology.mailbox.iter().enumerate() {
        println!("mailbox  {i} {u}");
    }
    running.wait().await?;
    Ok(ExitCode::SUCCESS)
}

async fn run_trace(a: TraceArgs) -> anyhow::Result<ExitCode> {
    let (core, mailbox, shards) = match &a.config {
        Some(path) => {
            let t = Topology::from_file(path)?;
            let s = a.shard as usize;
            if s >= t.shards as usize {
                anyhow::bail!("shard {} is not in 0..{}", a.shard, t.shards);
            }
            (
                t.core[t.core_table()[s]].clone(),
                t.mailbox[t.mailbox_table()[s]].clone(),
                t.shards,
            )
        }
        None => (
            a.core.expect("clap requires --core"),
            a.mailbox.expect("clap requires --mailbox"),
            a.shards.expect("clap requires --shards"),
        ),
    };
    let t = match tidemark_store::trace::trace(&core, &mailbox, shards, a.shard, a.offset).await {
        Ok(t) => t,
        Err(e) => return Ok(store_exit(&e)),
    };
    if a.json {
        println!("{}", t.to_json());
    } else {
        print!("{}", t.to_human());
    }
    // 5: the trace found an inconsistency (listed as `problem` lines / in "problems")
    Ok(if t.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(5)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "warn,tidemark_server=info,tidemark_store=info".into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // TIDEMARK_LOG_FORMAT=json: one JSON object per event (for log collectors)
    if std::env::var("TIDEMARK_LOG_FORMAT").is_ok_and(|v| v == "json") {
        logs.json().init();
    } else {
        logs.init();
    }
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
