//! Topologies through the real binary (issue 11, item 8): two core and two mailbox
//! redis-servers with explicit shard tables in a `--config` file (not the default ranges);
//! every message is delivered end to end and every key lands on the instance its table names,
//! never on the other. Then `--own-shards`: two processes split the shards, neither fences the
//! other, each materialises only its own (with one stopped, its shards wait and the other's
//! keep flowing) and each reports only its own.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::route;
use tidemark_client::{Auth, Client, Event};
use tidemark_redis_proc::RedisProcess;
use tidemark_store::keys;

const SHARDS: u32 = 8;
/// Shard → core instance. The default ranges would be [0, 0, 0, 0, 1, 1, 1, 1].
const CORE_OF: [usize; 8] = [1, 0, 0, 1, 1, 0, 1, 0];
/// Shard → mailbox instance.
const MAILBOX_OF: [usize; 8] = [1, 1, 0, 0, 0, 1, 1, 0];

/// One user per shard: `users[s]` is in shard `s`.
fn users() -> Vec<String> {
    let mut by_shard: BTreeMap<u32, String> = BTreeMap::new();
    for i in 0.. {
        let u = format!("topo-{i}");
        by_shard.entry(route(&u, SHARDS).shard).or_insert(u);
        if by_shard.len() == SHARDS as usize {
            break;
        }
    }
    by_shard.into_values().collect()
}

async fn conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn exists(url: &str, key: &str) -> bool {
    let mut c = conn(url).await;
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(&mut c)
        .await
        .unwrap()
        == 1
}

async fn connect(port: u16, user: &str) -> Client {
    Client::connect_with_timeout(
        &format!("ws://127.0.0.1:{port}/v1/ws"),
        &Auth::DevUser(user.into()),
        Duration::from_secs(5),
    )
    .await
    .unwrap()
}

/// The bodies `c` receives within `wait` (stops early once `n` arrived).
async fn receive(c: &mut Client, n: usize, wait: Duration) -> Vec<String> {
    let mut got = Vec::new();
    let until = tokio::time::Instant::now() + wait;
    while got.len() < n {
        match tokio::time::timeout_at(until, c.next_event()).await {
            Ok(Some(Event::Deliver(e))) => got.push(e.body),
            Ok(Some(Event::Closed) | None) => panic!("connection closed"),
            Ok(Some(_)) => {}
            Err(_) => break,
        }
    }
    got
}

/// Whether a delivery with `body` reaches `c` within `wait` (other deliveries, e.g. entries
/// delivered again after a reconnect, are skipped).
async fn delivered(c: &mut Client, body: &str, wait: Duration) -> bool {
    let until = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(until, c.next_event()).await {
            Ok(Some(Event::Deliver(e))) if e.body == body => return true,
            Ok(Some(Event::Closed) | None) => panic!("connection closed"),
            Ok(Some(_)) => {}
            Err(_) => return false,
        }
    }
}

async fn epochs(mailboxes: &[String]) -> Vec<u64> {
    let mut out = Vec::new();
    for s in 0..SHARDS {
        let mailbox = &mailboxes[MAILBOX_OF[s as usize]];
        out.push(support::watermark(mailbox, s).await.epoch);
    }
    out
}

fn serve(config: &std::path::Path, port: u16, own: Option<&str>) -> std::process::Child {
    let mut args: Vec<String> = [
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--dev-auth",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Some(own) = own {
        args.extend(["--own-shards".to_string(), own.to_string()]);
    }
    support::spawn_quiet(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_tables_and_split_owners_over_two_cores_and_two_mailboxes() {
    let core = [
        RedisProcess::start().unwrap(),
        RedisProcess::start().unwrap(),
    ];
    let mb = [
        RedisProcess::start().unwrap(),
        RedisProcess::start().unwrap(),
    ];
    let cores: Vec<String> = core.iter().map(|r| r.url()).collect();
    let mailboxes: Vec<String> = mb.iter().map(|r| r.url()).collect();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("deploy.toml");
    let list = |v: &[String]| {
        v.iter()
            .map(|u| format!("{u:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    std::fs::write(
        &config,
        format!(
            "shards = {SHARDS}\nlayout = \"packed-v2\"\ncore = [{}]\nmailbox = [{}]\n\
             core_of_shard = {CORE_OF:?}\nmailbox_of_shard = {MAILBOX_OF:?}\n",
            list(&cores),
            list(&mailboxes)
        ),
    )
    .unwrap();
    let users = users();

    // ---- one process owning every shard -------------------------------------------------
    let port = tidemark_redis_proc::free_port().unwrap();
    let mut one = serve(&config, port, None);
    support::wait_healthy(port).await;
    let mut rx = Vec::new();
    for u in &users {
        rx.push(connect(port, u).await);
    }
    let alice = connect(port, "alice").await;
    let all = alice
        .send_and_wait("to-all", &users, "everyone", Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(all.len(), SHARDS as usize, "one offset per shard: {all:?}");
    for (s, u) in users.iter().enumerate() {
        alice
            .send_and_wait(
                &format!("to-{s}"),
                std::slice::from_ref(u),
                u,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
    }
    for (s, u) in users.iter().enumerate() {
        let got = receive(&mut rx[s], 2, Duration::from_secs(10)).await;
        assert_eq!(got, ["everyone", u.as_str()], "shard {s}: {u}");
    }
    // every key of shard s on the instances its tables name, none on the others
    for (s, u) in users.iter().enumerate() {
        let (c, m) = (CORE_OF[s], MAILBOX_OF[s]);
        let sh = s as u32;
        assert!(exists(&cores[c], &keys::head(sh)).await, "head:{{{s}}}");
        assert!(
            !exists(&cores[1 - c], &keys::head(sh)).await,
            "head:{{{s}}}"
        );
        for k in [keys::wm(sh), keys::mailbox(sh, u)] {
            assert!(exists(&mailboxes[m], &k).await, "{k} on mailbox {m}");
            assert!(
                !exists(&mailboxes[1 - m], &k).await,
                "{k} not on mailbox {}",
                1 - m
            );
        }
    }
    drop(rx);
    drop(alice);
    let _ = one.kill();
    let _ = one.wait();

    // ---- two processes, each owning half of the shards ----------------------------------
    let before = epochs(&mailboxes).await;
    let (pa, pb) = (
        tidemark_redis_proc::free_port().unwrap(),
        tidemark_redis_proc::free_port().unwrap(),
    );
    let mut a = serve(&config, pa, Some("0,2,4,6"));
    support::wait_healthy(pa).await;
    let mut b = serve(&config, pb, Some("1,3,5,7"));
    support::wait_healthy(pb).await;
    let after = epochs(&mailboxes).await;
    let raised: Vec<u64> = after.iter().zip(&before).map(|(x, y)| x - y).collect();
    assert_eq!(raised, vec![1; SHARDS as usize], "each shard claimed once");
    // sent through A, received through B: every shard is materialised by its owner
    let mut rx = Vec::new();
    for u in &users {
        rx.push(connect(pb, u).await);
    }
    let alice = connect(pa, "alice").await;
    alice
        .send_and_wait("split-1", &users, "split", Duration::from_secs(5))
        .await
        .unwrap();
    for (s, c) in rx.iter_mut().enumerate() {
        assert!(
            delivered(c, "split", Duration::from_secs(10)).await,
            "shard {s}"
        );
    }
    // neither fenced the other, and each reports only the shards it owns
    for (port, mine, theirs) in [(pa, 0, 1), (pb, 1, 0)] {
        assert_eq!(support::http_get(port, "/healthz"), (200, "ok".to_string()));
        let (_, metrics) = support::http_get(port, "/metrics");
        for s in (0..SHARDS).filter(|s| s % 2 == mine) {
            let line = format!("tidemark_shard_running{{shard=\"{s}\"}} 1");
            assert!(metrics.contains(&line), "port {port}: {line}\n{metrics}");
        }
        for s in (0..SHARDS).filter(|s| s % 2 == theirs) {
            let label = format!("tidemark_shard_running{{shard=\"{s}\"}}");
            assert!(!metrics.contains(&label), "port {port} reports {label}");
        }
    }
    // A stops: its shards wait (nobody else owns them), B's keep flowing, B stays healthy
    let _ = a.kill();
    let _ = a.wait();
    alice.close().await;
    let alice = connect(pb, "alice").await;
    alice
        .send_and_wait("split-2", &users, "while A is down", Duration::from_secs(5))
        .await
        .unwrap();
    let down = "while A is down";
    for (s, c) in rx.iter_mut().enumerate().filter(|(s, _)| s % 2 == 1) {
        assert!(
            delivered(c, down, Duration::from_secs(10)).await,
            "shard {s} (B's)"
        );
    }
    for (s, c) in rx.iter_mut().enumerate().filter(|(s, _)| s % 2 == 0) {
        let got = delivered(c, down, Duration::from_millis(300)).await;
        assert!(!got, "shard {s} (A's) materialised without A");
    }
    assert_eq!(support::http_get(pb, "/healthz").0, 200);
    // A comes back and delivers what waited
    let mut a = serve(&config, pa, Some("0,2,4,6"));
    support::wait_healthy(pa).await;
    for (s, c) in rx.iter_mut().enumerate().filter(|(s, _)| s % 2 == 0) {
        let got = delivered(c, down, Duration::from_secs(10)).await;
        assert!(got, "shard {s} (A's, after its restart)");
    }
    let _ = a.kill();
    let _ = a.wait();
    let _ = b.kill();
    let _ = b.wait();
}
