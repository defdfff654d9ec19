//! `tidemark bench catchup` and `tidemark bench commit` through the binary, at a tiny size
//! (issue 15): each starts its own redis-servers, runs, and writes a JSON report whose runs
//! hold the options given and figures that add up — every record materialised (W at the head
//! of every shard is checked by the benchmark itself), every send committed without error,
//! Redis CPU for every instance — and `--append` adds a run to the file.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Runs `tidemark bench …` to completion (at most 120 s); returns stdout.
fn bench(args: &[&str]) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.arg("bench")
        .args(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = support::spawn_killed_with_us(&mut cmd);
    let start = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(120));
    assert!(
        out.status.success(),
        "bench {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn runs(json: &std::path::Path) -> Vec<Value> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    v["runs"].as_array().expect("{\"runs\":[…]}").clone()
}

#[test]
fn bench_catchup_materialises_the_whole_backlog_and_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("catchup.json");
    let j = json.to_str().unwrap();
    let args = [
        "catchup",
        "--records",
        "3000",
        "--recipients",
        "2",
        "--mailbox",
        "2",
        "--core",
        "1",
        "--shards",
        "8",
        "--label",
        "tiny",
        "--no-progress",
        "--json",
        j,
    ];
    let out = bench(&args);
    assert!(out.contains("catch-up of 3,000 records"), "{out}");
    let r = &runs(&json)[0];
    assert_eq!(r["bench"], "catchup", "{r}");
    assert_eq!(r["label"], "tiny");
    assert_eq!(
        (r["records"].as_u64(), r["entries"].as_u64()),
        (Some(3000), Some(6000))
    );
    assert_eq!(
        (r["mailbox"].as_u64(), r["core"].as_u64()),
        (Some(2), Some(1))
    );
    assert!(r["records_per_s"].as_f64().unwrap() > 0.0, "{r}");
    let mbs = r["per_mailbox"].as_array().unwrap();
    assert_eq!(mbs.len(), 2);
    let records: u64 = mbs.iter().map(|m| m["records"].as_u64().unwrap()).sum();
    assert_eq!(
        records, 3000,
        "every record is on one mailbox instance: {r}"
    );
    for m in mbs {
        assert!(m["redis"]["cpu_s"].as_f64().unwrap() > 0.0, "{m}");
        // two recipients: the chunked path writes lane chunks and advances the lanes
        assert!(
            m["redis"]["commands"]["evalsha"]["calls_per_unit"]
                .as_f64()
                .unwrap()
                > 0.0
        );
    }
    assert_eq!(r["per_core"].as_array().unwrap().len(), 1);

    // --append adds a run (one recipient: the hot path)
    let mut args = args.to_vec();
    args[4] = "1";
    args.push("--append");
    bench(&args);
    let all = runs(&json);
    assert_eq!(all.len(), 2);
    assert_eq!(all[1]["recipients"], 1);
    assert_eq!(all[1]["entries"], 3000);
}

#[test]
fn bench_commit_commits_through_the_gateways_path_and_reports_it() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("commit.json");
    let out = bench(&[
        "commit",
        "--rate",
        "max",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--senders",
        "20",
        "--core",
        "2",
        "--shards",
        "8",
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.contains("commits at rate max"), "{out}");
    let r = &runs(&json)[0];
    assert_eq!(r["bench"], "commit", "{r}");
    assert_eq!(r["rate"], Value::Null);
    assert!(r["errors"].as_object().unwrap().is_empty(), "{r}");
    let sends = r["sends"].as_u64().unwrap();
    assert!(sends > 0, "{r}");
    let cores = r["per_core"].as_array().unwrap();
    assert_eq!(cores.len(), 2);
    let commits: u64 = cores.iter().map(|c| c["commits"].as_u64().unwrap()).sum();
    assert_eq!(
        commits, sends,
        "one recipient: one shard commit per send: {r}"
    );
    for c in cores {
        let calls = c["redis"]["commands"]["evalsha"]["calls_per_unit"]
            .as_f64()
            .unwrap();
        assert!(
            calls > 0.0 && calls <= 1.0,
            "at most one script call per commit: {c}"
        );
    }

    // a paced run records its rate (how close it came is a figure, not a test)
    let paced = dir.path().join("paced.json");
    bench(&[
        "commit",
        "--rate",
        "200",
        "--duration",
        "1",
        "--warmup",
        "0",
        "--senders",
        "10",
        "--shards",
        "4",
        "--no-progress",
        "--json",
        paced.to_str().unwrap(),
    ]);
    let r = &runs(&paced)[0];
    assert_eq!(r["rate"].as_f64(), Some(200.0));
    assert!(r["errors"].as_object().unwrap().is_empty(), "{r}");
}
