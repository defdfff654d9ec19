//! `tidemark wm …` and `tidemark shard …`: watermark and shard maintenance on the mailbox (and
//! core) Redis. Argument parsing and printing only; the work is `tidemark_ops::{wm, shard}`.

use std::process::ExitCode;

use clap::Subcommand;
use tidemark_ops as ops;
use tidemark_store::redis::watermark::Layout;

use super::exit::{missing_or_store_exit, refuse, store_exit, EXIT_CORRUPT, EXIT_REFUSED};

#[derive(Subcommand)]
pub enum WmCmd {
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
        /// Epoch of the new watermarks (an owner raises it when it claims the shard). An
        /// overwritten watermark gets at least its old epoch + 1 (an epoch never goes back).
        #[arg(long, default_value_t = 1)]
        epoch: u64,
        /// Overwrite existing watermarks (DANGEROUS: W goes back to 0, so records above it in
        /// a trimmed log are never delivered). Only for a deployment that holds no data.
        /// Refused (nothing written) while a shard's owner is live.
        #[arg(long)]
        force: bool,
        /// With --force: overwrite even shards whose owner looks live (its owner mark is at
        /// most 30 s old): only when you know every owner is stopped.
        #[arg(long, requires = "force")]
        force_offline: bool,
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
pub enum ShardCmd {
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

/// Runs one `tidemark wm` command.
pub async fn run(cmd: WmCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        WmCmd::Init {
            redis,
            shards,
            layout,
            epoch,
            force,
            force_offline,
        } => match ops::wm::init(&redis, shards, layout, epoch, force, force_offline).await {
            Ok(ops::wm::InitOutcome::Done(r)) => {
                for (s, e) in &r.raised {
                    println!(
                        "shard {s}: epoch {e} (one above the overwritten watermark's; an epoch \
                         never goes back)"
                    );
                }
                println!(
                    "initialised {} shard(s) on {}: layout {layout}, epoch {epoch}; {} already \
                     had a watermark and were left as they are",
                    r.created,
                    tidemark_store::redact_url(&redis),
                    r.present
                );
                Ok(ExitCode::SUCCESS)
            }
            Ok(ops::wm::InitOutcome::LiveOwners(live)) => {
                for (s, e) in &live {
                    eprintln!("shard {s}: a live owner holds epoch {e}");
                }
                Ok(refuse(format!(
                    "--force would reset W to 0 under {} live owner(s) (owner marks seen within \
                     30 s); nothing was written: stop every owner first, or add --force-offline \
                     when you know they are stopped",
                    live.len()
                )))
            }
            Err(e) => Ok(store_exit(&e)),
        },
        WmCmd::Inspect { redis, shard, json } => match ops::wm::inspect(&redis, shard).await {
            Ok(wm) => {
                if json {
                    println!("{}", ops::wm::inspect_json(shard, &wm));
                } else {
                    print!("{}", ops::wm::inspect_human(shard, &wm));
                }
                Ok(ExitCode::SUCCESS)
            }
            Err(e) if ops::wm::is_wrong_type(&e) => {
                eprintln!("corrupt: {}", ops::wm::wrong_type_problem(shard));
                Ok(ExitCode::from(EXIT_CORRUPT))
            }
            Err(e) => Ok(missing_or_store_exit(&redis, shard, &e).await),
        },
        WmCmd::Downgrade {
            redis,
            shard,
            all,
            force_offline,
        } => {
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
        WmCmd::Verify { redis } => {
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
    }
}

/// Runs one `tidemark shard` command.
pub async fn run_shard(cmd: ShardCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        ShardCmd::Rebase {
            redis,
            core,
            shard,
            accept_loss,
        } => match ops::shard::rebase(&redis, &core, shard, accept_loss).await {
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
                Ok(ExitCode::from(EXIT_REFUSED))
            }
            Err(e) => Ok(missing_or_store_exit(&redis, shard, &e).await),
        },
        ShardCmd::Fence { redis, shard } => match ops::shard::fence(&redis, shard).await {
            Ok(epoch) => {
                println!("shard {shard}: epoch raised to {epoch}; older owners are fenced");
                Ok(ExitCode::SUCCESS)
            }
            Err(e) => Ok(missing_or_store_exit(&redis, shard, &e).await),
        },
    }
}
