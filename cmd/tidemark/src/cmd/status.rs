//! `tidemark status`: the deployment's live nodes and every shard's owner, epoch, W, head and
//! lag. Argument parsing and printing only; the reads are `tidemark_ops::status`. Exits 3
//! (as `wm verify`) when a shard's watermark cannot be read (ADR-0110).

use std::process::ExitCode;

use clap::Args;
use tidemark_store::redis::watermark::Layout;

use super::args::InstancesArgs;
use super::exit::{store_exit, EXIT_CORRUPT};

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    instances: InstancesArgs,
    /// One JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

/// Runs `tidemark status`.
pub async fn run(a: StatusArgs) -> anyhow::Result<ExitCode> {
    // every watermark names its own layout: the one given here is not used to read
    let topology = a.instances.topology(Layout::PackedV2)?;
    let map = topology.validate()?;
    let status = match tidemark_ops::status::status(&map).await {
        Ok(s) => s,
        // a `wm:{s}` that is not a hash fails the whole read; `wm verify` names it
        Err(e) if tidemark_ops::wm::is_wrong_type(&e) => {
            eprintln!(
                "corrupt: a watermark key is not a hash (WRONGTYPE); `tidemark wm verify \
                 --redis URL` names it"
            );
            return Ok(ExitCode::from(EXIT_CORRUPT));
        }
        Err(e) => return Ok(store_exit(&e)),
    };
    if a.json {
        println!("{}", serde_json::to_string(&status)?);
    } else {
        print!("{}", tidemark_ops::status::to_human(&status));
    }
    Ok(exit_of(&status))
}

/// 0, or [`EXIT_CORRUPT`] when a shard's watermark could not be read (corrupt or missing: its
/// line has an `error`), as `wm verify` exits for any problem; after the whole status is
/// printed.
fn exit_of(status: &tidemark_ops::status::Status) -> ExitCode {
    let bad = status.shards.iter().filter(|s| s.error.is_some()).count();
    if bad == 0 {
        return ExitCode::SUCCESS;
    }
    eprintln!(
        "{bad} shard(s) with an unreadable watermark (error: …); `tidemark wm verify` checks them"
    );
    ExitCode::from(EXIT_CORRUPT)
}
