//! `tidemark status`: the deployment's live nodes and every shard's owner, epoch, W, head and
//! lag. Argument parsing and printing only; the reads are `tidemark_ops::status`.

use std::process::ExitCode;

use clap::Args;
use tidemark_store::redis::watermark::Layout;

use super::args::InstancesArgs;
use super::exit::store_exit;

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
        Err(e) => return Ok(store_exit(&e)),
    };
    if a.json {
        println!("{}", serde_json::to_string(&status)?);
    } else {
        print!("{}", tidemark_ops::status::to_human(&status));
    }
    Ok(ExitCode::SUCCESS)
}
