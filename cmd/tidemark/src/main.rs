//! The `tidemark` command: parses arguments and calls the library crates. Nothing else.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tidemark_ops as ops;
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::{MaterializerOptions, RandomChunkFault};
use tidemark_server::run;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::Topology;
use tokio_util::sync::CancellationToken;

/// Exit status for a corrupt watermark (scripts rely on it).
const EXIT_CORRUPT: u8 = 3;
/// Exit status for a missing watermark.
const EXIT_MISSING: u8 = 4;
/// Exit status for a refused configuration (bad token secret, unsafe flags): like clap's
/// usage errors, and nothing was started.
const EXIT_REFUSED: u8 = 2;

/// Prints `error: <why>` and returns [`EXIT_REFUSED`].
fn refuse(why: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {why}");
    ExitCode::from(EXIT_REFUSED)
}

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
    /// Token secret files.
    #[command(subcommand)]
    Secret(SecretCmd),
}

#[derive(Subcommand)]
enum SecretCmd {
    /// Write a new token secret (32 random bytes as 64 hex digits, mode 0600) to a file that
    /// does not exist yet; give it to `serve --secret-file` and `token --secret-file`.
    Gen {
        /// The file to create (never overwritten).
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

#[derive(Args)]
struct TokenArgs {
    /// The user the token names (1..=128 bytes, no control character).
    #[arg(long)]
    user: String,
    /// Lifetime: whole seconds with an optional unit, e.g. 3600, 90s, 15m, 24h, 7d (not 0).
    #[arg(long, default_value = "24h", value_parser = tidemark_client::parse_ttl)]
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
    /// When the server goes away, stop (exit 0) instead of reconnecting.
    #[arg(long)]
    no_reconnect: bool,
    /// Give up reconnecting (exit non-zero) after this long without a connection, e.g. 30s,
    /// 5m.
    #[arg(long, default_value = "2m", value_parser = tidemark_client::parse_ttl)]
    give_up_after: std::time::Duration,
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
    /// The shard (the key of `send_ack`'s `offsets`).
    #[arg(long)]
    shard: u32,
    /// The offset in the shard's log (the `seq` a client sees).
    #[arg(long)]
    offset: u64,
    /// One JSON object instead of text.
    #[arg(long)]
    json: bool,
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
    /// Accept `?user=NAME` without a token (development only; loopback --listen only).
    #[arg(long)]
    dev_auth: bool,
    /// Allow --dev-auth on a non-loopback --listen address (anyone who reaches it can act as
    /// any user).
    #[arg(long, requires = "dev_auth")]
    dev_auth_public: bool,
    /// Watermark layout to write.
    #[arg(long, default_value = "packed-v2", value_parser = ops::parse_layout)]
    layout: Layout,
    /// appendfsync of every instance: always (default: nothing acknowledged is lost), everysec.
    #[arg(long, default_value = "always")]
    appendfsync: String,
    #[command(flatten)]
    listeners: ListenerArgs,
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
    /// Accept `?user=NAME` without a token (development only; loopback --listen only).
    #[arg(long)]
    dev_auth: bool,
    /// Allow --dev-auth on a non-loopback --listen address (anyone who reaches it can act as
    /// any user).
    #[arg(long, requires = "dev_auth")]
    dev_auth_public: bool,
    /// Watermark layout to write (without --config; with it, the file's `layout` decides).
    #[arg(long, default_value = "packed-v2", value_parser = ops::parse_layout, conflicts_with = "config")]
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
    listeners: ListenerArgs,
    #[command(flatten)]
    limits: GatewayLimitArgs,
}

/// TLS and the admin listener (`serve` and `up`; docs/operations.md, ADR-0027).
#[derive(Args)]
struct ListenerArgs {
    /// Serve wss:// and https:// with this PEM certificate chain (leaf first).
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Serve /metrics and /healthz here instead (plain HTTP, no auth: loopback or a private
    /// network); the --listen address then answers them 404.
    #[arg(long)]
    admin_listen: Option<std::net::SocketAddr>,
}

impl ListenerArgs {
    /// Loads the certificate and key (if given): a file that cannot be used is refused (exit
    /// 2) before anything starts.
    fn tls(&self) -> Result<Option<tidemark_server::gateway::TlsConfig>, ExitCode> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => {
                tidemark_server::gateway::TlsConfig::from_pem_files(cert, key)
                    .map(Some)
                    .map_err(refuse)
            }
            _ => Ok(None),
        }
    }
}

/// Limits on slow, idle and greedy clients (`serve` and `up`; docs/operations.md, ADR-0025).
#[derive(Args)]
struct GatewayLimitArgs {
    /// Most open client connections (WebSockets included); beyond: HTTP 503 `overloaded`.
    #[arg(long, default_value_t = 10_000)]
    max_connections: usize,
    /// A request head (or body) must arrive within this time, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = tidemark_client::parse_ttl)]
    header_read_timeout: std::time::Duration,
    /// Ping a WebSocket client after this much silence.
    #[arg(long, default_value = "20s", value_parser = tidemark_client::parse_ttl)]
    ws_ping_interval: std::time::Duration,
    /// Close a WebSocket (4002) from which nothing, not even a pong, arrived for this long.
    #[arg(long, default_value = "60s", value_parser = tidemark_client::parse_ttl)]
    ws_idle_timeout: std::time::Duration,
    /// Bytes of outbound frames one WebSocket may have queued (e.g. 65536, 64k, 1m).
    #[arg(long, default_value = "64k", value_parser = parse_bytes)]
    max_queued_bytes: usize,
    /// Close a WebSocket (4003) whose frames waited this long for room; drop an HTTP
    /// response whose writes made no progress for this long.
    #[arg(long, default_value = "30s", value_parser = tidemark_client::parse_ttl)]
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
        /// The mailbox Redis instance.
        #[arg(long)]
        redis: String,
        /// Initialise shards 0..SHARDS (the deployment's shard count).
        #[arg(long)]
        shards: u32,
        /// Layout written: packed-v2 (default) or packed-v1.
        #[arg(long, default_value = "packed-v2", value_parser = ops::parse_layout)]
        layout: Layout,
        /// Epoch of the new watermarks (an owner raises it when it claims the shard).
        #[arg(long, default_value_t = 1)]
        epoch: u64,
        /// Overwrite existing watermarks (DANGEROUS: W goes back to 0, so records above it in
        /// a trimmed log are never delivered). Only for a deployment that holds no data.
        #[arg(long)]
        force: bool,
    },
    /// Show one shard's watermark (read through read_log_watermarks.lua).
    Inspect {
        /// The mailbox Redis instance holding the shard.
        #[arg(long)]
        redis: String,
        /// The shard.
        #[arg(long)]
        shard: u32,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Offline downgrade to packed-v1 (19 -> 1216 bytes). Stop every owner first.
    Downgrade {
        /// The mailbox Redis instance.
        #[arg(long)]
        redis: String,
        /// One shard.
        #[arg(long, conflicts_with = "all", required_unless_present = "all")]
        shard: Option<u32>,
        /// Every shard with a watermark on the instance.
        #[arg(long)]
        all: bool,
        /// Downgrade even shards whose owner looks live (its mark is at most 5 s old): only
        /// when you know every owner is stopped.
        #[arg(long)]
        force_offline: bool,
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
    /// After a restore moved a mailbox instance's W back behind the trimmed core log (the
    /// owner reports a log discontinuity): move the lanes below the log's start up to it,
    /// giving up the offsets in between. Without --accept-loss, only says what it would do.
    Rebase {
        /// The mailbox Redis holding the shard.
        #[arg(long)]
        redis: String,
        /// The core Redis holding the shard's log.
        #[arg(long)]
        core: String,
        /// The shard.
        #[arg(long)]
        shard: u32,
        /// Write it: the offsets between W and the log's first record are given up.
        #[arg(long)]
        accept_loss: bool,
    },
    /// Raise a shard's epoch so a running old owner fails closed on its next script.
    Fence {
        /// The mailbox Redis instance holding the shard.
        #[arg(long)]
        redis: String,
        /// The shard.
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
    /// The tables (and, with --plot, the figures) of a JSON report that `bench load|ladder
    /// --json` wrote, without running anything.
    Report(ReportArgs),
}

#[derive(Args)]
struct ReportArgs {
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
    /// Script calls timed per round and variant.
    #[arg(long, default_value_t = 20000)]
    calls: usize,
    /// Rounds (the report keeps the median).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
}

/// [`store_exit`], and for a missing watermark one line on why (`ops::wm::explain_missing`).
async fn missing_or_store_exit(url: &str, shard: u32, e: &tidemark_store::Error) -> ExitCode {
    let code = store_exit(e);
    if e.code() == "no_watermark" {
        eprintln!("{}", ops::wm::explain_missing(url, shard).await);
    }
    code
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
        }) => match ops::wm::init(&redis, shards, layout, epoch, force).await {
            Ok((created, present)) => {
                println!(
                    "initialised {created} shard(s) on {redis}: layout {layout}, epoch {epoch}; \
                     {present} already had a watermark and were left as they are"
                );
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => Ok(store_exit(&e)),
        },
        Cmd::Wm(WmCmd::Inspect { redis, shard, json }) => {
            match ops::wm::inspect(&redis, shard).await {
                Ok(wm) => {
                    if json {
                        println!("{}", ops::wm::inspect_json(shard, &wm));
                    } else {
                        print!("{}", ops::wm::inspect_human(shard, &wm));
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => Ok(missing_or_store_exit(&redis, shard, &e).await),
            }
        }
        Cmd::Wm(WmCmd::Downgrade {
            redis,
            shard,
            all,
            force_offline,
        }) => {
            eprintln!(
                "downgrade is offline: every owner (materializer) of these shards must be stopped"
            );
            if force_offline {
                eprintln!(
                    "warning: --force-offline: shards are converted even where an owner looks \
                     live; a live owner would write packed-v2 again"
                );
            }
            let shards = if all {
                ops::wm::discover_shards(&redis).await?
            } else {
                vec![shard.expect("clap requires --shard or --all")]
            };
            match ops::wm::downgrade(&redis, &shards, force_offline).await {
                Ok(report) => {
                    for (s, wm) in &report.converted {
                        println!(
                            "shard {s}: {} ({} bytes) -> packed-v1 (1216 bytes), epoch {}",
                            wm.layout, wm.blob_len, wm.epoch
                        );
                    }
                    for (s, why) in &report.skipped {
                        println!("shard {s}: skipped: {why}");
                    }
                    println!(
                        "{} converted, {} skipped",
                        report.converted.len(),
                        report.skipped.len()
                    );
                    Ok(if report.skipped.is_empty() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    })
                }
                Err(e) => Ok(store_exit(&e)),
            }
        }
        Cmd::Wm(WmCmd::Verify { redis }) => {
            let (checked, findings) = ops::wm::verify(&redis).await?;
            for f in &findings {
                match f.shard {
                    Some(s) => println!("{} shard {s}: {}", f.url, f.problem),
                    None => println!("{}: {}", f.url, f.problem),
                }
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
        Cmd::Shard(ShardCmd::Rebase {
            redis,
            core,
            shard,
            accept_loss,
        }) => match ops::shard::rebase(&redis, &core, shard, accept_loss).await {
            Ok(r) if r.min_w >= r.to => {
                println!(
                    "shard {shard}: W={} and the log continues from it (first record above {}): \
                     nothing to rebase",
                    r.min_w, r.to
                );
                Ok(ExitCode::SUCCESS)
            }
            Ok(r) if r.done => {
                println!(
                    "shard {shard}: lanes below {} moved up to it; offsets {}..={} given up \
                     (not in the log any more); a held owner resumes within seconds",
                    r.to,
                    r.min_w + 1,
                    r.to
                );
                Ok(ExitCode::SUCCESS)
            }
            Ok(r) => {
                println!(
                    "shard {shard}: W={} but the log starts after {}: offsets {}..={} are \
                     gone from it; run again with --accept-loss to move the lanes up to {} \
                     and resume",
                    r.min_w,
                    r.to,
                    r.min_w + 1,
                    r.to,
                    r.to
                );
                Ok(ExitCode::from(2))
            }
            Err(e) => Ok(missing_or_store_exit(&redis, shard, &e).await),
        },
        Cmd::Shard(ShardCmd::Fence { redis, shard }) => {
            match ops::shard::fence(&redis, shard).await {
                Ok(epoch) => {
                    println!("shard {shard}: epoch raised to {epoch}; older owners are fenced");
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => Ok(missing_or_store_exit(&redis, shard, &e).await),
            }
        }
        Cmd::Token(a) => {
            if !tidemark_protocol::is_valid_user_id(&a.user) {
                anyhow::bail!("--user must be 1..=128 bytes without control characters");
            }
            let secret = match tidemark_client::read_secret(
                a.secret_file.as_deref(),
                tidemark_client::SECRET_ENV_VAR,
            ) {
                Ok(s) => s,
                Err(e) => return Ok(refuse(e)),
            };
            match tidemark_client::make_token(&secret, &a.user, a.ttl) {
                Ok(t) => println!("{t}"),
                Err(e) => return Ok(refuse(e)),
            }
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
        Cmd::Secret(SecretCmd::Gen { out }) => {
            if out.exists() {
                eprintln!(
                    "error: {} exists; a secret file is never overwritten (tokens signed with \
                     it would stop working): choose another path or remove it first",
                    out.display()
                );
                return Ok(ExitCode::from(2));
            }
            tidemark_protocol::secret::load_or_create(&out)?;
            println!("wrote a new token secret to {} (mode 0600)", out.display());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Tail(a) => {
            let auth = client_auth(&a.auth)?;
            let reconnect = (!a.no_reconnect).then_some(tidemark_client::Reconnect {
                give_up_after: a.give_up_after,
            });
            tidemark_client::tail_with(
                &a.auth.url,
                &auth,
                a.after,
                a.ack,
                reconnect,
                |e| println!("{}", tidemark_client::format_entry(e)),
                |line| eprintln!("tail: {line}"),
            )
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
        Cmd::Bench(BenchCmd::Report(a)) => {
            let text = std::fs::read_to_string(&a.json)
                .map_err(|e| anyhow::anyhow!("{}: {e}", a.json.display()))?;
            let runs = tidemark_bench::load::from_json(&text)
                .map_err(|e| anyhow::anyhow!("{}: {e}", a.json.display()))?;
            let text = tidemark_bench::load::render(&runs, a.ladder, None, a.plot.as_deref())?;
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

/// `--dev-auth` trusts `?user=NAME` from anyone who reaches the listener: refused on a
/// non-loopback address unless `--dev-auth-public` says so (then a warning is printed).
fn check_dev_auth(dev_auth: bool, public: bool, listen: std::net::SocketAddr) -> Option<ExitCode> {
    let loopback = match listen.ip() {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        std::net::IpAddr::V6(ip) => ip
            .to_ipv4_mapped()
            .map_or(ip.is_loopback(), |v4| v4.is_loopback()),
    };
    if !dev_auth || loopback {
        return None;
    }
    if !public {
        return Some(refuse(format!(
            "--dev-auth on {listen}, which is not a loopback address, would let anyone who can \
             reach it act as any user; listen on 127.0.0.1 (or [::1]), or add --dev-auth-public \
             to accept that"
        )));
    }
    eprintln!(
        "warning: --dev-auth-public: {listen} accepts ?user=NAME without a token; anyone who \
         can reach it can read and send as any user"
    );
    None
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
        notice("stopping...");
        c.cancel();
    });
    cancel
}

async fn run_up(a: UpArgs) -> anyhow::Result<ExitCode> {
    if let Some(code) = check_dev_auth(a.dev_auth, a.dev_auth_public, a.listen) {
        return Ok(code);
    }
    let tls = match a.listeners.tls() {
        Ok(t) => t,
        Err(code) => return Ok(code),
    };
    if !tidemark_redis_proc::redis_server_available() {
        eprintln!("error: {}", tidemark_redis_proc::Error::NotInstalled);
        return Ok(ExitCode::FAILURE);
    }
    // the data dir holds the secrets: private (0700 / 0600), tightened when it was not
    let tightened = match run::prepare_data_dir(&a.data_dir) {
        Ok(t) => t,
        Err(e) => return Ok(refuse(e)),
    };
    if !tightened.is_empty() {
        eprintln!(
            "note: {} was readable by other users; removed group/other access from {} path(s):",
            a.data_dir.display(),
            tightened.len()
        );
        for t in tightened.iter().take(8) {
            eprintln!("  {t}");
        }
        if tightened.len() > 8 {
            eprintln!("  … and {} more", tightened.len() - 8);
        }
    }
    let secret = match run::load_or_create_secret(&a.data_dir) {
        Ok(s) => s,
        Err(run::Error::Secret(e)) => return Ok(refuse(e)),
        Err(e) => return Err(e.into()),
    };
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
                token_secret: Some(secret.into_bytes()),
                tls,
                admin_listen: a.listeners.admin_listen,
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
    if let Some(code) = check_dev_auth(a.dev_auth, a.dev_auth_public, a.listen) {
        return Ok(code);
    }
    let tls = match a.listeners.tls() {
        Ok(t) => t,
        Err(code) => return Ok(code),
    };
    let topology = match &a.config {
        Some(path) => Topology::from_file(path)?,
        None => Topology::new(
            a.shards.expect("clap requires --shards"),
            a.layout,
            a.core.clone(),
            a.mailbox.clone(),
        ),
    };
    let secret = match tidemark_protocol::secret::load_optional(
        a.secret_file.as_deref(),
        tidemark_protocol::secret::SECRET_ENV_VAR,
    ) {
        Ok(s) => s.map(|s| s.into_bytes()),
        Err(e) => return Ok(refuse(e)),
    };
    if secret.is_none() && !a.dev_auth {
        return Ok(refuse(format!(
            "no token secret: give --secret-file or {} (or --dev-auth)",
            tidemark_protocol::secret::SECRET_ENV_VAR
        )));
    }
    let cancel = shutdown_token();
    let running = run::serve(
        run::ServeOptions {
            topology: topology.clone(),
            listen: a.listen,
            gateway: GatewayOptions {
                dev_auth: a.dev_auth,
                token_secret: secret,
                tls,
                admin_listen: a.listeners.admin_listen,
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
    if running.admin_addr.is_some() {
        println!(
            "admin    {} (GET /metrics, GET /healthz)",
            running.admin_url()
        );
    }
    for (i, u) in topology.core.iter().enumerate() {
        println!("core     {i} {}", tidemark_store::redact_url(u));
    }
    for (i, u) in topology.mailbox.iter().enumerate() {
        println!("mailbox  {i} {}", tidemark_store::redact_url(u));
    }
    running.wait().await?;
    Ok(ExitCode::SUCCESS)
}

async fn run_trace(a: TraceArgs) -> anyhow::Result<ExitCode> {
    let instances = match &a.config {
        Some(path) => ops::trace::Instances::File(path),
        None => ops::trace::Instances::Single {
            shards: a.shards.expect("clap requires --shards"),
            core: a.core.as_deref().expect("clap requires --core"),
            mailbox: a.mailbox.as_deref().expect("clap requires --mailbox"),
        },
    };
    let map = instances.shard_map()?;
    let t = match ops::trace::trace(&map, a.shard, a.offset).await {
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

/// True when logs are JSON lines (`TIDEMARK_LOG_FORMAT=json`): then every message for stderr
/// goes through `tracing` too.
static JSON_LOGS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

/// A line for the operator on stderr: a log event in JSON mode, plain text otherwise.
fn notice(msg: &str) {
    if JSON_LOGS.get().copied().unwrap_or(false) {
        tracing::info!("{msg}");
    } else {
        eprintln!("{msg}");
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "warn,tidemark_server=info,tidemark_store=info".into());
    // colours only for a person at a terminal, never in files or log collectors
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // TIDEMARK_LOG_FORMAT=json: one JSON object per event (for log collectors), and nothing
    // else on stderr
    let json = std::env::var("TIDEMARK_LOG_FORMAT").is_ok_and(|v| v == "json");
    let _ = JSON_LOGS.set(json);
    if json {
        logs.json().init();
    } else {
        logs.init();
    }
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            if json {
                tracing::error!(error = %format!("{e:#}"), "exiting");
            } else {
                eprintln!("error: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Every flag and argument of every command says what it is for (`--help`).
    #[test]
    fn every_flag_has_help_text() {
        fn walk(cmd: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in cmd.get_arguments() {
                let id = a.get_id().as_str();
                if id == "help" || id == "version" {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    missing.push(format!("{path} --{id}"));
                }
            }
            for sub in cmd.get_subcommands() {
                if sub.get_about().is_none() {
                    missing.push(format!("{path} {} (no about)", sub.get_name()));
                }
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "tidemark", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:#?}");
    }
}
