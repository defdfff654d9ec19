//! `tidemark trace`: follows one message from its commit to every mailbox entry. Argument
//! parsing and printing only; the trace is `tidemark_ops::trace`.

use std::process::ExitCode;

use clap::Args;
use tidemark_ops as ops;

use super::exit::{store_exit, EXIT_PROBLEMS};

#[derive(Args)]
pub struct TraceArgs {
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

/// Runs `tidemark trace`.
pub async fn run(a: TraceArgs) -> anyhow::Result<ExitCode> {
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
    Ok(if t.problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_PROBLEMS)
    })
}
