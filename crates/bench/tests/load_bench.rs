//! The load generator against real local deployments (redis-server processes, the gateway and
//! the materializers in this process), with tiny sizes: the reports are well-formed, every
//! message is sent and delivered, the JSON has its shape, the tables and the plots come out.
//! Speed is never asserted.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use tidemark_bench::load::{
    self, ladder_table, markdown_table, parse_steps, to_json, LadderStep, LoadOptions, Percentiles,
    PoolPair, ReadPolicy, RunReport, Target, CURVE_PERCENTILES,
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
        read_policy: ReadPolicy::default(),
        commit_linger: None,
        ack_interval: None,
        read_linger: None,
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
    // The timeline: one entry per second of sending, 200 messages intended in each, every
    // one delivered; each second's figures are within the run's.
    let counts: Vec<u64> = r.e2e_timeline.iter().map(|s| s.delivered).collect();
    assert_eq!(counts, [200, 200], "{:?}", r.e2e_timeline);
    for s in &r.e2e_timeline {
        assert!(s.p50 > 0.0 && s.p50 <= s.p99 && s.p99 <= s.max, "{s:?}");
        // two significant digits: a second's maximum may round up by 1 %
        assert!(s.max <= r.e2e_ms.max * 1.01 + 0.01, "{s:?} {:?}", r.e2e_ms);
    }
    check_percentiles(&r.e2e_ms, "e2e");
    check_percentiles(&r.send_ack_ms, "send_ack");
    for curve in [&r.e2e_curve, &r.send_ack_curve] {
        let ps: Vec<f64> = curve.iter().map(|p| p.0).collect();
        assert_eq!(ps, CURVE_PERCENTILES.to_vec());
        assert!(curve.windows(2).all(|w| w[0].1 <= w[1].1), "{curve:?}");
    }
    assert_eq!(r.e2e_curve.last().unwrap().1, r.e2e_ms.max);
    // The materializer runs scripts on the mailbox instance, the commit on the core one.
    assert!(r.evalsha_us.mailbox.unwrap() > 0.0, "{:?}", r.evalsha_us);
    assert!(r.redis_cpu_pct.mailbox.unwrap() >= 0.0 && r.redis_cpu_pct.core.unwrap() >= 0.0);
    assert!(r.ops_per_s.mailbox.unwrap() > 0.0 && r.ops_per_s.core.unwrap() > 0.0);
    assert!(r.mailbox_cpu_us_per_msg.unwrap() >= 0.0);
    let pools: Vec<(&str, usize)> = r
        .per_instance
        .iter()
        .map(|i| (i.pool.as_str(), i.index))
        .collect();
    assert_eq!(pools, [("mailbox", 0), ("core", 0)]);
    assert!(r.unread.is_empty(), "{:?}", r.unread);
    for i in &r.per_instance {
        assert!(i.cpu_us_per_msg.unwrap() > 0.0, "{i:?}");
        assert!(
            i.commands.as_ref().unwrap().contains_key("evalsha"),
            "{i:?}"
        );
    }
    // Every command of each pool, per message sent: both pools run scripts.
    for pool in ["mailbox", "core"] {
        let cmds = r.redis_commands[pool].as_ref().expect("read");
        let evalsha = cmds["evalsha"];
        assert!(
            evalsha.per_msg > 0.0 && evalsha.us_per_call > 0.0,
            "{pool}: {cmds:?}"
        );
        assert_eq!(evalsha.per_msg, evalsha.calls as f64 / r.sent as f64);
    }
    // The deployment runs in this process: one figure for the generator and the server.
    let names: Vec<&str> = r.processes.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["generator + server (one process)"]);
    let p = &r.processes[0];
    assert_eq!(
        (p.role.as_str(), p.source.as_str()),
        ("generator+server", "/proc/self")
    );
    assert!(p.cpu_s.unwrap() > 0.0 && p.cpu_pct.unwrap() > 0.0, "{p:?}");
    assert_eq!(
        p.cpu_us_per_msg,
        Some(p.cpu_s.unwrap() * 1e6 / r.sent as f64)
    );
    assert!(p.rss_bytes.unwrap() > 1 << 20, "{p:?}");
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
        "| generator + server (one process) CPU per message |",
        "| generator + server (one process) RSS at end |",
        "| errors | none | none | — |",
    ] {
        assert!(table.contains(row), "no {row:?} in\n{table}");
    }
    assert!(table.ends_with("| errors | none | none | — |\n"), "{table}");
    let cpu = load::cpu_table(&runs);
    println!("{cpu}");
    assert!(
        cpu.starts_with("| per message sent | packed-v1 | packed-v2 |"),
        "{cpu}"
    );
    for row in [
        "| generator + server (one process): CPU |",
        "| mailbox Redis 0: CPU |",
        "| core Redis 0: CPU |",
        "| mailbox `evalsha` calls × µs |",
        "| core `evalsha` calls × µs |",
    ] {
        assert!(cpu.contains(row), "no {row:?} in\n{cpu}");
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
    assert_eq!(load::cpu_table(&back), cpu);
    let ladder = ladder_table(&runs);
    assert_eq!(ladder.lines().count(), 4, "{ladder}");
    assert!(ladder.contains("| 1+1 | packed-v1 | 200 |"), "{ladder}");

    let dir = tempfile::tempdir().unwrap();
    let files = write_plots(dir.path(), &runs, false).unwrap();
    assert_image_files(
        &files,
        &[
            "e2e_latency.png",
            "e2e_latency.svg",
            "e2e_timeline.png",
            "e2e_timeline.svg",
        ],
    );
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
            metrics_urls: vec![],
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
        e2e_timeline: Vec::new(),
        evalsha_us: PoolPair::default(),
        redis_cpu_pct: PoolPair {
            mailbox: Some(cpu),
            core: Some(cpu / 2.0),
        },
        ops_per_s: PoolPair::default(),
        mailbox_cpu_us_per_msg: Some(0.0),
        max_send_lag_ms: 0.0,
        errors: BTreeMap::new(),
        per_instance: Vec::new(),
        processes: Vec::new(),
        redis_commands: BTreeMap::new(),
        unread: Vec::new(),
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
            upgrade: false,
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
            metrics_urls: vec![],
        },
        ..tiny(vec![Layout::PackedV2])
    };
    let ws_url = deployment.running.ws_url();
    let runs = load::run_load(&opts).await.expect("remote run");
    deployment.running.shutdown().await.unwrap();
    assert_eq!(runs.len(), 1);
    let r = &runs[0];
    assert_eq!((r.target.as_str(), r.shards), ("remote", 0));
    assert_eq!((r.mailbox_instances, r.core_instances), (1, 1));
    assert_eq!((r.sent, r.send_acked, r.delivered), (50, 50, 50));
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.delivered_in_window_pct, 100.0);
    assert!(r.evalsha_us.mailbox.unwrap() > 0.0);
    // The generator (this process) and the gateway, read from its /metrics (the client
    // listener serves it: no admin listener).
    assert!(r.unread.is_empty(), "{:?}", r.unread);
    let names: Vec<&str> = r.processes.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["generator", "server"]);
    let server = &r.processes[1];
    assert_eq!(server.source, load::metrics_url_of(&ws_url));
    assert!(server.cpu_s.unwrap() > 0.0, "{server:?}");
    assert!(server.rss_bytes.unwrap() > 1 << 20, "{server:?}");
    let table = markdown_table(&runs);
    for row in [
        "| generator CPU per message |",
        "| server CPU per message |",
        "| server RSS at end |",
    ] {
        assert!(table.contains(row), "no {row:?} in\n{table}");
    }
    assert!(!table.contains("| generator RSS at end |"), "{table}");
}

/// One reading that cannot be made never loses a run: a Redis instance that stops answering
/// (SIGSTOP) and one that dies (SIGKILL) while the run goes on, and a gateway `/metrics` URL
/// where nothing listens, leave exactly the figures that need them missing (`None`, `—`),
/// each listed in `unread`; everything else is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_instance_leaves_its_figures_missing() {
    use tidemark_redis_proc::RedisProcess;
    use tidemark_server::gateway::GatewayOptions;
    use tidemark_server::materializer::MaterializerOptions;
    use tidemark_server::run::{up, UpOptions};

    let dir = tempfile::tempdir().unwrap();
    let deployment = up(
        UpOptions {
            mailbox: 1,
            core: 1,
            shards: 4,
            layout: Layout::PackedV2,
            listen: "127.0.0.1:0".parse().unwrap(),
            data_dir: dir.path().join("data"),
            gateway: GatewayOptions {
                dev_auth: true,
                ..GatewayOptions::default()
            },
            materializer: MaterializerOptions::default(),
            appendfsync: "everysec".into(),
            cluster: false,
            node: None,
            upgrade: false,
        },
        tokio_util::sync::CancellationToken::new(),
    )
    .await
    .expect("local deployment");
    // Two more instances, only watched: one will be stopped, one killed.
    let stalled = RedisProcess::start().unwrap();
    let mut dead = RedisProcess::start().unwrap();
    let stalled_pid = stalled.pid().unwrap() as libc::pid_t;
    let mut core_urls: Vec<String> = deployment.core.iter().map(|p| p.url()).collect();
    core_urls.extend([stalled.url(), dead.url()]);
    let opts = LoadOptions {
        clients: 5,
        rate: 50.0,
        duration: Duration::from_secs(3),
        target: Target::Remote {
            ws_urls: vec![deployment.running.ws_url()],
            token_secret: None,
            mailbox_urls: deployment.mailbox.iter().map(|p| p.url()).collect(),
            core_urls,
            metrics_urls: vec!["http://127.0.0.1:1/metrics".into()],
        },
        read_policy: ReadPolicy {
            tries: 3,
            timeout: Duration::from_millis(300),
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(100),
        },
        ..tiny(vec![Layout::PackedV2])
    };
    // After sample A (taken right after 5 clients connect), well before B (after 3 s).
    let faults = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        // SAFETY: a signal to a child process this test owns.
        assert_eq!(unsafe { libc::kill(stalled_pid, libc::SIGSTOP) }, 0);
        dead.kill();
    });
    let result = load::run_load(&opts).await;
    faults.join().unwrap();
    // SAFETY: as above; the process is then killed on drop.
    unsafe { libc::kill(stalled_pid, libc::SIGCONT) };
    drop(stalled);
    deployment.running.shutdown().await.unwrap();

    let runs = result.expect("a run with unreadable figures still reports");
    let r = &runs[0];
    assert_eq!((r.sent, r.send_acked, r.delivered), (150, 150, 150));
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // The deployment's own instances were read at A, B and C.
    let inst = |pool: &str, index: usize| {
        r.per_instance
            .iter()
            .find(|i| i.pool == pool && i.index == index)
            .unwrap()
    };
    for (pool, index) in [("mailbox", 0), ("core", 0)] {
        let i = inst(pool, index);
        assert!(
            i.cpu_pct.is_some() && i.cpu_s.is_some() && i.commands.is_some(),
            "{i:?}"
        );
    }
    // The stopped and the dead one: nothing that needs B or C.
    for index in [1, 2] {
        let i = inst("core", index);
        assert_eq!(
            (
                i.evalsha_calls,
                i.evalsha_us,
                i.cpu_pct,
                i.ops_per_s,
                i.cpu_s,
                i.cpu_us_per_msg
            ),
            (None, None, None, None, None, None),
            "{i:?}"
        );
        assert!(i.commands.is_none(), "{i:?}");
        for at in ["B (end of sending)", "C (end of window)"] {
            let want = format!("core {index}: redis ");
            assert!(
                r.unread
                    .iter()
                    .any(|u| u.starts_with(&want) && u.ends_with(at)),
                "{want}… at {at} in {:#?}",
                r.unread
            );
        }
    }
    // A pool figure needs every instance of the pool; the mailbox pool is whole.
    assert_eq!(
        (r.evalsha_us.core, r.redis_cpu_pct.core, r.ops_per_s.core),
        (None, None, None)
    );
    assert_eq!(r.redis_commands["core"], None);
    assert!(r.evalsha_us.mailbox.is_some() && r.redis_cpu_pct.mailbox.is_some());
    assert!(r.redis_commands["mailbox"].is_some());
    // The gateway's /metrics could not be read at all; the generator's own figures are there.
    let server = r.processes.iter().find(|p| p.name == "server").unwrap();
    assert_eq!((server.cpu_s, server.rss_bytes), (None, None), "{server:?}");
    assert_eq!(
        r.unread
            .iter()
            .filter(|u| u.starts_with("server http://127.0.0.1:1/metrics: "))
            .count(),
        3,
        "{:#?}",
        r.unread
    );
    let generator = r.processes.iter().find(|p| p.name == "generator").unwrap();
    assert!(generator.cpu_s.is_some(), "{generator:?}");

    // Missing is `null` in the JSON and `—` in the tables, and reads back as missing.
    let json = to_json(&runs);
    assert!(json["runs"][0]["evalsha_us"]["core"].is_null(), "{json}");
    assert!(
        json["runs"][0]["per_instance"][2]["cpu_pct"].is_null(),
        "{json}"
    );
    let back = load::from_json(&serde_json::to_string(&json).unwrap()).unwrap();
    assert_eq!(back[0].redis_cpu_pct.core, None);
    let table = markdown_table(&runs);
    for row in [
        "| core Redis CPU | — |",
        "| evalsha (core) | — |",
        "| server CPU per message | — |",
        "| server RSS at end | — |",
    ] {
        assert!(table.contains(row), "no {row:?} in\n{table}");
    }
    let cpu = load::cpu_table(&runs);
    assert!(cpu.contains("| core Redis 1: CPU | — |"), "{cpu}");
    assert!(cpu.contains("| core Redis commands | — |"), "{cpu}");
    let text = load::render(&runs, false, None, None).unwrap();
    assert!(
        text.contains("not read (its figures are —): core 1: redis "),
        "{text}"
    );
}
