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
    let mut cmd = child_command(exe, opts, local, &out);
    let child = |e: &dyn std::fmt::Display| Error::Child(e.to_string());
    let status = cmd.status().map_err(|e| child(&e))?;
    if !status.success() {
        return Err(child(&format!("bench load for {layout} failed: {status}")));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| child(&e))?;
    let _ = std::fs::remove_file(&out);
    serde_json::from_str(&text).map_err(|e| child(&e))
}

/// The child's command line: every option of `opts` that shapes a local run, so that a run in
/// a child process is the run asked for (the lingers and the ack interval were once left out,
/// and a child ran with the defaults instead).
fn child_command(exe: &Path, opts: &LoadOptions, local: &Local, out: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["bench", "load", "--layouts", local.layout.as_str()])
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
        .arg(out);
    if let Some(d) = opts.commit_linger {
        cmd.args(["--commit-linger-us", &d.as_micros().to_string()]);
    }
    if let Some(d) = opts.ack_interval {
        cmd.args(["--ack-interval-ms", &d.as_millis().to_string()]);
    }
    if let Some(d) = opts.read_linger {
        cmd.args(["--read-linger-ms", &d.as_millis().to_string()]);
    }
    if !opts.progress {
        cmd.arg("--no-progress");
    }
    cmd
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tidemark_store::redis::watermark::Layout;

    use super::*;

    fn args(opts: &LoadOptions) -> Vec<String> {
        let local = Local {
            mailbox: 2,
            core: 1,
            shards: 8,
            layout: Layout::PackedV1,
            appendfsync: "always".into(),
        };
        child_command(
            Path::new("tidemark"),
            opts,
            &local,
            Path::new("/tmp/r.json"),
        )
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
    }

    /// The value that follows `flag` in `args`, if the flag is there.
    fn value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
        let i = args.iter().position(|a| a == flag)?;
        args.get(i + 1).map(String::as_str)
    }

    #[test]
    fn a_child_gets_every_option_that_shapes_its_run() {
        let opts = LoadOptions {
            commit_linger: Some(Duration::from_micros(2500)),
            ack_interval: Some(Duration::from_millis(250)),
            read_linger: Some(Duration::from_millis(4)),
            ..LoadOptions::default()
        };
        let a = args(&opts);
        assert_eq!(value(&a, "--layouts"), Some("packed-v1"));
        assert_eq!(value(&a, "--mailbox"), Some("2"));
        assert_eq!(value(&a, "--shards"), Some("8"));
        assert_eq!(value(&a, "--appendfsync"), Some("always"));
        assert_eq!(value(&a, "--commit-linger-us"), Some("2500"));
        assert_eq!(value(&a, "--ack-interval-ms"), Some("250"));
        assert_eq!(value(&a, "--read-linger-ms"), Some("4"));
        // defaults stay the child's own: nothing is passed for them
        let a = args(&LoadOptions::default());
        for flag in [
            "--commit-linger-us",
            "--ack-interval-ms",
            "--read-linger-ms",
        ] {
            assert_eq!(value(&a, flag), None, "{flag}");
        }
    }
}
