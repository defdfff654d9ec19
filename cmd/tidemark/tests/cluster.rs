//! Tidemark on a real Redis Cluster (issue 14, ADR-0032): 3 primaries + 3 replicas started by
//! `tidemark_redis_proc::RedisCluster` (the code `tidemark up --cluster` uses), both pools on
//! the same cluster, the real `tidemark serve` binary.
//!
//! 1. `cluster_end_to_end`: sends over HTTP and WebSocket, live delivery through sharded wake
//!    hints, a resend deduplicated, a many-recipient message, acks, `tidemark status`.
//! 2. `resharding_under_load`: slots of live shards moved (`MIGRATE`, `ASK`, `TRYAGAIN`) and
//!    a `redis-cli --cluster reshard` while messages flow.
//! 3. `primary_loss_under_load`: kill -9 of primaries under traffic (each holds core and
//!    mailbox keys of its shards), the failover, the old primary back as a replica.
//!
//! Each: every acknowledged message is in every recipient's mailbox exactly once, in log order.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::nodes::{assert_delivered, Acked};
use support::{http_get, http_post, spawn_killed_with_us, wait_healthy};
use tidemark_redis_proc::{ClusterOptions, RedisCluster};
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{ShardMap, Topology};

const SHARDS: u32 = 16;
const USERS: usize = 16;

/// A 3+3 cluster with a password and a 1 s node timeout; `None` (with a notice) when
/// redis-server or redis-cli is missing.
fn cluster() -> Option<RedisCluster> {
    if !tidemark_redis_proc::redis_server_available() || !tidemark_redis_proc::redis_cli_available()
    {
        eprintln!("SKIPPED: redis-server/redis-cli not installed (scripts/install-redis.sh)");
        return None;
    }
    Some(
        RedisCluster::start(ClusterOptions {
            requirepass: Some("cluster-test-pw".into()),
            node_timeout_ms: 1000,
            ..ClusterOptions::default()
        })
        .expect("start a 3+3 Redis Cluster"),
    )
}

fn seeds(c: &RedisCluster) -> String {
    c.seeds().join(",")
}

fn map(c: &RedisCluster) -> ShardMap {
    let mut t = Topology::new(SHARDS, Layout::PackedV2, vec![], vec![]);
    t.core_cluster = Some(c.seeds());
    t.mailbox_cluster = Some(c.seeds());
    t.validate().unwrap()
}

/// `tidemark serve` on both pools of cluster `c` (leases, TTL 1 s), healthy.
async fn serve(c: &RedisCluster, port: u16, id: &str) -> Child {
    let s = seeds(c);
    serve_with(&["--core-cluster", &s, "--mailbox-cluster", &s], port, id).await
}

/// `tidemark serve` with the pools given by `pools`, healthy.
async fn serve_with(pools: &[&str], port: u16, id: &str) -> Child {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.arg("serve").args(pools);
    cmd.args([
        "--shards",
        &SHARDS.to_string(),
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--dev-auth",
        "--lease-ttl",
        "1s",
        "--node-id",
        id,
    ])
    .env("RUST_LOG", "warn")
    .stdout(std::process::Stdio::null())
    // its warnings, which `assert_delivered` shows when it fails (a flake in CI is then
    // explained by its own output)
    .stderr(support::nodes::node_log(port));
    // debugging aid: CLUSTER_LOG_DIR=/some/dir keeps the node's whole log
    if let Ok(dir) = std::env::var("CLUSTER_LOG_DIR") {
        let f = std::fs::File::create(format!("{dir}/{id}-{port}.log")).unwrap();
        cmd.env("RUST_LOG", "info").stderr(f);
    }
    let child = spawn_killed_with_us(&mut cmd);
    wait_healthy(port).await;
    child
}

/// Sends over HTTP until `stop`; a message that is not acknowledged (a failover in progress,
/// a commit not yet on its replica) is resent with the same id until it is.
fn sender(
    tag: usize,
    port: u16,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
    refused: Arc<Mutex<BTreeMap<String, u64>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut i = 0usize;
        while !stop.load(Ordering::SeqCst) {
            let to: Vec<String> = (0..1 + i % 3)
                .map(|k| format!("u{}", (i * 7 + k * 5) % USERS))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let body =
                serde_json::json!({"id": format!("m{tag}-{i}"), "to": to, "body": format!("b{i}")});
            let sender = format!("s{}", i % 4);
            let started = Instant::now();
            loop {
                let (status, resp) = http_post(
                    port,
                    &format!("/v1/messages?user={sender}"),
                    &body.to_string(),
                );
                if status == 200 {
                    let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
                    let offsets = v["offsets"]
                        .as_object()
                        .unwrap()
                        .iter()
                        .map(|(s, o)| (s.parse().unwrap(), o.as_u64().unwrap()))
                        .collect();
                    acked.lock().unwrap().push(Acked { to, offsets });
                    break;
                }
                let code = serde_json::from_str::<serde_json::Value>(&resp)
                    .ok()
                    .and_then(|v| v["error"]["code"].as_str().map(str::to_string))
                    .unwrap_or_else(|| status.to_string());
                *refused.lock().unwrap().entry(code).or_default() += 1;
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "message m{i} not acknowledged in 60 s: {status} {resp}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            i += 1;
            std::thread::sleep(Duration::from_millis(4));
        }
    })
}

/// Traffic running against one gateway.
struct Traffic {
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
    refused: Arc<Mutex<BTreeMap<String, u64>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(port: u16, senders: usize) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(Mutex::new(BTreeMap::new()));
        let threads = (0..senders)
            .map(|tag| sender(tag, port, stop.clone(), acked.clone(), refused.clone()))
            .collect();
        Traffic {
            stop,
            acked,
            refused,
            threads,
        }
    }

    fn count(&self) -> usize {
        self.acked.lock().unwrap().len()
    }

    /// Waits until `n` more messages are acknowledged (traffic keeps flowing).
    async fn more(&self, n: usize, what: &str) {
        let want = self.count() + n;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.count() < want {
            assert!(Instant::now() < deadline, "{what}: traffic stalled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stop(self) -> (Vec<Acked>, BTreeMap<String, u64>) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            t.join().expect("sender thread");
        }
        let acked = std::mem::take(&mut *self.acked.lock().unwrap());
        let refused = self.refused.lock().unwrap().clone();
        (acked, refused)
    }
}

/// The cluster node that serves shard `s`'s keys now.
fn primary_of_shard(c: &RedisCluster, s: u32) -> usize {
    let slot = tidemark_redis_proc::key_slot(format!("wm:{{{s}}}").as_bytes());
    c.primary_of_slot(slot).expect("slot served")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_end_to_end() {
    let Some(c) = cluster() else { return };
    let port = support::free_port();
    let _node = serve(&c, port, "c1").await;
    let map = map(&c);

    // a live client (WebSocket, through `tidemark tail`): delivery is woken by SPUBLISH hints
    let url = format!("ws://127.0.0.1:{port}/v1/ws");
    let mut tail = std::process::Command::new(env!("CARGO_BIN_EXE_tidemark"));
    tail.args(["tail", "--url", &url, "--dev-user", "bob"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut tail = spawn_killed_with_us(&mut tail);
    let lines = support::stdout_lines(&mut tail);
    // a first message: once bob has it, his connection is up and waits for hints
    let out = support::tidemark(&[
        "send",
        "--url",
        &url,
        "--dev-user",
        "alice",
        "--to",
        "bob",
        "--id",
        "e2e-0",
        "warm-up",
    ]);
    assert!(out.status.success(), "{out:?}");
    let first = lines
        .recv_timeout(Duration::from_secs(20))
        .expect("bob's first delivery");
    assert!(first.contains("alice: warm-up"), "{first}");

    let t0 = Instant::now();
    let out = support::tidemark(&[
        "send",
        "--url",
        &url,
        "--dev-user",
        "alice",
        "--to",
        "bob,carol",
        "--id",
        "e2e-1",
        "hello cluster",
    ]);
    assert!(out.status.success(), "{out:?}");
    let line = lines
        .recv_timeout(Duration::from_secs(20))
        .expect("bob's delivery");
    println!(
        "cluster: live delivery through sharded hints in {:?}",
        t0.elapsed()
    );
    assert!(
        line.contains("alice: hello cluster"),
        "unexpected delivery line {line:?}"
    );

    // the same id again: deduplicated, same offsets
    let body = serde_json::json!({"id": "e2e-1", "to": ["bob", "carol"], "body": "hello cluster"});
    let (s1, r1) = http_post(port, "/v1/messages?user=alice", &body.to_string());
    assert_eq!(s1, 200, "{r1}");
    let first_offsets = serde_json::from_str::<serde_json::Value>(&r1).unwrap()["offsets"].clone();
    let (s2, r2) = http_post(port, "/v1/messages?user=alice", &body.to_string());
    assert_eq!(s2, 200, "{r2}");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&r2).unwrap()["offsets"],
        first_offsets
    );
    assert!(
        lines.recv_timeout(Duration::from_secs(2)).is_err(),
        "a resend must not be delivered again"
    );

    // many recipients in one message (several shards, several lanes of each)
    let many: Vec<String> = (0..60).map(|i| format!("r{i}")).collect();
    let body = serde_json::json!({"id": "e2e-many", "to": many, "body": "to many"});
    let (s, r) = http_post(port, "/v1/messages?user=alice", &body.to_string());
    assert_eq!(s, 200, "{r}");
    let v: serde_json::Value = serde_json::from_str(&r).unwrap();
    let offsets: BTreeMap<u32, u64> = v["offsets"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(s, o)| (s.parse().unwrap(), o.as_u64().unwrap()))
        .collect();
    let acked = vec![Acked {
        to: many.clone(),
        offsets,
    }];
    let entries = assert_delivered(&map, port, &acked).await;
    assert_eq!(entries, 60);

    // ack: bob's mailbox is trimmed up to the seq acked
    let bob_seq = first_offsets[map.route("bob").shard.to_string()]
        .as_u64()
        .unwrap();
    let (s, r) = http_post(
        port,
        "/v1/mailbox/ack?user=bob",
        &serde_json::json!({"seq": bob_seq}).to_string(),
    );
    assert!(s == 200 || s == 204, "{s} {r}");
    let (_, page) = http_get(port, "/v1/mailbox?user=bob&after=0&limit=10");
    let page: serde_json::Value = serde_json::from_str(&page).unwrap();
    assert!(
        page["entries"].as_array().unwrap().is_empty(),
        "acked entries are gone: {page}"
    );

    // status over the cluster: one node, every shard owned, W at the head
    let out = support::tidemark(&[
        "status",
        "--core-cluster",
        &seeds(&c),
        "--mailbox-cluster",
        &seeds(&c),
        "--shards",
        &SHARDS.to_string(),
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["nodes"].as_array().unwrap().len(), 1, "{st}");
    let shards = st["shards"].as_array().unwrap();
    assert_eq!(shards.len(), SHARDS as usize);
    for sh in shards {
        assert_eq!(sh["owner"], "c1", "{sh}");
    }
    // the same reading through the gateway (the /ops view's endpoint, dev auth: open)
    let (status, body) = http_get(port, "/v1/admin/status");
    assert_eq!(status, 200, "{body}");
    let admin: serde_json::Value = serde_json::from_str(&body).unwrap();
    let admin_shards = admin["shards"].as_array().unwrap();
    assert_eq!(admin_shards.len(), SHARDS as usize, "{admin}");
    for (sh, a) in shards.iter().zip(admin_shards) {
        assert_eq!(
            (&a["shard"], &a["owner"]),
            (&sh["shard"], &sh["owner"]),
            "{a}"
        );
        assert_eq!(a["lanes"].as_array().unwrap().len(), 64, "{a}");
        assert!(a["head"].as_u64() >= sh["head"].as_u64(), "{a} {sh}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_under_load() {
    let Some(c) = cluster() else { return };
    let port = support::free_port();
    let _node = serve(&c, port, "r1").await;
    let map = map(&c);
    let traffic = Traffic::start(port, 2);
    traffic.more(100, "before resharding").await;

    // move the slot of four shards, one by one, to the next primary (keys migrate under
    // traffic: ASK and TRYAGAIN for the scripts meanwhile)
    let t0 = Instant::now();
    let mut moved_keys = 0;
    for s in [0u32, 5, 10, 15] {
        let from = primary_of_shard(&c, s);
        let prims = c.primaries();
        let to = prims[(prims.iter().position(|&p| p == from).unwrap() + 1) % prims.len()];
        let slot = tidemark_redis_proc::key_slot(format!("wm:{{{s}}}").as_bytes());
        moved_keys += c.move_slot(slot, to).expect("move the shard's slot");
        assert_eq!(primary_of_shard(&c, s), to);
        traffic.more(20, "between slot moves").await;
    }
    let slot_moves = t0.elapsed();
    // and a bulk reshard with redis-cli while messages flow
    let prims = c.primaries();
    let t1 = Instant::now();
    let slots = c
        .reshard(prims[0], prims[1], 1000)
        .expect("redis-cli --cluster reshard");
    let reshard = t1.elapsed();
    traffic.more(100, "after resharding").await;

    let (acked, refused) = traffic.stop();
    let entries = assert_delivered(&map, port, &acked).await;
    println!(
        "cluster resharding: {} messages, {entries} entries; 4 shard slots moved ({moved_keys} \
         keys) in {slot_moves:?}, {} slots resharded in {reshard:?}; sends retried: {refused:?}",
        acked.len(),
        slots.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn primary_loss_under_load() {
    let Some(mut c) = cluster() else { return };
    let port = support::free_port();
    let _node = serve(&c, port, "p1").await;
    let map = map(&c);
    let traffic = Traffic::start(port, 2);
    traffic.more(100, "before the first kill").await;

    let mut figures = Vec::new();
    // two different primaries, one after the other; each holds the core and the mailbox keys
    // of its shards, so each kill is a core primary's and a mailbox primary's loss at once
    for round in 0..2 {
        let victim = primary_of_shard(&c, if round == 0 { 3 } else { 12 });
        let t0 = Instant::now();
        c.kill9(victim).expect("kill -9 a primary");
        let promoted = c.wait_failover(victim).expect("a replica promoted");
        let failover = t0.elapsed();
        // The promoted primary has no replica now: commits to its shards wait (WAIT 1) and
        // are refused until one is back — acknowledged means on a replica. The old primary
        // comes back as the promoted one's replica.
        c.restart(victim).expect("restart the old primary");
        c.wait_consistent().expect("cluster consistent");
        traffic.more(100, "after the old primary rejoined").await;
        figures.push(format!(
            "node {victim} killed, node {promoted} promoted in {failover:?}"
        ));
    }

    let (acked, refused) = traffic.stop();
    let entries = assert_delivered(&map, port, &acked).await;
    let (_, metrics) = http_get(port, "/metrics");
    let regressions = metrics
        .lines()
        .find(|l| l.starts_with("tidemark_watermark_regressions_total"))
        .unwrap_or("tidemark_watermark_regressions_total 0")
        .to_string();
    println!(
        "cluster primary loss: {} messages, {entries} entries, every acknowledged one \
         delivered once; {}; {regressions}; sends retried: {refused:?}",
        acked.len(),
        figures.join("; ")
    );
}

/// The mailbox primary of some shards dies while its replica lags behind (paused): the
/// promoted replica lacks mailbox writes and has a lower W. The core log (a separate instance
/// here, so commits are not lost with the mailbox primary) was not trimmed below a W the
/// replica confirmed, so the materializer notices W went backwards and re-materialises:
/// nothing acknowledged is lost, nothing is delivered twice (same seqs), order kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mailbox_primary_loss_rematerializes_from_the_log() {
    mailbox_primary_loss(false).await;
}

/// The quiet case of the test above: traffic stops before the primary dies, and no message
/// comes after the failover; the regression is found and repaired by the materializer alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mailbox_primary_loss_rematerializes_from_the_log_quietly() {
    mailbox_primary_loss(true).await;
}

async fn mailbox_primary_loss(quiet: bool) {
    let Some(mut c) = cluster() else { return };
    let core = tidemark_redis_proc::RedisProcess::start().expect("core redis-server");
    let port = support::free_port();
    let s = seeds(&c);
    let _node = serve_with(
        &["--core", &core.url(), "--mailbox-cluster", &s],
        port,
        "m1",
    )
    .await;
    let mut t = Topology::new(SHARDS, Layout::PackedV2, vec![core.url()], vec![]);
    t.mailbox_cluster = Some(c.seeds());
    let map = t.validate().unwrap();
    let traffic = Traffic::start(port, 2);
    traffic.more(100, "before the pause").await;

    let victim = primary_of_shard(&c, 3);
    let replica = c.replicas_of(victim)[0];
    c.pause(replica).expect("SIGSTOP the replica");
    // and cut its link: what was already sent waits in its socket buffer, nothing more is sent
    c.call(victim, &["CLIENT", "KILL", "TYPE", "replica"])
        .expect("CLIENT KILL TYPE replica");
    // mailbox writes to the victim's shards now reach no replica (and no trim is confirmed)
    // for longer than two GC intervals (1 s): trims of those shards are due meanwhile
    let paused = Instant::now();
    traffic.more(150, "while the replica is paused").await;
    while paused.elapsed() < Duration::from_millis(2500) {
        traffic.more(10, "while the replica is paused").await;
    }
    // quiet: the last acknowledged message comes before the fault, nothing after it
    let mut traffic = Some(traffic);
    let stopped = if quiet {
        traffic.take().map(Traffic::stop)
    } else {
        None
    };
    let t0 = Instant::now();
    c.kill9(victim).expect("kill -9 the mailbox primary");
    c.resume(replica).expect("SIGCONT the replica");
    // (the harness' wait_failover does not count a replica paused at the kill as one)
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.role(replica) != tidemark_redis_proc::Role::Primary {
        assert!(
            Instant::now() < deadline,
            "the lagging replica was not promoted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    c.wait_consistent()
        .expect("cluster consistent after the failover");
    let failover = t0.elapsed();
    c.restart(victim).expect("restart the old primary");
    c.wait_consistent().expect("cluster consistent");
    let (acked, refused) = match (traffic, stopped) {
        (Some(traffic), _) => {
            traffic.more(100, "after the failover").await;
            traffic.stop()
        }
        (None, Some(stopped)) => stopped,
        (None, None) => unreachable!("traffic is stopped once"),
    };
    let entries = assert_delivered(&map, port, &acked).await;
    let (_, metrics) = http_get(port, "/metrics");
    let regressions: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tidemark_watermark_regressions_total "))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0);
    assert!(
        regressions >= 1.0,
        "the promoted replica lacked writes: a regression must have been seen"
    );
    println!(
        "cluster mailbox primary loss{}: {} messages, {entries} entries, every acknowledged \
         one delivered once; failover {failover:?}; watermark regressions re-materialised: \
         {regressions}; sends retried: {refused:?}",
        if quiet { " (quiet)" } else { "" },
        acked.len()
    );
}

/// `tidemark up --cluster`: a local 3+3 cluster under the data dir, both pools on it; a
/// message survives a stop and a start on the same data dir (same ports, same data).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_cluster_starts_and_restarts_on_its_data_dir() {
    if !tidemark_redis_proc::redis_server_available() || !tidemark_redis_proc::redis_cli_available()
    {
        eprintln!("SKIPPED: redis-server/redis-cli not installed (scripts/install-redis.sh)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let port = support::free_port();
    let up_with = |port: u16, extra: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tidemark"));
        cmd.args(["up", "--cluster", "--dev-auth", "--shards", "8", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--data-dir")
            .arg(&data)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        spawn_killed_with_us(&mut cmd)
    };
    let mut first = up_with(port, &[]);
    let lines = support::stdout_lines(&mut first);
    wait_healthy(port).await;
    let printed: Vec<String> = lines.try_iter().collect();
    assert!(
        printed.iter().filter(|l| l.starts_with("cluster ")).count() == 6,
        "six cluster nodes listed: {printed:?}"
    );
    let (s, r) = http_post(
        port,
        "/v1/messages?user=alice",
        &serde_json::json!({"id": "up-1", "to": ["bob"], "body": "kept"}).to_string(),
    );
    assert_eq!(s, 200, "{r}");
    // `tidemark upgrade` on a cluster deployment (ADR-0056): both pools' identities are keys
    // of the one cluster; made version 2, the raise is refused while `up`'s static owner runs
    let config = data.join("tidemark.toml");
    let upgrade = |extra: &[&str]| {
        let out = support::run(
            support::cli()
                .arg("upgrade")
                .arg("--config")
                .arg(&config)
                .args(extra),
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        (out.status.code(), text)
    };
    let (code, out) = upgrade(&["--check"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("nothing to do"), "{out}");
    let seeds = tidemark_store::topology::Topology::from_file(&config)
        .unwrap()
        .core_cluster
        .unwrap();
    let identity = |v: Option<&str>| -> Vec<String> {
        let client = redis::cluster::ClusterClient::new(seeds.clone()).unwrap();
        let mut c = client.get_connection().unwrap();
        ["core", "mailbox"]
            .iter()
            .map(|role| {
                let key = format!("{}:{role}", tidemark_store::deployment::KEY);
                if let Some(v) = v {
                    let () = redis::cmd("HSET")
                        .arg(&key)
                        .arg("version")
                        .arg(v)
                        .query(&mut c)
                        .unwrap();
                }
                redis::cmd("HGET")
                    .arg(&key)
                    .arg("version")
                    .query(&mut c)
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(identity(Some("2")), ["2", "2"]);
    let (code, out) = upgrade(&[]);
    assert_eq!(code, Some(2), "{out}");
    assert!(
        out.contains("shard(s) 0-7 are owned by running materializers"),
        "{out}"
    );
    assert_eq!(identity(None), ["2", "2"], "nothing written");
    // a clean stop (SIGINT, as Ctrl-C): the service and its six redis-servers end
    // SAFETY: signalling our own child
    unsafe { libc::kill(first.id() as i32, libc::SIGINT) };
    let status = first.wait().unwrap();
    assert!(status.success(), "{status:?}");

    // started again with --upgrade: raised on the cluster, the message still there
    let port2 = support::free_port();
    let mut second = up_with(port2, &["--upgrade"]);
    wait_healthy(port2).await;
    assert_eq!(identity(None), ["3", "3"], "raised by up --upgrade");
    let (s, page) = http_get(port2, "/v1/mailbox?user=bob&after=0&limit=10");
    assert_eq!(s, 200, "{page}");
    assert!(page.contains("\"body\":\"kept\""), "{page}");
    // SAFETY: signalling our own child
    unsafe { libc::kill(second.id() as i32, libc::SIGINT) };
    assert!(second.wait().unwrap().success());
}
