//! Every run in a fresh process of its own: at saturation, runs made one after another in one
//! process were order-dependent (the second was always slower). [`run_load_isolated`] and
//! [`run_ladder_isolated`] start the `tidemark` binary (`exe`) as `tidemark bench load` once
//! per layout (and ladder step) against a local target; each child writes its run reports to
//! a temporary file (`--report-out`, a hidden flag of `bench load`) that the parent reads back
//! and removes.

use std::path::Path;
use std::process::Command;

use super::driver::Local;
use super::{Error, LadderStep, LoadOptions, RunReport};

/// Runs every layout of `opts` (a [`Target::Local`](super::Target::Local)) in a child process
/// of its own, in order.
pub fn run_load_isolated(exe: &Path, opts: &LoadOptions) -> Result<Vec<RunReport>, Error> {
    let Some(locals) = super::local_runs(opts) else {
        return Err(Error::Invalid(
            "only a local deployment runs in a child process".into(),
        ));
    };
    let mut runs = Vec::new();
    for local in &locals {
        runs.extend(run_child(exe, opts, local)?);
    }
    Ok(runs)
}

/// [`run_ladder`](super::run_ladder) with every step and layout in a child process of its
/// own: each step's mailbox and core instance counts and rate replace those of `base` (a
/// local target).
pub fn run_ladder_isolated(
    exe: &Path,
    base: &LoadOptions,
    steps: &[LadderStep],
) -> Result<Vec<RunReport>, Error> {
    let mut runs = Vec::new();
    for opts in super::ladder_options(base, steps)? {
        runs.extend(run_load_isolated(exe, &opts)?);
    }
    Ok(runs)
}

/// Runs `exe bench load` for one local deployment of `opts` and reads its reports back.
fn run_child(exe: &Path, opts: &LoadOptions, local: &Local) -> Result<Vec<RunReport>, Error> {
    let layout = local.layout;
    let out = std::env::temp_dir().join(format!(
        "tidemark-bench-{}-{}.json",
        std::process::id(),
        layout
    ));
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "load", "--layouts", layout.as_str()])
        .args(["--clients", &opts.clients.to_string()])
        .args(["--rate", &opts.rate.to_string()])
        .args(["--duration", &opts.duration.as_secs().to_string()])
        .args(["--fanout", &opts.fanout.to_string()])
        .args(["--seed", &opts.seed.to_string()])
        .args(["--drain-grace", &opts.drain_grace.as_secs().to_string()])
        .args(["--mailbox", &local.mailbox.to_string()])
        .args(["--core", &local.core.to_string()])
        .args(["--shards", &local.shards.to_string()])
        .args(["--appendfsync", &local.appendfsync])
        .arg("--report-out")
        .arg(&out);
    if !opts.progress {
        cmd.arg("--no-progress");
    }
    let child = |e: &dyn std::fmt::Display| Error::Child(e.to_string());
    let status = cmd.status().map_err(|e| child(&e))?;
    if !status.success() {
        return Err(child(&format!("bench load for {layout} failed: {status}")));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| child(&e))?;
    let _ = std::fs::remove_file(&out);
    serde_json::from_str(&text).map_err(|e| child(&e))
}
