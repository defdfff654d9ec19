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
//!
//! Also: scaling 1 -> 3 -> 2 and a rolling restart, a static owner table, `up --nodes 2`,
//! gateway- and materializer-only nodes, Redis restarts, and ADR-0015's layout upgrade as a
//! rolling restart of leases nodes (ADR-0033). Nodes listen on ports from
//! `support::nodes::node_ports`, outside the ephemeral range, so that a node restarted on its
//! port finds it free.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::nodes::{consecutive_node_ports, node_ports, signal, until_balanced_within, Traffic};
use support::{http_get, http_post, serve_args, spawn_killed_with_us, wait_healthy, Serve};
use tidemark_redis_proc::{RedisOptions, RedisProcess};
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::{ShardMap, Topology};

const SHARDS: u32 = 8;

/// The tests of this file run one at a time: three nodes and their traffic on a 2-core box are
/// load enough, and takeover times measured side by side with another test's would say little.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const TTL: Duration = Duration::from_secs(1);

fn free_port() -> u16 {
    node_ports(1)[0]
}

/// Waits until every shard is held by one of `live`, each of them holding ⌊S/n⌋ or ⌈S/n⌉;
/// returns how long it took.
async fn until_balanced(map: &ShardMap, live: &[&str], what: &str) -> Duration {
    until_balanced_within(map, live, what, 30).await
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
        ports: node_ports(IDS.len()),
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
    let ports = node_ports(ids.len());
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
    // the second node listens on the next port
    let port = consecutive_node_ports(2)[0];
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
    let t = until_balanced(&map, &["up-0", "up-1"], "up --nodes 2").await;
    println!("up --nodes 2: balanced in {t:?}");
    wait_healthy(port + 1).await;
    // SAFETY: a signal to a process `up` started for us
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let t = until_balanced(&map, &["up-0"], "after kill -9 of up-1").await;
    println!("up --nodes 2: kill -9 of up-1, its shard taken in {t:?}");
    // the survivor is healthy again once its worker has claimed the shard it took
    wait_healthy(port).await;
    // `up` said so at once, with the status (ADR-0065)
    let deadline = Instant::now() + Duration::from_secs(10);
    while !up.stderr().contains("node process exited") {
        assert!(
            Instant::now() < deadline,
            "up did not report its node's exit: {}",
            up.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let said = up.stderr();
    let line = said
        .lines()
        .find(|l| l.contains("node process exited"))
        .unwrap();
    assert!(
        line.contains("up-1") && line.contains("signal: 9"),
        "{line}"
    );
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
            for k in ["id", "url", "role", "layout", "reads", "age_ms"] {
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

/// `serve --layout LAYOUT --ownership leases --lease-ttl 1s --node-id ID` on `port`, its log
/// (warnings and errors) in `dir`.
fn layout_node(r: &Instances, id: &str, port: u16, layout: &str, dir: &std::path::Path) -> Serve {
    let args = [
        "--layout",
        layout,
        "--ownership",
        "leases",
        "--lease-ttl",
        "1s",
        "--node-id",
        id,
    ];
    let log = dir.join(format!("{id}-{layout}.log"));
    Serve::start((&r.cu, &r.mu, SHARDS), port, &args, "warn", log)
}

/// What the upgrade's monitor saw: status samples and broken rules.
#[derive(Default)]
struct UpgradeWatch {
    samples: u64,
    violations: Vec<String>,
}

/// Samples `tidemark status` every 50 ms until `stop`: a shard's layout never goes back from
/// packed-v2 to packed-v1, its epoch never goes down, and no node running packed-v1 code
/// (`v1`, kept up to date by the test) holds the lease of a packed-v2 shard. The watermark is
/// read before the lease, so a packed-v2 watermark with a packed-v1 holder means that holder
/// won the lease after the shard was converted.
async fn watch_upgrade(
    map: ShardMap,
    v1: Arc<Mutex<BTreeSet<String>>>,
    out: Arc<Mutex<UpgradeWatch>>,
    stop: Arc<AtomicBool>,
) {
    let mut last: BTreeMap<u32, (String, u64)> = BTreeMap::new();
    while !stop.load(Ordering::SeqCst) {
        if let Ok(st) = tidemark_ops::status::status(&map).await {
            let v1 = v1.lock().unwrap().clone();
            let mut out = out.lock().unwrap();
            out.samples += 1;
            for sh in st.shards {
                let (Some(layout), Some(epoch)) = (sh.layout, sh.epoch) else {
                    continue;
                };
                if let Some((l0, e0)) = last.get(&sh.shard) {
                    if l0 == "packed-v2" && layout == "packed-v1" {
                        out.violations
                            .push(format!("shard {}: back to packed-v1", sh.shard));
                    }
                    if epoch < *e0 {
                        out.violations
                            .push(format!("shard {}: epoch {e0} -> {epoch}", sh.shard));
                    }
                }
                if let Some(o) = sh.owner.as_ref().filter(|o| v1.contains(*o)) {
                    if layout == "packed-v2" {
                        out.violations.push(format!(
                            "shard {}: packed-v2 (epoch {epoch}) and its lease held by {o}, \
                             a packed-v1 node",
                            sh.shard
                        ));
                    }
                }
                last.insert(sh.shard, (layout, epoch));
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every shard's watermark: (layout, blob length).
async fn layouts(mu: &str) -> Vec<(String, usize)> {
    let mut out = Vec::new();
    for s in 0..SHARDS {
        let wm = support::watermark(mu, s).await;
        out.push((wm.layout.as_str().to_string(), wm.blob_len));
    }
    out
}

/// ADR-0015's upgrade (packed-v1 -> packed-v2) as a rolling restart of three leases nodes
/// under traffic through every gateway, as `docs/operations.md` describes it ("The ADR-0015
/// upgrade as a rolling restart of nodes"): each node in turn is stopped (SIGTERM) and started
/// again with the same id and `--layout packed-v2`. From the first packed-v2 node on, the
/// shards go to the packed-v2 nodes only (they run the newest layout in the registry); each
/// shard moves once from old code to new (hand-over: the old owner stops, releases; the new one
/// claims, epoch + 1) and is converted on its next write. Throughout, no packed-v1 node holds
/// the lease of a converted shard, no epoch goes down, no node is fenced or refuses a shard,
/// and nothing acknowledged is lost, duplicated or reordered. At the end old code started on
/// the converted data refuses to start and changes no epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_upgrade_from_packed_v1_to_packed_v2_under_traffic() {
    let _one_at_a_time = ONE_AT_A_TIME.lock().await;
    let r = instances();
    let (map, ports, ids) = (r.map.clone(), r.ports.clone(), IDS);
    let logs = support::temp_dir("nodes-upgrade");
    let mut nodes: Vec<Serve> = ids
        .iter()
        .zip(&ports)
        .map(|(id, &p)| layout_node(&r, id, p, "packed-v1", &logs))
        .collect();
    for &p in &ports {
        wait_healthy(p).await;
    }
    until_balanced(&map, &ids, "three packed-v1 nodes").await;
    let v1: Arc<Mutex<BTreeSet<String>>> =
        Arc::new(Mutex::new(ids.iter().map(|s| s.to_string()).collect()));
    let traffic = Traffic::start(ports.clone());
    let watch: Arc<Mutex<UpgradeWatch>> = Arc::default();
    let stop_watch = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn(watch_upgrade(
        map.clone(),
        v1.clone(),
        watch.clone(),
        stop_watch.clone(),
    ));
    support::until("traffic under packed-v1", 30, || async {
        traffic.acked() > 30
    })
    .await;
    assert!(
        layouts(&r.mu)
            .await
            .iter()
            .all(|(l, len)| l == "packed-v1" && *len == 1216),
        "the old deployment writes packed-v1"
    );

    // the rolling restart, one node at a time
    let t_all = Instant::now();
    let mut v2: Vec<&str> = Vec::new();
    let mut timings = Vec::new();
    for i in 0..3 {
        traffic.drop_port(ports[i]);
        let t = Instant::now();
        signal(&nodes[i].child, libc::SIGTERM);
        let status = nodes[i].wait_exit(20).await;
        assert!(status.success(), "{} stops cleanly: {status}", ids[i]);
        let stopped = t.elapsed();
        v1.lock().unwrap().remove(ids[i]);
        v2.push(ids[i]);
        let t = Instant::now();
        nodes[i] = layout_node(&r, ids[i], ports[i], "packed-v2", &logs);
        wait_healthy(ports[i]).await;
        let healthy = t.elapsed();
        traffic.add_port(ports[i]);
        // every shard on the packed-v2 nodes, balanced over them
        let what = format!("after {} runs packed-v2", ids[i]);
        until_balanced(&map, &v2, &what).await;
        let moved = t.elapsed();
        println!(
            "upgrade of {}: stopped in {stopped:?}, healthy {healthy:?} after its start, every \
             shard on {v2:?} {moved:?} after its start",
            ids[i]
        );
        timings.push((stopped, healthy, moved));
        // a little traffic through the mixed deployment before the next node
        let n = traffic.acked();
        support::until("traffic in the mix", 30, || async {
            traffic.acked() > n + 100
        })
        .await;
    }
    let total = t_all.elapsed();
    println!("rolling upgrade of 3 nodes: {total:?} from the first SIGTERM to the last balance");

    let (messages, entries) = traffic.finish(&map, ports[0], 100).await;
    stop_watch.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    let watch = std::mem::take(&mut *watch.lock().unwrap());
    assert!(
        watch.violations.is_empty(),
        "{} violations in {} samples:\n{}",
        watch.violations.len(),
        watch.samples,
        watch.violations.join("\n")
    );
    assert!(
        watch.samples > 20,
        "the monitor ran ({} samples)",
        watch.samples
    );
    // one message to every shard (the traffic's users do not cover them all): each is
    // written by its packed-v2 owner, so each is packed-v2 now, 19 bytes once uniform
    let mut probes: BTreeMap<u32, String> = BTreeMap::new();
    for i in 0.. {
        let u = format!("probe-{i}");
        probes.entry(map.route(&u).shard).or_insert(u);
        if probes.len() == SHARDS as usize {
            break;
        }
    }
    let to: Vec<&String> = probes.values().collect();
    let body = serde_json::json!({"id": "probe", "to": to, "body": "probe"}).to_string();
    let (status, resp) = http_post(ports[0], "/v1/messages?user=prober", &body);
    assert_eq!(status, 200, "{resp}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = layouts(&r.mu).await;
        if now.iter().all(|(l, len)| l == "packed-v2" && *len == 19) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every shard packed-v2, 19 bytes: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let verify = support::tidemark(&["wm", "verify", "--redis", &r.mu]);
    assert!(verify.status.success(), "{verify:?}");
    // no node was fenced and no old node met converted data (it would have refused the shard)
    for n in &nodes {
        let (_, metrics) = http_get(n.port, "/metrics");
        assert!(
            !metrics
                .lines()
                .any(|l| l.starts_with("tidemark_shard_fenced_total") && !l.ends_with(" 0")),
            "a packed-v2 node was fenced:\n{metrics}"
        );
    }
    for entry in std::fs::read_dir(&logs).unwrap() {
        let path = entry.unwrap().path();
        let log = std::fs::read_to_string(&path).unwrap();
        assert!(
            !log.contains("Fenced") && !log.contains("shard not taken"),
            "{}:\n{log}",
            path.display()
        );
    }

    // old code started now (a mistake): refuses to start, changes no epoch
    let epochs: Vec<u64> = {
        let mut v = Vec::new();
        for s in 0..SHARDS {
            v.push(support::watermark(&r.mu, s).await.epoch);
        }
        v
    };
    let mut late = layout_node(&r, "late-v1", free_port(), "packed-v1", &logs);
    let status = late.wait_exit(20).await;
    let log = late.log_text();
    assert!(!status.success(), "old code must not start: {log}");
    assert!(log.contains("unknown_layout"), "{log}");
    for (s, &e) in epochs.iter().enumerate() {
        assert_eq!(
            support::watermark(&r.mu, s as u32).await.epoch,
            e,
            "shard {s}"
        );
    }
    println!(
        "rolling upgrade v1 -> v2: {messages} messages, {entries} mailbox entries, {} status \
         samples, 0 violations; per node (stop, healthy, all shards on the new nodes): {}; total \
         {total:.1?}",
        watch.samples,
        timings
            .iter()
            .map(|(a, b, c)| format!("({a:.1?}, {b:.1?}, {c:.1?})"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for n in &mut nodes {
        n.stop();
    }
    std::fs::remove_dir_all(&logs).ok();
}
