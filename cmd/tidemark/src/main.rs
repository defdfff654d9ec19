//! The `tidemark` command: parses arguments and calls the library crates. Nothing else.

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tidemark_store::ops;
use tidemark_store::redis::watermark::Layout;

/// Exit status for a corrupt watermark (scripts rely on it).
const EXIT_CORRUPT: u8 = 3;
/// Exit status for a missing watermark.
const EXIT_MISSING: u8 = 4;

#[derive(Parser)]
#[command(name = "tidemark", version, about = "Tidemark: gap-free mailbox delivery on Redis")]
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
            println!("{checked} watermark(s) checked, {} problem(s)", findings.len());
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
        Cmd::Bench(BenchCmd::Lua(a)) => {
            let _ = a;
            anyhow::bail!("bench lua: not wired yet")
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    match rt.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
