//! `tidemark status`: the deployment's live nodes and every shard's owner, epoch, W, head and
//! lag. Argument parsing and printing only; the reads are `tidemark_ops::status`.

use std::process::ExitCode;

use clap::Args;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::Topology;

use super::exit::store_exit;

#[derive(Args)]
pub struct StatusArgs {
    /// Core Redis URLs (comma-separated; else use --config).
    #[arg(long, value_delimiter = ',', required_unless_present = "config")]
    core: Vec<String>,
    /// Mailbox Redis URLs (comma-separated; else use --config).
    #[arg(long, value_delimiter = ',', required_unless_present = "config")]
    mailbox: Vec<String>,
    /// Shards of the deployment.
    #[arg(long, required_unless_present = "config")]
    shards: Option<u32>,
    /// TOML deployment file (instances and tables).
    #[arg(long, conflicts_with_all = ["core", "mailbox", "shards"])]
    config: Option<std::path::PathBuf>,
    /// One JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

/// Runs `tidemark status`.
pub async fn run(a: StatusArgs) -> anyhow::Result<ExitCode> {
    let topology = match &a.config {
        Some(path) => Topology::from_file(path)?,
        // every watermark names its own layout: the one given here is not used to read
        None => Topology::new(
            a.shards.expect("clap requires --shards"),
            Layout::PackedV2,
            a.core.clone(),
            a.mailbox.clone(),
        ),
    };
    let map = topology.validate()?;
    let status = match tidemark_ops::status::status(&map).await {
        Ok(s) => s,
        Err(e) => return Ok(store_exit(&e)),
    };
    if a.json {
        println!("{}", serde_json::to_string(&status)?);
    } else {
        print!("{}", status.to_human());
    }
    Ok(ExitCode::SUCCESS)
}
