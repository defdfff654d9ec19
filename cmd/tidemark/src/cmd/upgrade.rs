//! `tidemark upgrade`: raises a deployment's identity version from 2 to 3, so that it writes
//! packed log records (ADR-0055, ADR-0056). Argument parsing and printing only; the checks and
//! the raise are `tidemark_ops::upgrade`.

use std::process::ExitCode;

use clap::Args;
use tidemark_store::redis::watermark::Layout;

use super::args::InstancesArgs;
use super::exit::{store_exit, EXIT_PROBLEMS, EXIT_REFUSED};

#[derive(Args)]
pub struct UpgradeArgs {
    #[command(flatten)]
    instances: InstancesArgs,
    /// Check only: print the versions and what blocks a raise, write nothing.
    #[arg(long)]
    check: bool,
    /// One JSON object instead of lines.
    #[arg(long)]
    json: bool,
}

/// Runs `tidemark upgrade`: 0 when raised, already done, or (`--check`) nothing blocks;
/// [`EXIT_REFUSED`] when something blocks (nothing written); [`EXIT_PROBLEMS`] when raised but
/// a process appeared meanwhile.
pub async fn run(a: UpgradeArgs) -> anyhow::Result<ExitCode> {
    // the layout is not read: identities and marks do not depend on it
    let map = a.instances.topology(Layout::PackedV2)?.validate()?;
    let report = match tidemark_ops::upgrade::upgrade(&map, a.check).await {
        Ok(r) => r,
        Err(e) => return Ok(store_exit(&e)),
    };
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", tidemark_ops::upgrade::to_human(&report, a.check));
    }
    Ok(if !report.plan.blockers.is_empty() {
        ExitCode::from(EXIT_REFUSED)
    } else if !report.late.is_empty() || !report.skipped.is_empty() {
        ExitCode::from(EXIT_PROBLEMS)
    } else {
        ExitCode::SUCCESS
    })
}
