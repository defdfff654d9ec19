//! Several `tidemark serve` processes (nodes) in leases mode against one deployment
//! (issue 13, ADR-0030), with traffic spread over every node's gateway while nodes fail:
//!
//! 1. three nodes converge on a balanced assignment (each owns ⌊S/3⌋ or ⌈S/3⌉ shards);
//! 2. kill -9 of one node: its shards are taken by the others (takeover time printed);
//! 3. SIGSTOP of another for 3× the lease TTL, then SIGCONT: its shards are taken while it
//!    sleeps, and when it wakes it writes nothing it no longer owns;
//! 4. SIGTERM of a node: it releases its leases at once.
//!
//! Then every acknowledged message must be in every recipient's mailbox exactly once, in log
//! order (seq ascending), read through any live gateway.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::{http_get, http_post, serve_args, spawn_killed_with_us, wait_healthy};
use tidemark_redis_proc::{RedisOptions, RedisProcess};
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{ShardMap, Topology};

const SHARDS: u32 = 8;

/// The tests of this file run one at a time: each picks free ports before its nodes bind them,
/// and two tests picking the same port would send one test's traffic into the other's
/// deployment.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const TTL: Duration = Duration::from_secs(1);
const USERS: usize = 12;

/// `n` distinct free ports (all bound at once, then released).
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One node: `serve --ownership leases --lease-ttl 1s --node-id <id>` on `port`.
fn start_node(core: &str, mailbox: &str, id: &str, port: u16) -> Child {
    start_node_with(core, mailbox, id, port, &[])
}

/// [`start_node`] with `extra` arguments.
fn start_node_with(core: &str, mailbox: &str, id: &str, port: u16, extra: &[&str]) -> Child {
    let mut args = serve_args(core, mailbox, SHARDS, &format!("127.0.0.1:{port}"));
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(
        [
            "--ownership",
            "leases",
            "--lease-ttl",
            "1s",
            "--node-id",
            id,
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(&args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // debugging aid: NODES_LOG_DIR=/some/dir keeps every node's log (info, lease ticks)
    if let Ok(dir) = std::env::var("NODES_LOG_DIR") {
        let f = std::fs::File::create(format!("{dir}/{id}-{port}.log")).unwrap();
        cmd.env("RUST_LOG", "info,tidemark_server::ownership=debug")
            .stderr(f);
    }
    spawn_killed_with_us(&mut cmd)
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: sending a signal to our own child process
    unsafe {
        libc::kill(child.id() as i32, sig);
    }
}

/// Shard → lease holder, for the shards that have one.
async fn owners(map: &ShardMap) -> BTreeMap<u32, String> {
    match tidemark_ops::status::status(map).await {
        Ok(s) => s
            .shards
            .into_iter()
            .filter_map(|l| l.owner.map(|o| (l.shard, o)))
            .collect(),
        Err(_) => BTreeMap::new(),
    }
}

/// Waits until every shard is held by one of `live`, each of them holding ⌊S/n⌋ or ⌈S/n⌉;
/// returns how long it took.
async fn until_balanced(map: &ShardMap, live: &[&str], what: &str) -> Duration {
    until_balanced_n(map, live, SHARDS, what).await
}

/// [`until_balanced`] for a deployment of `shards` shards.
async fn until_balanced_n(map: &ShardMap, live: &[&str], shards: u32, what: &str) -> Duration {
    let start = Instant::now();
    let n = live.len() as u32;
    loop {
        let o = owners(map).await;
        let mut count: BTreeMap<&str, u32> = live.iter().map(|&id| (id, 0)).collect();
        let mut ok = o.len() == shards as usize;
        for id in o.values() {
            match count.get_mut(id.as_str()) {
                Some(c) => *c += 1,
                None => ok = false,
            }
        }
        if ok
            && count
                .values()
                .all(|&c| c == shards / n || c == shards.div_ceil(n))
        {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: not balanced over {live:?} after 30 s: {o:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An acknowledged message: its recipients and its offset per shard.
struct Acked {
    to: Vec<String>,
    offsets: BTreeMap<u32, u64>,
}

/// Sends until `stop`, round-robin over the gateways of `ports` that answer; a message whose
/// gateway fails is resent with the same id through the next one (idempotent).
fn sender(
    ports: Arc<Mutex<Vec<u16>>>,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
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
                serde_json::json!({"id": format!("m{i}"), "to": to, "body": format!("b{i}")});
            let sender = format!("s{}", i % 4);
            let mut tries = 0;
            loop {
                let live = ports.lock().unwrap().clone();
                let port = live[(i + tries) % live.len()];
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
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
                if tries > 500 {
                    panic!("message m{i} not acknowledged: {status} {resp}");
                }
            }
            i += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
    })
}

/// Every acknowledged message is in every recipient's mailbox exactly once, in log order
/// (read through the gateway on `port`), within 30 s.
async fn assert_delivered(map: &ShardMap, port: u16, acked: &[Acked]) {
    let mut want: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for m in acked {
        for u in &m.to {
            let s = map.route(u).shard;
            want.entry(u.clone()).or_default().push(m.offsets[&s]);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for (u, seqs) in &want {
        let mut want_set: Vec<u64> = seqs.clone();
        want_set.sort_unstable();
        loop {
            let (status, body) =
                http_get(port, &format!("/v1/mailbox?user={u}&after=0&limit=1000"));
            // a 5xx says "retry" (e.g. the first read on a connection to a restarted Redis)
            if status >= 500 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            assert_eq!(status, 200, "{body}");
            let page: serde_json::Value = serde_json::from_str(&body).unwrap();
            let got: Vec<u64> = page["entries"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["seq"].as_u64().unwrap())
                .collect();
            assert!(
                got.windows(2).all(|w| w[0] < w[1]),
                "{u}: not in order or repeated: {got:?}"
            );
            if got == want_set {
                break;
            }
            let missing: Vec<&u64> = want_set.iter().filter(|s| !got.contains(s)).collect();
            let extra: Vec<&u64> = got.iter().filter(|s| !want_set.contains(s)).collect();
            assert!(
                extra.is_empty(),
                "{u}: entries never acknowledged: {extra:?}"
            );
            assert!(
                Instant::now() < deadline,
                "{u}: acknowledged but not delivered: {missing:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "{} acknowledged messages, {} mailbox entries checked",
        acked.len(),
        want.values().map(Vec::len).sum::<usize>()
    );
}

/// A core and a mailbox redis-server and the map of a `SHARDS`-shard deployment over them.
struct Instances {
    core: RedisProcess,
    mailbox: RedisProcess,
    cu: String,
    mu: String,
    map: ShardMap,
    /// A free port for each of [`IDS`].
    ports: Vec<u16>,
}

/// The three nodes of most tests.
const IDS: [&str; 3] = ["n0", "n1", "n2"];

fn instances() -> Instances {
    instances_with(RedisOptions::default())
}

/// [`instances`] started with `opts` (AOF for restarts).
fn instances_with(opts: RedisOptions) -> Instances {
    let core = RedisProcess::start_with(opts.clone()).expect("redis-server");
    let mailbox = RedisProcess::start_with(opts).expect("redis-server");
    let (cu, mu) = (core.url(), mailbox.url());
    let map = Topology::single(SHARDS, Layout::PackedV2, &cu, &mu)
        .validate()
        .unwrap();
    Instances {
        core,
        mailbox,
        cu,
        mu,
        map,
        ports: free_ports(IDS.len()),
    }
}

/// The [`sender`] running over the gateways in `live`, until [`Traffic::finish`].
struct Traffic {
    live: Arc<Mutex<Vec<u16>>>,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
    tx: std::thread::JoinHandle<()>,
}

impl Traffic {
    fn start(ports: Vec<u16>) -> Traffic {
        let live = Arc::new(Mutex::new(ports));
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let tx = sender(live.clone(), stop.clone(), acked.clone());
        Traffic {
            live,
            stop,
            acked,
            tx,
        }
    }

    /// Sends no more through `port` (its node is about to go).
    fn drop_port(&self, port: u16) {
        self.live.lock().unwrap().retain(|&p| p != port);
    }

    /// Sends through `port` too.
    fn add_port(&self, port: u16) {
        self.live.lock().unwrap().push(port);
    }

    /// Stops sending; then more than `at_least` messages were acknowledged and every one is
    /// delivered (read through the gateway on `port`).
    async fn finish(self, map: &ShardMap, port: u16, at_least: usize) {
        self.stop.store(true, Ordering::SeqCst);
        self.tx.join().unwrap();
        let acked = std::mem::take(&mut *self.acked.lock().unwrap());
        assert!(
            acked.len() > at_least,
            "only {} messages acknowledged",
            acked.len()
        );
        assert_delivered(map, port, &acked).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_fail_over_and_hand_over_without_losing_a_message() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let r = instances();
    let (cu, mu, map, ports, ids) = (&r.cu, &r.mu, &r.map, r.ports.clone(), IDS);
    let mut nodes: Vec<Child> = ids
        .iter()
        .zip(&ports)
        .map(|(id, &p)| start_node(cu, mu, id, p))
        .collect();
    for &p in &ports {
        wait_healthy(p).await;
    }
    let t = until_balanced(map, &ids, "three nodes").await;
    println!("three nodes balanced in {t:?}");

    let traffic = Traffic::start(ports.clone());
    tokio::time::sleep(Duration::from_millis(700)).await;

    // kill -9 of n1: the others take its shards
    traffic.drop_port(ports[1]);
    nodes[1].kill().unwrap();
    let _ = nodes[1].wait();
    let t = until_balanced(map, &["n0", "n2"], "after kill -9 of n1").await;
    println!("kill -9: shards taken over in {t:?} (lease TTL {TTL:?})");
    assert!(t <= TTL * 4 + Duration::from_secs(1), "takeover took {t:?}");

    // SIGSTOP of n2 for 3x the TTL: n0 takes everything; n2 wakes up fenced, then the two
    // rebalance again
    traffic.drop_port(ports[2]);
    signal(&nodes[2], libc::SIGSTOP);
    let t = until_balanced(map, &["n0"], "while n2 is stopped").await;
    println!("SIGSTOP: shards taken over in {t:?}");
    tokio::time::sleep((TTL * 3).saturating_sub(t)).await;
    signal(&nodes[2], libc::SIGCONT);
    let t = until_balanced(map, &["n0", "n2"], "after SIGCONT of n2").await;
    println!("SIGCONT: rebalanced in {t:?}");
    traffic.add_port(ports[2]);
    tokio::time::sleep(Duration::from_millis(700)).await;

    traffic.finish(map, ports[0], 50).await;

    // SIGTERM of n0: its leases are released at once, n2 takes everything well within a TTL
    signal(&nodes[0], libc::SIGTERM);
    let exited = tokio::task::spawn_blocking(move || {
        let mut n0 = nodes.swap_remove(0);
        let status = n0.wait();
        (status, nodes)
    });
    let t = until_balanced(map, &["n2"], "after SIGTERM of n0").await;
    println!("SIGTERM: shards taken over in {t:?}");
    let (status, mut rest) = exited.await.unwrap();
    assert!(status.unwrap().success(), "n0 exits cleanly on SIGTERM");
    for n in &mut rest {
        let _ = n.kill();
        let _ = n.wait();
    }
}

/// SIGTERM and wait: a clean stop (leases released, record removed).
fn stop(mut node: Child) {
    signal(&node, libc::SIGTERM);
    assert!(
        node.wait().unwrap().success(),
        "a node exits cleanly on SIGTERM"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_1_3_2_and_a_rolling_restart_under_load() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let r = instances();
    let (cu, mu, map, ports, ids) = (&r.cu, &r.mu, &r.map, r.ports.clone(), IDS);
    let mut nodes: Vec<Option<Child>> = vec![Some(start_node(cu, mu, "n0", ports[0])), None, None];
    wait_healthy(ports[0]).await;
    until_balanced(map, &["n0"], "one node").await;

    let traffic = Traffic::start(vec![ports[0]]);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // 1 -> 3: the newcomers take their shares from n0 (hand-over under load)
    for i in 1..3 {
        nodes[i] = Some(start_node(cu, mu, ids[i], ports[i]));
        wait_healthy(ports[i]).await;
        traffic.add_port(ports[i]);
    }
    let t = until_balanced(map, &ids, "1 -> 3").await;
    println!("1 -> 3: balanced in {t:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;

    // 3 -> 2: n1 leaves cleanly
    traffic.drop_port(ports[1]);
    stop(nodes[1].take().unwrap());
    let t = until_balanced(map, &["n0", "n2"], "3 -> 2").await;
    println!("3 -> 2: balanced in {t:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;

    // a rolling restart: n1 back, then each node stopped and started again with its id
    nodes[1] = Some(start_node(cu, mu, "n1", ports[1]));
    wait_healthy(ports[1]).await;
    traffic.add_port(ports[1]);
    until_balanced(map, &ids, "n1 back").await;
    for i in 0..3 {
        traffic.drop_port(ports[i]);
        stop(nodes[i].take().unwrap());
        nodes[i] = Some(start_node(cu, mu, ids[i], ports[i]));
        wait_healthy(ports[i]).await;
        traffic.add_port(ports[i]);
        let t = until_balanced(map, &ids, "rolling restart").await;
        println!("rolling restart of {}: balanced again in {t:?}", ids[i]);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    traffic.finish(map, ports[0], 50).await;
    for n in nodes.into_iter().flatten() {
        stop(n);
    }
}

/// Static ownership from the config's owner table (ADR-0015's model): each node owns exactly
/// its shards; a node replaced by another with the same id (the old one paused, a zombie) is
/// fenced by the new one's epoch and writes nothing after it wakes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn static_owner_table_and_a_replacement_with_the_same_id() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let r = instances();
    let (cu, mu) = (&r.cu, &r.mu);
    let ids = ["n0", "n1", "n2"];
    let owners: Vec<&str> = (0..SHARDS as usize).map(|s| ids[s % 3]).collect();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tidemark.toml");
    std::fs::write(
        &config,
        format!(
            "shards = {SHARDS}\ncore = [{cu:?}]\nmailbox = [{mu:?}]\nowner_of_shard = {owners:?}\n"
        ),
    )
    .unwrap();
    let map = Topology::from_file(&config).unwrap().validate().unwrap();
    let start = |id: &str, port: u16| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tidemark"));
        cmd.args(["serve", "--config"])
            .arg(&config)
            .args(["--node-id", id, "--dev-auth", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        spawn_killed_with_us(&mut cmd)
    };
    let ports = free_ports(ids.len());
    let mut nodes: Vec<Child> = ids
        .iter()
        .zip(&ports)
        .map(|(id, &p)| start(id, p))
        .collect();
    for &p in &ports {
        wait_healthy(p).await;
    }
    // a node id that the table does not know is refused before anything is claimed
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(["serve", "--config"])
        .arg(&config)
        .args(["--node-id", "stranger", "--dev-auth", "--listen"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no shard"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let traffic = Traffic::start(vec![ports[0], ports[2]]);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // n1 pauses (a zombie); its replacement, same id, claims n1's shards and fences it
    signal(&nodes[1], libc::SIGSTOP);
    let port_b = free_port();
    let replacement = start("n1", port_b);
    wait_healthy(port_b).await;
    traffic.add_port(port_b);
    tokio::time::sleep(Duration::from_millis(500)).await;
    signal(&nodes[1], libc::SIGCONT);
    // the zombie finds itself fenced on the shards it tries to write (a shard without traffic
    // since the replacement is found at its next write); it never reports another node's shard
    let n1_shards = map.shards_of_node("n1");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = http_get(ports[1], "/healthz");
        let fenced = |s: &u32| body.contains(&format!("shard {s}: Fenced"));
        let foreign = map
            .all_shards()
            .filter(|s| !n1_shards.contains(s))
            .any(|s| body.contains(&format!("shard {s}:")));
        assert!(!foreign, "the old n1 reports another node's shard: {body}");
        if status == 503 && n1_shards.iter().any(fenced) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the old n1 is not fenced: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    traffic.finish(&map, ports[0], 20).await;
    nodes.push(replacement);
    for n in &mut nodes {
        let _ = n.kill();
        let _ = n.wait();
    }
}

/// `tidemark up --nodes 2`: two nodes in leases mode over one set of redis-servers, the second
/// a child process; kill -9 of the child moves its shard to the first, and Ctrl-C stops all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_with_two_nodes_fails_over_when_one_is_killed() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let port = free_port();
    // the second node listens on the next port
    let up = support::UpProc::start_in(
        std::path::Path::new("."),
        &format!("127.0.0.1:{port}"),
        &data,
        &["--nodes", "2", "--dev-auth"],
    );
    let child_line = up.containing("node     up-1").to_string();
    let pid: i32 = child_line
        .rsplit("pid ")
        .next()
        .and_then(|p| p.trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| panic!("no pid in {child_line:?}"));
    let config = data.join("tidemark.toml");
    let map = Topology::from_file(&config).unwrap().validate().unwrap();
    // up --shards 2: one shard each
    let t = until_balanced_n(&map, &["up-0", "up-1"], 2, "up --nodes 2").await;
    println!("up --nodes 2: balanced in {t:?}");
    wait_healthy(port + 1).await;
    // SAFETY: a signal to a process `up` started for us
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let t = until_balanced_n(&map, &["up-0"], 2, "after kill -9 of up-1").await;
    println!("up --nodes 2: kill -9 of up-1, its shard taken in {t:?}");
    // the survivor is healthy again once its worker has claimed the shard it took
    wait_healthy(port).await;
    // nothing printed or logged carries the Redis password
    let password = std::fs::read_to_string(data.join("redis.pass")).unwrap();
    let password = password.trim();
    let stderr = up.stderr();
    let stdout = up.lines.join("\n");
    assert!(
        !stderr.contains(password) && !stdout.contains(password),
        "password printed"
    );
    up.stop();
}

/// `--role gateway` serves clients and owns no shard; `--role materializer` owns the shards
/// and answers only `/metrics` and `/healthz`. Together they deliver everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_node_and_a_materializer_node() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let r = instances();
    let (cu, mu, map) = (&r.cu, &r.mu, &r.map);
    let (pg, pm) = (r.ports[0], r.ports[1]);
    let mut g = start_node_with(cu, mu, "g", pg, &["--role", "gateway"]);
    let mut m = start_node_with(cu, mu, "m", pm, &["--role", "materializer"]);
    wait_healthy(pg).await;
    wait_healthy(pm).await;
    let t = until_balanced(map, &["m"], "gateway + materializer").await;
    println!("the materializer node owns every shard after {t:?}");
    // `tidemark status --json`: the shape, both nodes with their roles
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args(["status", "--core", cu, "--mailbox", mu, "--shards"])
        .arg(SHARDS.to_string())
        .arg("--json")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let roles: Vec<(String, String)> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            for k in ["id", "url", "role", "age_ms"] {
                assert!(n.get(k).is_some(), "node without {k}: {n}");
            }
            (
                n["id"].as_str().unwrap().into(),
                n["role"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        roles,
        [
            ("g".into(), "gateway".into()),
            ("m".into(), "materializer".into())
        ]
    );
    let shards = v["shards"].as_array().unwrap();
    assert_eq!(shards.len(), SHARDS as usize);
    for sh in shards {
        for k in [
            "shard",
            "owner",
            "epoch",
            "w_min",
            "w_max",
            "head",
            "lag",
            "layout",
            "blob_bytes",
        ] {
            assert!(sh.get(k).is_some(), "shard without {k}: {sh}");
        }
        assert_eq!(sh["owner"], "m");
        assert_eq!(sh["layout"], "packed-v2");
        assert_eq!(sh["blob_bytes"], 19);
    }
    // the materializer node's listener: health and metrics only
    assert_eq!(http_get(pm, "/v1/mailbox?user=u1").0, 404);
    assert_eq!(http_post(pm, "/v1/messages?user=u1", "{}").0, 404);
    assert_eq!(http_get(pm, "/metrics").0, 200);
    let traffic = Traffic::start(vec![pg]);
    tokio::time::sleep(Duration::from_millis(700)).await;
    traffic.finish(map, pg, 20).await;
    for n in [&mut g, &mut m] {
        let _ = n.kill();
        let _ = n.wait();
    }
}

/// Two nodes with leases while core Redis, then mailbox Redis, is killed and restarted from
/// its AOF under traffic: leases expire and are taken again, nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_ride_out_redis_restarts() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let mut r = instances_with(RedisOptions {
        appendonly: true,
        appendfsync: "always".into(),
        ..Default::default()
    });
    let (cu, mu, map) = (r.cu.clone(), r.mu.clone(), r.map.clone());
    let ports = r.ports.clone();
    let mut nodes: Vec<Child> = ["n0", "n1"]
        .iter()
        .zip(&ports)
        .map(|(id, &p)| start_node(&cu, &mu, id, p))
        .collect();
    for &p in &ports[..2] {
        wait_healthy(p).await;
    }
    until_balanced(&map, &["n0", "n1"], "two nodes").await;
    let traffic = Traffic::start(ports[..2].to_vec());
    tokio::time::sleep(Duration::from_millis(700)).await;
    r.core.restart().unwrap();
    let t = until_balanced(&map, &["n0", "n1"], "after a core restart").await;
    println!("core Redis restarted: leases held again in {t:?}");
    tokio::time::sleep(Duration::from_millis(700)).await;
    r.mailbox.restart().unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let t = until_balanced(&map, &["n0", "n1"], "after a mailbox restart").await;
    println!("mailbox Redis restarted: balanced in {t:?}");
    traffic.finish(&map, ports[0], 50).await;
    for n in &mut nodes {
        let _ = n.kill();
        let _ = n.wait();
    }
}
