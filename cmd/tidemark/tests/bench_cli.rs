//! `tidemark bench load` and `tidemark bench ladder` through the binary, at a tiny size (issue
//! 11, item 10): the path that produced the committed figures runs every layout and every
//! ladder step in a child process of its own (`--report-out`) and merges their reports. The
//! JSON it writes must hold one run per layout (per step), in order, with every option the
//! parent was given passed on to the children (clients, rate, duration, fanout, seed, shards,
//! instance counts), every message delivered, no error, and the children's report files gone.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Runs `tidemark bench …` to completion (at most 120 s); returns (pid, stdout).
fn bench(args: &[&str]) -> (u32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.arg("bench")
        .args(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = support::spawn_killed_with_us(&mut cmd);
    let pid = child.id();
    let start = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(120));
    assert!(
        out.status.success(),
        "bench {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    (pid, String::from_utf8(out.stdout).unwrap())
}

fn runs(json: &std::path::Path) -> Vec<Value> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    v["runs"].as_array().expect("{\"runs\":[…]}").clone()
}

/// The fields every run of these tests must have: the options passed on, everything sent
/// delivered, nothing refused, one INFO entry per instance.
fn check_run(r: &Value, layout: &str, mailbox: u64, core: u64, rate: f64) {
    let what = format!("{layout} {mailbox}+{core}@{rate}: {r}");
    assert_eq!(r["layout"], layout, "{what}");
    assert_eq!(r["target"], "local", "{what}");
    assert_eq!(r["mailbox_instances"], mailbox, "{what}");
    assert_eq!(r["core_instances"], core, "{what}");
    assert_eq!(r["shards"], 4, "{what}");
    assert_eq!(r["clients"], 3, "{what}");
    assert_eq!(r["rate"].as_f64(), Some(rate), "{what}");
    assert_eq!(r["duration_s"].as_f64(), Some(1.0), "{what}");
    assert_eq!(r["fanout"], 2, "{what}");
    assert_eq!(r["seed"], 7, "{what}");
    let sent = r["sent"].as_u64().unwrap();
    assert_eq!(sent, rate as u64, "rate × duration: {what}");
    assert_eq!(
        r["expected"].as_u64(),
        Some(sent * 2),
        "sent × fanout: {what}"
    );
    assert_eq!(r["delivered"], r["expected"], "{what}");
    assert_eq!(r["delivered_in_window_pct"].as_f64(), Some(100.0), "{what}");
    assert_eq!(r["errors"], serde_json::json!({}), "{what}");
    let inst = r["per_instance"].as_array().unwrap();
    assert_eq!(inst.len() as u64, mailbox + core, "{what}");
    let pool = |p: &str| inst.iter().filter(|i| i["pool"] == p).count() as u64;
    assert_eq!((pool("mailbox"), pool("core")), (mailbox, core), "{what}");
    let calls: u64 = inst
        .iter()
        .filter(|i| i["pool"] == "mailbox")
        .map(|i| i["evalsha_calls"].as_u64().unwrap())
        .sum();
    assert!(calls > 0, "the materializer ran scripts: {what}");
    assert!(r["e2e_ms"]["p50"].as_f64().unwrap() > 0.0, "{what}");
}

/// The child report files (`tidemark-bench-<parent pid>-<layout>.json`) are removed.
fn no_child_reports_left(pid: u32) {
    for layout in ["packed-v1", "packed-v2"] {
        let f = std::env::temp_dir().join(format!("tidemark-bench-{pid}-{layout}.json"));
        assert!(!f.exists(), "{} left behind", f.display());
    }
}

/// The options of every run here, after the command's own.
const COMMON: &str = "--clients 3 --duration 1 --fanout 2 --seed 7 --shards 4 --drain-grace 5 \
                      --appendfsync everysec --no-progress";

/// Runs `tidemark bench ARGS COMMON --json FILE` (a command line, split at spaces); checks
/// it wrote the merged report and left no child report behind; returns stdout and the
/// report's runs.
fn bench_merged(args: &str) -> (String, Vec<Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir
        .path()
        .join(format!("{}.json", args.split(' ').next().unwrap()));
    let mut all: Vec<&str> = args.split(' ').chain(COMMON.split_whitespace()).collect();
    all.extend(["--json", json.to_str().unwrap()]);
    let (pid, stdout) = bench(&all);
    let wrote = format!("wrote {}", json.display());
    assert!(stdout.contains(&wrote), "{stdout}");
    no_child_reports_left(pid);
    (stdout, runs(&json))
}

#[test]
fn bench_load_runs_each_layout_in_a_child_and_merges_the_reports() {
    let (stdout, runs) =
        bench_merged("load --layouts packed-v1,packed-v2 --rate 30 --mailbox 1 --core 2");
    assert_eq!(runs.len(), 2, "one run per layout");
    for (run, layout) in runs.iter().zip(["packed-v1", "packed-v2"]) {
        check_run(run, layout, 1, 2, 30.0);
    }
    assert!(stdout.contains("packed-v1: sent 30"), "{stdout}");
    assert!(stdout.contains("packed-v2: sent 30"), "{stdout}");
}

#[test]
fn bench_ladder_runs_each_step_in_a_child_and_merges_the_reports() {
    let (stdout, runs) = bench_merged("ladder --steps 1+1@20,2+1@30 --layouts packed-v2");
    assert_eq!(runs.len(), 2, "one run per step");
    for (run, (mailbox, rate)) in runs.iter().zip([(1, 20.0), (2, 30.0)]) {
        check_run(run, "packed-v2", mailbox, 1, rate);
    }
    assert!(stdout.contains("2+1"), "the ladder table: {stdout}");
}

/// `bench load --target` against `tidemark up` in another process: the generator runs on one
/// thread of its own and reports its CPU per message and the gateway's, read from the
/// admin listener's `/metrics` (`--metrics-url`), beside every Redis instance's; the extra
/// table comes after the main one.
#[test]
fn bench_load_against_a_running_up_reports_each_process() {
    let data = support::temp_dir("bench-remote");
    let admin = support::free_port();
    let admin_listen = format!("127.0.0.1:{admin}");
    let up = support::UpProc::start(&data, &["--dev-auth", "--admin-listen", &admin_listen]);
    let ws = up
        .line("gateway")
        .split_whitespace()
        .find(|w| w.starts_with("ws://"))
        .unwrap()
        .to_owned();
    let pass = std::fs::read_to_string(data.join("redis.pass")).unwrap();
    let redis = |prefix: &str| format!("redis://:{}@127.0.0.1:{}/", pass.trim(), up.port(prefix));
    let (mailbox, core) = (redis("mailbox  0"), redis("core     0"));
    let metrics = format!("http://{admin_listen}/metrics");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("remote.json");
    let (_, stdout) = bench(&[
        "load",
        "--target",
        &ws,
        "--metrics-url",
        &metrics,
        "--mailbox-urls",
        &mailbox,
        "--core-urls",
        &core,
        "--clients",
        "3",
        "--rate",
        "30",
        "--duration",
        "1",
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
    ]);
    up.stop();
    let _ = std::fs::remove_dir_all(&data);
    let runs = runs(&json);
    let r = &runs[0];
    assert_eq!(
        (r["sent"].as_u64(), r["delivered"].as_u64()),
        (Some(30), Some(30)),
        "{r}"
    );
    assert!(r.get("unread").is_none(), "every reading was made: {r}");
    let processes = r["processes"].as_array().unwrap();
    let names: Vec<&str> = processes
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["generator", "server"], "{r}");
    assert_eq!(processes[1]["source"], metrics.as_str());
    for p in processes {
        assert!(p["cpu_us_per_msg"].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["rss_bytes"].as_u64().unwrap() > 1 << 20, "{p}");
    }
    for pool in ["mailbox", "core"] {
        assert!(
            r["redis_commands"][pool]["evalsha"]["per_msg"]
                .as_f64()
                .unwrap()
                > 0.0,
            "{r}"
        );
    }
    for row in [
        "| generator CPU per message |",
        "| server CPU per message |",
        "| server RSS at end |",
        "| per message sent | packed-v2 |",
        "| core `evalsha` calls × µs |",
    ] {
        assert!(stdout.contains(row), "no {row:?} in\n{stdout}");
    }
}

/// `tidemark bench idle` without a target: the deployment runs in the generator's process,
/// whose own `/proc/self` gives the server figures; the JSON holds them and the Redis counts.
#[test]
fn bench_idle_local() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("idle.json");
    let (_, stdout) = bench(&[
        "idle",
        "--clients",
        "20",
        "--duration",
        "1",
        "--settle",
        "0",
        "--shards",
        "4",
        "--source-addrs",
        "127.0.0.2,127.0.0.3",
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(stdout.contains("20 of 20 clients connected"), "{stdout}");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(r["target"], "local", "{r}");
    assert_eq!(
        (r["clients"].as_u64(), r["connected"].as_u64()),
        (Some(20), Some(20)),
        "{r}"
    );
    assert_eq!(r["source_addrs"]["127.0.0.2"], 10, "{r}");
    assert_eq!(r["source_addrs"]["127.0.0.3"], 10, "{r}");
    assert_eq!(r["open_at_end"], 20, "{r}");
    let server = &r["servers"][0];
    assert_eq!(server["source"], "this process", "{r}");
    assert_eq!(server["connected_clients"].as_f64(), Some(20.0), "{r}");
    assert!(server["rss_bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
    assert!(server["cpu_pct"].as_f64().is_some(), "{r}");
    let pools: Vec<&str> = r["redis"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["pool"].as_str().unwrap())
        .collect();
    assert_eq!(pools, ["mailbox", "core"], "{r}");
}
