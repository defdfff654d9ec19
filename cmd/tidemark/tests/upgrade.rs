//! `tidemark upgrade` (ADR-0056) against real redis-servers and real `tidemark serve`
//! processes: a deployment of identity version 2 (created before ADR-0055) is raised to 3 only
//! while no process that cannot read packed log records may run; records written before and
//! after are delivered in order; a running process keeps the six-field form until it restarts.

mod support;

use std::process::Child;
use std::time::Duration;

use support::nodes::signal;
use support::{http_get, http_post, redis_cmd, spawn_healthy};
use tidemark_store::deployment::KEY;

const SHARDS: u32 = 1;

fn version(url: &str) -> String {
    match redis_cmd(url, &["HGET", KEY, "version"]) {
        redis::Value::BulkString(b) => String::from_utf8(b).unwrap(),
        v => panic!("no version: {v:?}"),
    }
}

fn set_version(urls: &[&str], v: &str) {
    for u in urls {
        redis_cmd(u, &["HSET", KEY, "version", v]);
    }
}

fn record_fields(core: &str, offset: u64) -> Vec<String> {
    support::record_fields(core, 0, offset)
}

/// Sends `body` from alice to bob over HTTP; returns its offset on shard 0.
fn send(port: u16, id: &str, body: &str) -> u64 {
    let msg = serde_json::json!({"id": id, "to": ["bob"], "body": body});
    let (status, resp) = http_post(port, "/v1/messages?user=alice", &msg.to_string());
    assert_eq!(status, 200, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
    v["offsets"]["0"]
        .as_u64()
        .unwrap_or_else(|| panic!("no offset in {resp}"))
}

/// Bob's mailbox bodies, once it holds `n` entries (at most 20 s).
async fn bobs_bodies(port: u16, n: usize) -> Vec<String> {
    let mut last = String::new();
    for _ in 0..200 {
        let (status, body) = http_get(port, "/v1/mailbox?user=bob&after=0&limit=100");
        if status == 200 {
            let page: serde_json::Value = serde_json::from_str(&body).unwrap();
            let bodies: Vec<String> = page["entries"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["body"].as_str().unwrap().to_string())
                .collect();
            if bodies.len() >= n {
                return bodies;
            }
        }
        last = body;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("bob's mailbox never held {n} entries: {last}")
}

/// SIGTERM, then wait for the exit (a clean stop: owner marks and the node record go).
fn stop(mut child: Child) {
    signal(&child, libc::SIGTERM);
    for _ in 0..300 {
        if child.try_wait().unwrap().is_some() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    panic!("serve did not stop within 15 s of SIGTERM");
}

fn upgrade(core: &str, mailbox: &str, extra: &[&str]) -> (i32, String) {
    let out = support::run(
        support::cli()
            .args(["upgrade", "--core", core, "--mailbox", mailbox, "--shards"])
            .arg(SHARDS.to_string())
            .args(extra),
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// `serve` arguments on `port`: role `all` (static or leases) or `gateway`. A gateway alone
/// commits and never trims the log, so the records it wrote can be looked at.
fn args(c: &str, m: &str, port: u16, extra: &[&str]) -> Vec<String> {
    let mut a = support::serve_args(c, m, SHARDS, &format!("127.0.0.1:{port}"));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// A version-2 deployment with a static owner: refused while the owner runs (it does not say
/// what it reads), raised once it stopped; records of both forms are delivered in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_2_deployment_is_raised_once_its_static_owner_stopped() {
    let (core, mailbox) = support::redis_pair();
    let (c, m) = (core.url(), mailbox.url());
    let (p_owner, p_gw) = (support::free_port(), support::free_port());
    let owner = args(&c, &m, p_owner, &["--ownership", "static"]);
    let gateway = args(&c, &m, p_gw, &["--role", "gateway"]);
    // the deployment is created (version 3), then made what older code created
    stop(spawn_healthy(&owner, p_owner).await);
    set_version(&[&c, &m], "2");

    let gw = spawn_healthy(&gateway, p_gw).await;
    let a = send(p_gw, "a", "before the upgrade");
    assert_eq!(
        record_fields(&c, a),
        ["p", "f", "c", "r", "b", "t"],
        "a version-2 deployment writes six-field records"
    );
    let running = spawn_healthy(&owner, p_owner).await;
    let (code, out) = upgrade(&c, &m, &[]);
    assert_eq!(code, 2, "refused while a static owner runs: {out}");
    assert!(
        out.contains("shard(s) 0 are owned by running materializers"),
        "{out}"
    );
    assert_eq!((version(&c), version(&m)), ("2".into(), "2".into()));

    stop(running);
    let (code, out) = upgrade(&c, &m, &["--check"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("nothing blocks"), "{out}");
    assert_eq!(version(&c), "2", "--check writes nothing");
    let (code, out) = upgrade(&c, &m, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("raised 2 instances to version 3"), "{out}");
    assert_eq!((version(&c), version(&m)), ("3".into(), "3".into()));
    let (code, out) = upgrade(&c, &m, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("nothing to do"), "a second run: {out}");

    // the gateway chose its form at start; started again, it packs
    let b = send(p_gw, "b", "after the upgrade, before the restart");
    assert_eq!(record_fields(&c, b), ["p", "f", "c", "r", "b", "t"]);
    stop(gw);
    let gw = spawn_healthy(&gateway, p_gw).await;
    let d = send(p_gw, "d", "after the restart");
    assert_eq!(record_fields(&c, d), ["p", "m"], "packed from now on");
    let owner = spawn_healthy(&owner, p_owner).await;
    assert_eq!(
        bobs_bodies(p_gw, 3).await,
        [
            "before the upgrade",
            "after the upgrade, before the restart",
            "after the restart"
        ]
    );
    stop(owner);
    stop(gw);
}

/// Leases mode: live nodes of this build say they read version 3, so their shards do not block
/// the raise; a node record that does not say (an older build) and a version-1 instance do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_nodes_that_read_version_3_allow_it_and_others_block_it() {
    let (core, mailbox) = support::redis_pair();
    let (c, m) = (core.url(), mailbox.url());
    let (p_node, p_gw) = (support::free_port(), support::free_port());
    let node = args(&c, &m, p_node, &[]);
    let gateway = args(&c, &m, p_gw, &["--role", "gateway"]);
    stop(spawn_healthy(&node, p_node).await);
    set_version(&[&c, &m], "2");
    let running = spawn_healthy(&node, p_node).await;
    let (code, out) = upgrade(&c, &m, &["--check"]);
    assert_eq!(
        code, 0,
        "a live node of this build, holding the lease: {out}"
    );
    stop(running);

    let gw = spawn_healthy(&gateway, p_gw).await;
    // a node of an older build: its record has no `reads`
    let old = format!("{}old-build", tidemark_store::keys::NODE_PREFIX);
    redis_cmd(
        &c,
        &[
            "HSET",
            &old,
            "url",
            "ws://127.0.0.1:1/v1/ws",
            "role",
            "gateway",
            "layout",
            "packed-v2",
            "beat",
            "1",
        ],
    );
    redis_cmd(
        &c,
        &[
            "ZADD",
            tidemark_store::keys::NODES,
            "99999999999999",
            "old-build",
        ],
    );
    let (code, out) = upgrade(&c, &m, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(
        out.contains("node old-build is live and does not say which versions it reads"),
        "{out}"
    );
    assert_eq!(version(&c), "2", "nothing written");
    redis_cmd(&c, &["ZREM", tidemark_store::keys::NODES, "old-build"]);

    set_version(&[&m], "1");
    let (code, out) = upgrade(&c, &m, &[]);
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("mailbox instance 0 is of version 1"), "{out}");
    assert_eq!(version(&c), "2", "nothing written");
    set_version(&[&m], "2");

    let (code, out) = upgrade(&c, &m, &[]);
    assert_eq!(code, 0, "with a live gateway of this build: {out}");
    assert_eq!((version(&c), version(&m)), ("3".into(), "3".into()));
    let x = send(p_gw, "x", "six fields");
    assert_eq!(record_fields(&c, x), ["p", "f", "c", "r", "b", "t"]);
    stop(gw);
    let gw = spawn_healthy(&gateway, p_gw).await;
    let y = send(p_gw, "y", "packed");
    assert_eq!(record_fields(&c, y), ["p", "m"]);
    let running = spawn_healthy(&node, p_node).await;
    assert_eq!(bobs_bodies(p_gw, 2).await, ["six fields", "packed"]);
    stop(running);
    stop(gw);
}

/// `up --upgrade` raises its data dir's deployment from version 2 to 3; a plain `up` keeps the
/// version it finds.
#[test]
fn up_upgrade_raises_its_data_dirs_deployment() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // the instances of the running `up` (their ports change at every start)
    let urls = || {
        let t = tidemark_store::topology::Topology::from_file(&data.join("tidemark.toml")).unwrap();
        (t.core[0].clone(), t.mailbox[0].clone())
    };
    let up = support::UpProc::start(&data, &[]);
    let (c, m) = urls();
    assert_eq!(version(&c), "3", "a new data dir");
    set_version(&[&c, &m], "2");
    up.stop();
    let up = support::UpProc::start(&data, &[]);
    let (c, m) = urls();
    assert_eq!((version(&c), version(&m)), ("2".into(), "2".into()));
    up.stop();
    let up = support::UpProc::start(&data, &["--upgrade"]);
    let (c, m) = urls();
    assert_eq!((version(&c), version(&m)), ("3".into(), "3".into()));
    up.stop();
}
