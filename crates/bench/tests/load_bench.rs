//! The load generator against real local deployments (redis-server processes, the gateway and
//! the materializers in this process), with tiny sizes: the reports are well-formed, every
//! message is sent and delivered, the JSON has its shape, the tables and the plots come out.
//! Speed is never asserted.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tidemark_bench::load::{
    self, ladder_table, markdown_table, parse_steps, to_json, LadderStep, LoadOptions, Percentiles,
    PoolPair, RunReport, Target, CURVE_PERCENTILES,
};
use tidemark_bench::plot::write_plots;
use tidemark_store::redis::watermark::Layout;

fn tiny(layouts: Vec<Layout>) -> LoadOptions {
    LoadOptions {
        clients: 20,
        rate: 200.0,
        duration: Duration::from_secs(2),
        fanout: 1,
        seed: 42,
        drain_grace: Duration::from_secs(5),
        target: Target::Local {
            mailbox: 1,
            core: 1,
            shards: 4,
            appendfsync: "everysec".into(),
        },
        layouts,
        progress: false,
    }
}

fn check_percentiles(p: &Percentiles, what: &str) {
    assert!(p.p50 > 0.0, "{what}: {p:?}");
    assert!(
        p.p50 <= p.p99 && p.p99 <= p.p999 && p.p999 <= p.max,
        "{what}: {p:?}"
    );
}

fn check_run(r: &RunReport, layout: Layout) {
    assert_eq!(r.layout, layout);
    assert_eq!(r.target, "local");
    assert_eq!(
        (
            r.clients,
            r.fanout,
            r.mailbox_instances,
            r.core_instances,
            r.shards
        ),
        (20, 1, 1, 1, 4)
    );
    assert_eq!(r.duration_s, 2.0);
    assert_eq!(r.sent, 400, "rate × duration");
    assert_eq!(r.expected, 400);
    assert!(r.errors.is_empty(), "errors: {:?}", r.errors);
    assert_eq!(r.send_acked, r.sent);
    assert_eq!(r.delivered, r.expected);
    assert_eq!(r.delivered_in_window_pct, 100.0);
    // Only acks that arrived while sending count towards the rate: at most the offered rate
    // (200/s), and exactly that count over the 2 s of sending.
    let while_sending = r.send_acked_while_sending.expect("a new report has it");
    assert!(
        while_sending > 0 && while_sending <= r.send_acked,
        "{while_sending} of {}",
        r.send_acked
    );
    let per_s = r.acked_per_s_while_sending.expect("a new report has it");
    assert_eq!(per_s, while_sending as f64 / 2.0);
    assert!(per_s <= 200.0, "{per_s}");
    check_percentiles(&r.e2e_ms, "e2e");
    check_percentiles(&r.send_ack_ms, "send_ack");
    for curve in [&r.e2e_curve, &r.send_ack_curve] {
        let ps: Vec<f64> = curve.iter().map(|p| p.0).collect();
        assert_eq!(ps, CURVE_PERCENTILES.to_vec());
        assert!(curve.windows(2).all(|w| w[0].1 <= w[1].1), "{curve:?}");
    }
    assert_eq!(r.e2e_curve.last().unwrap().1, r.e2e_ms.max);
    // The materializer runs scripts on the mailbox instance, the commit on the core one.
    assert!(r.evalsha_us.mailbox > 0.0, "{:?}", r.evalsha_us);
    assert!(r.redis_cpu_pct.mailbox >= 0.0 && r.redis_cpu_pct.core >= 0.0);
    assert!(r.ops_per_s.mailbox > 0.0 && r.ops_per_s.core > 0.0);
    assert!(r.mailbox_cpu_us_per_msg >= 0.0);
    let pools: Vec<(&str, usize)> = r
        .per_instance
        .iter()
        .map(|i| (i.pool.as_str(), i.index))
        .collect();
    assert_eq!(pools, [("mailbox", 0), ("core", 0)]);
}

fn assert_keys(v: &serde_json::Value, keys: &[&str]) {
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    for k in keys {
        assert!(obj.contains_key(*k), "missing {k} in {v}");
    }
}

fn assert_image_files(files: &[std::path::PathBuf], names: &[&str]) {
    let got: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(got, names);
    for f in files {
        let bytes = std::fs::read(f).unwrap();
        assert!(
            bytes.len() > 1000,
            "{} is {} bytes",
            f.display(),
            bytes.len()
        );
        match f.extension().and_then(|e| e.to_str()) {
            Some("png") => assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n"),
            Some("svg") => assert!(String::from_utf8_lossy(&bytes).contains("<svg")),
            other => panic!("unexpected file type {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_run_both_layouts() {
    let runs = load::run_load(&tiny(vec![Layout::PackedV1, Layout::PackedV2]))
        .await
        .expect("load run");
    assert_eq!(runs.len(), 2);
    check_run(&runs[0], Layout::PackedV1);
    check_run(&runs[1], Layout::PackedV2);

    let json = to_json(&runs);
    assert_keys(&json, &["runs"]);
    let arr = json["runs"].as_array().unwrap();
    assert_eq!(arr.len(), 2);
    for (run, layout) in arr.iter().zip(["packed-v1", "packed-v2"]) {
        assert_keys(
            run,
            &[
                "layout",
                "clients",
                "rate",
                "duration_s",
                "sent",
                "send_acked",
                "send_acked_while_sending",
                "acked_per_s_while_sending",
                "delivered_in_window_pct",
                "e2e_ms",
                "send_ack_ms",
                "evalsha_us",
                "redis_cpu_pct",
            ],
        );
        assert_eq!(run["layout"], layout);
        assert_eq!(run["sent"], 400);
        assert_eq!(run["delivered_in_window_pct"], 100.0);
        assert!(run.get("committed_per_s").is_none(), "renamed: {run}");
        for k in ["e2e_ms", "send_ack_ms"] {
            assert_keys(&run[k], &["p50", "p99", "p999", "max"]);
        }
        for k in ["evalsha_us", "redis_cpu_pct"] {
            assert_keys(&run[k], &["mailbox", "core"]);
        }
    }

    let table = markdown_table(&runs);
    println!("{table}");
    assert!(table.starts_with("| metric | packed-v1 | packed-v2 | Δ v2 vs v1 |"));
    for row in [
        "| evalsha (mailbox) |",
        "| mailbox Redis CPU |",
        "| end-to-end P50 |",
        "| end-to-end P99 |",
        "| SEND_ACK P99 |",
        "| delivered within window | 100% | 100% | +0.0% |",
        "| acked while sending |",
        "| mailbox CPU per message |",
        "| errors | none | none | — |",
    ] {
        assert!(table.contains(row), "no {row:?} in\n{table}");
    }
    // The JSON reads back as it was written (floats to serde_json's precision).
    let text = serde_json::to_string(&json).unwrap();
    let back = load::from_json(&text).unwrap();
    let key = |r: &RunReport| {
        (
            r.layout,
            r.sent,
            r.send_acked,
            r.send_acked_while_sending,
            r.delivered,
            r.errors.clone(),
        )
    };
    assert_eq!(
        back.iter().map(key).collect::<Vec<_>>(),
        runs.iter().map(key).collect::<Vec<_>>()
    );
    assert_eq!(markdown_table(&back), table);
    let ladder = ladder_table(&runs);
    assert_eq!(ladder.lines().count(), 4, "{ladder}");
    assert!(ladder.contains("| 1+1 | packed-v1 | 200 |"), "{ladder}");

    let dir = tempfile::tempdir().unwrap();
    let files = write_plots(dir.path(), &runs, false).unwrap();
    assert_image_files(&files, &["e2e_latency.png", "e2e_latency.svg"]);
}

#[test]
fn parses_ladder_steps() {
    assert_eq!(
        parse_steps("1+1@2000, 2+1@5k,4+4@10000.5").unwrap(),
        [
            LadderStep {
                mailbox: 1,
                core: 1,
                rate: 2000.0
            },
            LadderStep {
                mailbox: 2,
                core: 1,
                rate: 5000.0
            },
            LadderStep {
                mailbox: 4,
                core: 4,
                rate: 10000.5
            },
        ]
    );
    for bad in [
        "",
        "1+1",
        "1@100",
        "0+1@100",
        "1+0@100",
        "1+1@0",
        "1+1@-5",
        "1+1@x",
        "a+1@1",
        "1+1@100,",
        "1+1+1@100",
    ] {
        let err = parse_steps(bad).unwrap_err();
        assert_eq!(err.code(), "bad_step", "{bad:?}: {err}");
    }
}

#[tokio::test]
async fn refuses_unrunnable_options() {
    let mut o = tiny(vec![Layout::PackedV2]);
    o.fanout = 20; // ≥ clients: no 20 distinct recipients other than the sender
    assert_eq!(
        load::run_load(&o).await.unwrap_err().code(),
        "invalid_options"
    );
    let mut o = tiny(vec![Layout::PackedV2]);
    o.rate = 0.0;
    assert_eq!(
        load::run_load(&o).await.unwrap_err().code(),
        "invalid_options"
    );
    let mut o = tiny(vec![]);
    o.layouts.clear();
    assert_eq!(
        load::run_load(&o).await.unwrap_err().code(),
        "invalid_options"
    );
    let o = LoadOptions {
        target: Target::Remote {
            ws_urls: vec!["ws://127.0.0.1:1/v1/ws".into()],
            token_secret: None,
            mailbox_urls: vec![],
            core_urls: vec![],
        },
        ..tiny(vec![Layout::PackedV1, Layout::PackedV2])
    };
    assert_eq!(
        load::run_load(&o).await.unwrap_err().code(),
        "invalid_options"
    );
    assert_eq!(
        load::run_ladder(&o, &parse_steps("1+1@10").unwrap())
            .await
            .unwrap_err()
            .code(),
        "invalid_options"
    );
}

#[test]
fn defaults_are_the_adr_run() {
    let o = LoadOptions::default();
    assert_eq!((o.clients, o.rate, o.fanout), (1000, 10_000.0, 1));
    assert_eq!(o.duration, Duration::from_secs(60));
    assert_eq!(o.drain_grace, Duration::from_secs(5));
    assert_eq!(o.layouts, [Layout::PackedV2]);
    assert!(!o.progress);
    match o.target {
        Target::Local { appendfsync, .. } => assert_eq!(appendfsync, "everysec"),
        Target::Remote { .. } => panic!("default target is local"),
    }
}

/// A made-up ladder report (no Redis needed) for the plot test.
fn synthetic(layout: Layout, mailbox: usize, rate: f64, p99: f64, cpu: f64) -> RunReport {
    let curve: Vec<(f64, f64)> = CURVE_PERCENTILES
        .iter()
        .enumerate()
        .map(|(i, &p)| (p, p99 / 4.0 * (1.0 + i as f64)))
        .collect();
    RunReport {
        layout,
        target: "local".into(),
        mailbox_instances: mailbox,
        core_instances: 1,
        shards: 64,
        clients: 100,
        rate,
        duration_s: 10.0,
        fanout: 1,
        seed: 1,
        sent: (rate * 10.0) as u64,
        send_acked: (rate * 10.0) as u64,
        send_acked_while_sending: Some((rate * 9.0) as u64),
        acked_per_s_while_sending: Some(rate * 0.9),
        delivered: (rate * 10.0) as u64,
        expected: (rate * 10.0) as u64,
        delivered_in_window_pct: 100.0,
        e2e_ms: Percentiles {
            p50: p99 / 4.0,
            p99,
            p999: p99 * 2.0,
            max: p99 * 3.0,
        },
        send_ack_ms: Percentiles::default(),
        e2e_curve: curve,
        send_ack_curve: Vec::new(),
        evalsha_us: PoolPair::default(),
        redis_cpu_pct: PoolPair {
            mailbox: cpu,
            core: cpu / 2.0,
        },
        ops_per_s: PoolPair::default(),
        mailbox_cpu_us_per_msg: 0.0,
        max_send_lag_ms: 0.0,
        errors: BTreeMap::new(),
        per_instance: Vec::new(),
    }
}

#[test]
fn ladder_plots_and_table() {
    let runs = vec![
        synthetic(Layout::PackedV2, 1, 2000.0, 8.0, 30.0),
        synthetic(Layout::PackedV2, 1, 5000.0, 40.0, 80.0),
        synthetic(Layout::PackedV2, 2, 8000.0, 2500.0, 97.0),
    ];
    let table = ladder_table(&runs);
    assert!(
        table.contains("| 1+1 | 5,000 | end-to-end P99 40.0ms, 100% delivered, acked while sending 4,500/s, errors: none, mailbox CPU 80.0%, core CPU 40.0% | 2 | 1 |"),
        "{table}"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("nested/perf");
    let files = write_plots(&out, &runs, true).unwrap();
    assert_image_files(
        &files,
        &[
            "e2e_latency.png",
            "e2e_latency.svg",
            "ladder.png",
            "ladder.svg",
        ],
    );
    assert!(files.iter().all(|f| f.starts_with(&out)));
    // Nothing measured yet still draws (empty axes), rather than failing.
    let empty = dir.path().join("empty");
    assert_eq!(write_plots(&empty, &[], true).unwrap().len(), 4);
    assert!(Path::new(&empty).join("ladder.png").exists());
}

/// A remote target: a deployment started here (as `tidemark up` would), driven through its
/// URLs with bearer tokens minted from its secret (dev auth off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_target_with_tokens() {
    use tidemark_server::gateway::GatewayOptions;
    use tidemark_server::materializer::MaterializerOptions;
    use tidemark_server::run::{up, UpOptions};

    let dir = tempfile::tempdir().unwrap();
    let secret = b"load-bench-test-secret-0123456789".to_vec();
    let deployment = up(
        UpOptions {
            mailbox: 1,
            core: 1,
            shards: 4,
            layout: Layout::PackedV2,
            listen: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().join("data"),
            gateway: GatewayOptions {
                dev_auth: false,
                token_secret: Some(secret.clone()),
                ..GatewayOptions::default()
            },
            materializer: MaterializerOptions::default(),
            appendfsync: "everysec".into(),
            cluster: false,
            node: None,
        },
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .expect("local deployment");
    let opts = LoadOptions {
        clients: 5,
        rate: 50.0,
        duration: Duration::from_secs(1),
        target: Target::Remote {
            ws_urls: vec![deployment.running.ws_url()],
            token_secret: Some(secret),
            mailbox_urls: deployment.mailbox.iter().map(|p| p.url()).collect(),
            core_urls: deployment.core.iter().map(|p| p.url()).collect(),
        },
        ..tiny(vec![Layout::PackedV2])
    };
    let runs = load::run_load(&opts).await.expect("remote run");
    deployment.running.shutdown().await.unwrap();
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert_eq!((r.target.as_str(), r.shards), ("remote", 0));
    assert_eq!((r.mailbox_instances, r.core_instances), (1, 1));
    assert_eq!((r.sent, r.send_acked, r.delivered), (50, 50, 50));
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.delivered_in_window_pct, 100.0);
    assert!(r.evalsha_us.mailbox > 0.0);
}
