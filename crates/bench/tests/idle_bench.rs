//! `bench idle` against a real deployment (redis-server processes, the gateway and the
//! materializers started here, read through the gateway's `/metrics` like a remote one):
//! a few hundred clients from two loopback source addresses connect, sit idle, and every
//! field of the report is present and sane. Speed is never asserted.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use tidemark_bench::idle::{self, IdleOptions, IdleReport};
use tidemark_bench::load::Target;
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::run::{up, Up, UpOptions};
use tidemark_store::redis::watermark::Layout;
use tokio_util::sync::CancellationToken;

const CLIENTS: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_clients_from_two_source_addresses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cancel = CancellationToken::new();
    let Up {
        core,
        mailbox,
        running,
        ..
    } = up(
        UpOptions {
            mailbox: 1,
            core: 1,
            shards: 4,
            layout: Layout::PackedV2,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
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
        cancel.clone(),
    )
    .await
    .expect("up");

    let sources: Vec<IpAddr> = vec![
        Ipv4Addr::new(127, 0, 0, 2).into(),
        Ipv4Addr::new(127, 0, 0, 3).into(),
    ];
    let opts = IdleOptions {
        clients: CLIENTS,
        duration: Duration::from_secs(2),
        settle: Duration::from_millis(500),
        target: Target::Remote {
            ws_urls: vec![running.ws_url()],
            token_secret: None,
            mailbox_urls: mailbox.iter().map(|p| p.url()).collect(),
            core_urls: core.iter().map(|p| p.url()).collect(),
            metrics_urls: Vec::new(),
        },
        source_addrs: Some(sources.clone()),
        metrics_urls: Vec::new(),
        concurrency: 32,
        progress: false,
    };
    let r = idle::run_idle(&opts).await.expect("bench idle");
    running.shutdown().await.expect("shutdown");
    drop((core, mailbox));

    let password = std::fs::read_to_string(dir.path().join("data/redis.pass")).expect("password");
    check(&r, &sources, password.trim());
    // the JSON holds every field
    let json = serde_json::to_string(&r).expect("json");
    let back: IdleReport = serde_json::from_str(&json).expect("read back");
    assert_eq!(
        (back.connected, &back.source_addrs, back.redis.len()),
        (r.connected, &r.source_addrs, r.redis.len())
    );
    let v: serde_json::Value = serde_json::from_str(&json).expect("json value");
    for key in [
        "servers",
        "generator",
        "redis",
        "redis_commands_per_s",
        "redis_by_command_per_s",
        "closed",
        "duration_s",
    ] {
        assert!(v.get(key).is_some(), "{key} in {json}");
    }
    assert!(
        v["servers"][0]["rss_per_connection_bytes"].is_number(),
        "{json}"
    );
    let text = idle::render(&r);
    assert!(text.contains("300 of 300 clients connected"), "{text}");
    assert!(
        text.contains("| mailbox 0 |") && text.contains("| core 0 |"),
        "{text}"
    );
}

fn check(r: &IdleReport, sources: &[IpAddr], password: &str) {
    assert_eq!(r.target, "remote");
    assert_eq!((r.clients, r.connected), (CLIENTS, CLIENTS));
    assert!(r.connect_errors.is_empty(), "{:?}", r.connect_errors);
    // round-robin over both addresses, and the sockets really came from them
    for s in sources {
        assert_eq!(
            r.source_addrs.get(&s.to_string()),
            Some(&(CLIENTS / 2)),
            "{:?}",
            r.source_addrs
        );
    }
    assert_eq!(r.source_addrs.len(), 2, "{:?}", r.source_addrs);
    assert!(r.open_file_limit.is_some_and(|l| l as usize > CLIENTS));
    assert!(
        r.duration_s >= 1.9,
        "the window lasts its duration: {}",
        r.duration_s
    );
    assert!(r.connect_s > 0.0);
    // idle clients receive nothing and nobody leaves
    assert!(r.closed.is_empty(), "{:?}", r.closed);
    assert_eq!(r.frames_while_idle, 0);
    assert_eq!(r.open_at_end, CLIENTS);

    assert_eq!(r.servers.len(), 1);
    let s = &r.servers[0];
    assert!(s.source.ends_with("/metrics"), "{}", s.source);
    assert!(s.missing.is_empty(), "{:?}", s.missing);
    assert_eq!(
        s.connected_clients,
        Some(CLIENTS as f64),
        "the server's own count"
    );
    let cpu = s.cpu_pct.expect("server CPU");
    assert!(cpu >= 0.0 && cpu.is_finite(), "{cpu}");
    let (before, connected, end) = (
        s.rss_before_bytes.expect("RSS before"),
        s.rss_connected_bytes.expect("RSS connected"),
        s.rss_bytes.expect("RSS at end"),
    );
    assert!(
        before > 1 << 20 && connected > 1 << 20 && end > 1 << 20,
        "{s:?}"
    );
    let per = s.rss_per_connection_bytes.expect("per connection");
    assert_eq!(per, (end as f64 - before as f64) / CLIENTS as f64);
    assert!(r.generator.rss_bytes.is_some_and(|b| b > 0));
    assert!(r.generator.cpu_pct.is_some());

    // both instances, each with its INFO deltas; the window's closing INFO is counted
    let pools: Vec<(&str, usize)> = r.redis.iter().map(|i| (i.pool.as_str(), i.index)).collect();
    assert_eq!(pools, [("mailbox", 0), ("core", 0)]);
    let mut sum = 0.0;
    for i in &r.redis {
        assert!(
            !password.is_empty() && !i.url.contains(password),
            "redacted: {}",
            i.url
        );
        assert!(i.commands_per_s > 0.0 && i.cpu_pct >= 0.0, "{i:?}");
        assert!(i.by_command_per_s.contains_key("info"), "{i:?}");
        assert!(i.by_command_per_s.values().all(|&v| v > 0.0), "{i:?}");
        sum += i.commands_per_s;
    }
    assert!((r.redis_commands_per_s - sum).abs() < 1e-6);
    let info: f64 = r.redis.iter().map(|i| i.by_command_per_s["info"]).sum();
    assert_eq!(r.redis_by_command_per_s["info"], info);
}
