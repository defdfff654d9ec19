//! A leases-mode node (ADR-0030) whose shard is claimed by someone else behind its back: the
//! node must end up materialising the shard it holds the lease for, never leave it stalled.
//! Real redis-servers, the real service (`run::serve` with `--ownership leases`), real HTTP;
//! the other node's actions are done by the test directly on Redis (claim, lease release), so
//! the interleaving is exact.
//!
//! 1. The lease lost and won back in one tick of the lease loop (the interleaving of the
//!    SIGSTOP/SIGCONT phase of `nodes.rs`): the node was paused, its lease expired, another
//!    node won it, claimed the shard (raising the epoch past the node's) and handed it back
//!    before the node's next renewal. The renewal finds the lease gone, the acquire wins it
//!    back at once, and the node's worker — whose shard set looks unchanged — must still be
//!    restarted, so it claims the shard again instead of running on with its old epoch
//!    (fenced, stopped for ever while the node renews the lease).
//! 2. A claim that arrives while the node still holds the lease (a paused former owner whose
//!    worker claimed late): the node's worker is fenced; the lease holder must claim again.
//! 3. The quiet path: a node that holds leases but does not materialise (here core Redis
//!    pauses writes: renewals and GC block) says so in `/healthz` within seconds.
//! 4. The mailbox instance loses every key while the node's lease lapses (ADR-0060): the
//!    node takes the shard again, its worker creates the missing watermarks, and the log is
//!    materialised again.
//! 5. A core instance hangs (SIGSTOP): the shards of the other core instance keep their leases
//!    and are materialised throughout (ADR-0102).
//! 6. Static ownership: a worker restarted after a panic leaves a shard that another owner
//!    claimed meanwhile to that owner (ADR-0105).
//! 7. Two nodes, one of which loses its way to one core instance (a proxy cut): that
//!    instance's shards go to the node that reaches it (ADR-0113).
//! 8. Another process registers the node's id (a replacement started while the node was
//!    paused): the node holds no lease until that process's record is gone (ADR-0114).
//! 9. A worker stuck on a hung mailbox does not hold up the lease loop (ADR-0121).
//! 10. A static owner beside a leases node: every shard has an owner, and the static owner's
//!     shard stays its own until it stops (ADR-0131).
//! 11. Many shards over a slow core Redis: the renewals go as one pipeline on a fixed tick, and
//!     no lease lapses (ADR-0132).

mod gateway_support;

use std::time::{Duration, Instant};

use gateway_support::{redis_at, route, serve_options, SHARDS};
use tidemark_redis_proc::RedisProcess;
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::MaterializerOptions;
use tidemark_server::ownership::{NodeOptions, Role};
use tidemark_server::run::{self, Running};
use tidemark_store::redis::dlog::{LogStore, DEFAULT_DEDUPE_TTL_S};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::Route;
use tokio_util::sync::{CancellationToken, DropGuard};

const NODE: &str = "a";
const TTL: Duration = Duration::from_secs(1);
/// Bound of every wait for the node to recover (many lease ticks of `TTL / 3`).
const RECOVER: Duration = Duration::from_secs(15);

/// One leases-mode node over a core and a mailbox redis-server.
struct Node {
    _stop: DropGuard,
    running: Option<Running>,
    core_url: String,
    commits: LogStore,
    mailbox: MailboxStore,
    n: u32,
    _core: RedisProcess,
    mailbox_redis: RedisProcess,
}

impl Node {
    async fn start() -> Node {
        Node::start_with(|_| {}).await
    }

    /// [`Node::start`] with materializer options changed by `f`.
    async fn start_with(f: impl FnOnce(&mut MaterializerOptions)) -> Node {
        let core = RedisProcess::start().expect("core redis-server");
        let mailbox = RedisProcess::start().expect("mailbox redis-server");
        let (core_url, mailbox_url) = (core.url(), mailbox.url());
        let mut materializer = MaterializerOptions {
            block: Duration::from_millis(50),
            ..Default::default()
        };
        f(&mut materializer);
        let mut opts = serve_options(
            core_url.clone(),
            mailbox_url.clone(),
            GatewayOptions {
                dev_auth: true,
                ..Default::default()
            },
            materializer,
        );
        opts.node = Some(NodeOptions {
            id: NODE.into(),
            advertise: "ws://127.0.0.1:1/v1/ws".into(),
            role: Role::All,
            lease_ttl: TTL,
            leases: true,
        });
        let cancel = CancellationToken::new();
        let running = run::serve(opts, cancel.clone()).await.expect("serve");
        let commits = LogStore::connect(&core_url).await.unwrap();
        let store = MailboxStore::connect(&mailbox_url, Layout::PackedV2)
            .await
            .unwrap();
        let mut node = Node {
            _stop: cancel.drop_guard(),
            running: Some(running),
            core_url,
            commits,
            mailbox: store,
            n: 0,
            _core: core,
            mailbox_redis: mailbox,
        };
        // the only node: it takes every lease, and its worker materialises
        let start = Instant::now();
        for s in 0..SHARDS {
            while node.commits.lease_holder(s).await.unwrap().map(|h| h.0) != Some(NODE.into()) {
                assert!(start.elapsed() < RECOVER, "shard {s}: lease not taken");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        node.until_healthy().await;
        node
    }

    /// Commits a message from alice to `to`; its offset.
    async fn send(&mut self, to: &Route, who: &str) -> u64 {
        self.n += 1;
        let c = self
            .commits
            .commit(
                to.shard,
                "alice",
                &format!("m{}", self.n),
                &[who],
                &format!("body {}", self.n),
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap();
        c.offset
    }

    /// Waits until `to`'s lane has materialised `offset`; panics after `RECOVER`, saying
    /// what `/healthz` says.
    async fn until_materialized(&mut self, to: &Route, offset: u64, what: &str) {
        let start = Instant::now();
        loop {
            let wm = self.mailbox.read_watermark(to.shard).await.unwrap();
            if wm.lanes.lane(to.lane).w >= offset {
                return;
            }
            if start.elapsed() > RECOVER {
                let (status, body) = self.healthz().await;
                panic!(
                    "{what}: offset {offset} of shard {} not materialised after {RECOVER:?} \
                     (W {}, epoch {}); /healthz {status}: {body}",
                    to.shard,
                    wm.lanes.lane(to.lane).w,
                    wm.epoch
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Deletes the node's lease of `shard` behind its back (it must have held it).
    async fn drop_lease(&self, shard: u32) {
        let mut core = redis_at(&self.core_url).await;
        let deleted: i64 = redis::cmd("DEL")
            .arg(tidemark_store::keys::lease(shard))
            .query_async(&mut core)
            .await
            .unwrap();
        assert_eq!(deleted, 1, "the node held the lease");
    }

    async fn healthz(&self) -> (u16, String) {
        let addr = self.running.as_ref().unwrap().addr;
        gateway_support::http_at(addr, "GET", "/healthz", &[], None).await
    }

    async fn until_healthy(&self) {
        let start = Instant::now();
        loop {
            let (status, body) = self.healthz().await;
            if status == 200 {
                return;
            }
            assert!(
                start.elapsed() < RECOVER,
                "/healthz not 200 after {RECOVER:?}: {status} {body}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(mut self) {
        let running = self.running.take().unwrap();
        tokio::time::timeout(Duration::from_secs(10), running.shutdown())
            .await
            .expect("node did not stop in time")
            .expect("node stopped with an error");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_lost_and_won_back_in_one_tick_restarts_the_worker() {
    let mut node = Node::start().await;
    let bob = route("bob");
    let o = node.send(&bob, "bob").await;
    node.until_materialized(&bob, o, "before").await;

    // The node was paused: its lease expired, another node won it and claimed the shard (the
    // epoch is now above the node's), then handed it back (released the lease) — all before
    // the node's next renewal, which finds the lease free and wins it back in the same tick.
    let theirs = node.mailbox.clone().claim(bob.shard).await.unwrap();
    node.drop_lease(bob.shard).await;

    let o = node.send(&bob, "bob").await;
    node.until_materialized(&bob, o, "after the lease came back")
        .await;
    let wm = node.mailbox.read_watermark(bob.shard).await.unwrap();
    assert!(
        wm.epoch > theirs,
        "the node claimed the shard again (epoch {} > {theirs})",
        wm.epoch
    );
    node.until_healthy().await;
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_claim_while_the_lease_is_held_is_claimed_back() {
    let mut node = Node::start().await;
    let bob = route("bob");
    let o = node.send(&bob, "bob").await;
    node.until_materialized(&bob, o, "before").await;

    // A former owner, paused while its worker was claiming, resumes: its claim raises the
    // epoch although the node holds the lease. The node's worker is fenced at its next write.
    let theirs = node.mailbox.clone().claim(bob.shard).await.unwrap();
    let o = node.send(&bob, "bob").await;
    node.until_materialized(&bob, o, "after the late claim")
        .await;
    let wm = node.mailbox.read_watermark(bob.shard).await.unwrap();
    assert!(
        wm.epoch > theirs,
        "the lease holder claimed the shard back (epoch {} > {theirs})",
        wm.epoch
    );
    node.until_healthy().await;
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_shard_not_materialized_is_reported_within_seconds() {
    let mut node = Node::start().await;
    let bob = route("bob");
    let o = node.send(&bob, "bob").await;
    node.until_materialized(&bob, o, "before").await;

    // Core Redis refuses writes for a while (reads go on): the lease loop cannot beat or
    // renew, the gates close, nothing is materialised, and no shard reports an error of its
    // own. /healthz must say so long before the pause ends.
    let pause = Duration::from_secs(12);
    let mut core = redis_at(&node.core_url).await;
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(pause.as_millis() as u64)
        .arg("WRITE")
        .query_async(&mut core)
        .await
        .unwrap();
    let paused = Instant::now();
    let body = loop {
        let (status, body) = node.healthz().await;
        if status == 503 && body.contains("not materialized") {
            break body;
        }
        assert!(
            paused.elapsed() < pause - Duration::from_secs(1),
            "/healthz did not report the leased shards not materialised: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!("reported after {:?}: {body}", paused.elapsed());
    assert!(
        body.contains(&format!("shard {}:", bob.shard)),
        "names the shard: {body}"
    );
    // and once core Redis takes writes again, the node recovers by itself
    node.until_healthy().await;
    let o = node.send(&bob, "bob").await;
    node.until_materialized(&bob, o, "after the pause").await;
    node.stop().await;
}

/// The mailbox instance loses everything (a promoted replica that never had the keys, a
/// Redis restarted empty) while the node's lease lapses (here deleted, as a core failover may
/// lose it), and no message comes after. The node wins the lease back, and its worker is
/// restarted with every shard's watermark missing. Before ADR-0060 the claim check refused
/// the shard every 30 s, and the worker's start failed on the first shard without a
/// watermark, was restarted into the same error, for ever (ADR-0058's re-creation runs only
/// in a worker that owns the shard). Now the worker owns such a shard unclaimed and creates
/// its watermark as a start does once it has stayed missing for `WATERMARK_LOST_AFTER`, then
/// claims it and re-materialises the log (not trimmed here: W must be confirmed on a
/// replica, and there is none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watermarks_lost_with_the_lease_are_created_again_by_the_worker() {
    let mut node = Node::start_with(|m| {
        m.mailbox_wait = tidemark_store::redis::dlog::WaitPolicy {
            replicas: Some(1),
            timeout: Duration::from_millis(200),
        };
    })
    .await;
    let bob = route("bob");
    let mut offsets = Vec::new();
    for _ in 0..3 {
        offsets.push(node.send(&bob, "bob").await);
    }
    let last = *offsets.last().unwrap();
    node.until_materialized(&bob, last, "before").await;

    let mut mailbox = redis_at(&node.mailbox_redis.url()).await;
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut mailbox)
        .await
        .unwrap();
    node.drop_lease(bob.shard).await;

    // WATERMARK_LOST_AFTER (10 s), then a claim and a worker start
    let deadline = Instant::now() + Duration::from_secs(10) + RECOVER;
    loop {
        let got = node
            .mailbox
            .read_watermark_and_mailbox(bob.shard, "bob", 0, 10)
            .await;
        if let Ok((wm, entries)) = &got {
            let seqs: Vec<u64> = entries.iter().map(|e| e.0).collect();
            if wm.lanes.lane(bob.lane).w >= last && seqs == offsets {
                break;
            }
        }
        if Instant::now() > deadline {
            let (status, body) = node.healthz().await;
            panic!("bob's entries not back: {got:?}; /healthz {status}: {body}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    node.until_healthy().await;
    node.stop().await;
}

/// ADR-0102: a core instance that hangs (SIGSTOP: connections stay open, nothing answers) does
/// not hold the lease loop. The shards of the other core instance keep their leases and are
/// materialised throughout. Before, the renewal on the hung instance waited for the client's
/// response timeout (30 s): every lease on the healthy instance lapsed at its deadline, and its
/// shards stopped until the hung one answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_core_instance_does_not_stop_the_shards_of_the_others() {
    use tidemark_store::topology::Topology;
    let cores = [
        RedisProcess::start().expect("core redis-server"),
        RedisProcess::start().expect("core redis-server"),
    ];
    let mailbox = RedisProcess::start().expect("mailbox redis-server");
    let mut opts = serve_options(
        cores[0].url(),
        mailbox.url(),
        GatewayOptions {
            dev_auth: true,
            ..Default::default()
        },
        MaterializerOptions {
            block: Duration::from_millis(50),
            ..Default::default()
        },
    );
    let topology = Topology::new(
        SHARDS,
        Layout::PackedV2,
        vec![cores[0].url(), cores[1].url()],
        vec![mailbox.url()],
    );
    let map = topology.validate().unwrap();
    opts.topology = topology;
    opts.node = Some(NodeOptions {
        id: NODE.into(),
        advertise: "ws://127.0.0.1:1/v1/ws".into(),
        role: Role::All,
        lease_ttl: TTL,
        leases: true,
    });
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let running = run::serve(opts, cancel.clone()).await.expect("serve");
    let mut logs = Vec::new();
    for c in &cores {
        logs.push(LogStore::connect(&c.url()).await.unwrap());
    }
    let start = Instant::now();
    for s in 0..SHARDS {
        let log = &mut logs[map.core_of(s)];
        while log.lease_holder(s).await.unwrap().map(|h| h.0) != Some(NODE.into()) {
            assert!(start.elapsed() < RECOVER, "shard {s}: lease not taken");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // a recipient on core instance 0
    let user = (0..)
        .map(|n| format!("u{n}"))
        .find(|u| map.core_of(route(u).shard) == 0)
        .unwrap();
    let to = route(&user);
    let mut mb = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
        .await
        .unwrap();
    let pid = cores[1].pid().expect("core 1 runs").to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let paused = Instant::now();
    // five lease TTLs with core 1 hung: core 0's shard takes a message every half second
    let mut n = 0;
    while paused.elapsed() < TTL * 5 {
        n += 1;
        let offset = logs[0]
            .commit(
                to.shard,
                "alice",
                &format!("h{n}"),
                &[user.as_str()],
                "while core 1 hangs",
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap()
            .offset;
        let sent = Instant::now();
        loop {
            let wm = mb.read_watermark(to.shard).await.unwrap();
            if wm.lanes.lane(to.lane).w >= offset {
                break;
            }
            assert!(
                sent.elapsed() < TTL * 2,
                "message {n} to core 0's shard {} not materialised within {:?}, {:?} into \
                 core 1's hang",
                to.shard,
                TTL * 2,
                paused.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    signal("-CONT");
    tokio::time::timeout(Duration::from_secs(20), running.shutdown())
        .await
        .expect("node did not stop in time")
        .expect("node stopped with an error");
}

/// Panics the worker each time record `offset` of `shard` is about to be materialised.
struct PanicOn {
    shard: u32,
    offset: u64,
    fired: std::sync::atomic::AtomicU32,
}

impl tidemark_server::materializer::ChunkFault for PanicOn {
    fn fail(&self, _: u32, _: u64, _: usize, _: u32) -> bool {
        false
    }
    fn panic_before(&self, shard: u32, offset: u64) -> bool {
        let hit = shard == self.shard && offset == self.offset;
        if hit {
            self.fired.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        hit
    }
}

/// ADR-0105: a static owner's worker started again after a panic does not take back a shard
/// that another owner claimed while it was down (the documented replacement of a static node:
/// the new process claims, then the old one is stopped). Before, every restart claimed the
/// shard again, fencing the new owner, which as a static owner never claims again: once the
/// old process was stopped, the shard had no owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_static_worker_leaves_a_shard_claimed_by_another_owner() {
    let bob = route("bob");
    // record 2 panics the worker each time it comes to it
    let fault = std::sync::Arc::new(PanicOn {
        shard: bob.shard,
        offset: 2,
        fired: std::sync::atomic::AtomicU32::new(0),
    });
    let materializer = MaterializerOptions {
        block: Duration::from_millis(50),
        fault: Some(fault.clone()),
        ..Default::default()
    };
    let gateway = GatewayOptions {
        dev_auth: true,
        ..Default::default()
    };
    let svc = gateway_support::Service::start(gateway, materializer).await;
    let mut commits = LogStore::connect(&svc.core_url).await.unwrap();
    let mut mb = MailboxStore::connect(&svc.mailbox_url, Layout::PackedV2)
        .await
        .unwrap();
    for i in 1..=2 {
        commits
            .commit(
                bob.shard,
                "alice",
                &format!("m{i}"),
                &["bob"],
                "x",
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap();
    }
    let start = Instant::now();
    while fault.fired.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(20), "no panic");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // another owner (a replacement process) claims the shard while the worker restarts
    let theirs = mb.claim(bob.shard).await.unwrap();
    let fired = fault.fired.load(std::sync::atomic::Ordering::SeqCst);
    // restarts come 100 ms, 200 ms, 400 ms, … apart: three seconds is several of them
    tokio::time::sleep(Duration::from_secs(3)).await;
    let wm = mb.read_watermark(bob.shard).await.unwrap();
    assert_eq!(
        wm.epoch, theirs,
        "the restarted worker claimed the shard back from its new owner"
    );
    assert!(
        fault.fired.load(std::sync::atomic::Ordering::SeqCst) <= fired + 1,
        "the restarted worker went on materialising the shard"
    );
    svc.stop().await;
}

/// A TCP proxy to `upstream` on loopback that the test can cut: open connections are closed
/// and new ones closed as soon as accepted (a node's way to one instance is gone; the
/// instance itself and every other client's way to it are fine).
struct Proxy {
    addr: std::net::SocketAddr,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    conns: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: std::net::SocketAddr) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let conns = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (c, k) = (cut.clone(), conns.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                if c.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                let task = tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                k.lock().unwrap().push(task);
            }
        });
        Proxy {
            addr,
            cut,
            conns,
            accept,
        }
    }

    fn cut(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::SeqCst);
        for t in self.conns.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

/// ADR-0113: two leases-mode nodes over two core instances; node `a` reaches core 1 through a
/// proxy, which is cut. `a` cannot renew, win or write the leases of core 1's shards it was
/// assigned; `b` reaches core 1. Those shards must go to `b` and be materialised again, with
/// nothing else happening (the quiet path). Before, the assignment, made over every live node,
/// still gave them to `a` (it heartbeats on core 0, which it reaches): they had no owner until
/// the proxy came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shards_of_a_core_a_node_cannot_reach_go_to_a_node_that_can() {
    use tidemark_store::topology::Topology;
    const SHARDS_HERE: u32 = 16;
    let cores = [
        RedisProcess::start().expect("core redis-server"),
        RedisProcess::start().expect("core redis-server"),
    ];
    let mailbox = RedisProcess::start().expect("mailbox redis-server");
    let core1: std::net::SocketAddr = cores[1]
        .url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .parse()
        .expect("core 1's address");
    let proxy = Proxy::start(core1).await;
    let topology = |core1_url: String| {
        Topology::new(
            SHARDS_HERE,
            Layout::PackedV2,
            vec![cores[0].url(), core1_url],
            vec![mailbox.url()],
        )
    };
    let map = topology(cores[1].url()).validate().unwrap();
    let ids = ["a".to_string(), "b".to_string()];
    let owner = tidemark_store::assign::balanced(SHARDS_HERE, &ids);
    let moving: Vec<u32> = (0..SHARDS_HERE)
        .filter(|&s| owner[s as usize] == 0 && map.core_of(s) == 1)
        .collect();
    assert!(
        !moving.is_empty(),
        "the test needs shards of core 1 assigned to a"
    );
    let mut nodes = Vec::new();
    for (id, core1_url) in [
        ("a", format!("redis://{}/", proxy.addr)),
        ("b", cores[1].url()),
    ] {
        let mut opts = serve_options(
            cores[0].url(),
            mailbox.url(),
            GatewayOptions {
                dev_auth: true,
                ..Default::default()
            },
            MaterializerOptions {
                block: Duration::from_millis(50),
                ..Default::default()
            },
        );
        opts.topology = topology(core1_url);
        opts.node = Some(NodeOptions {
            id: id.into(),
            advertise: "ws://127.0.0.1:1/v1/ws".into(),
            role: Role::All,
            lease_ttl: TTL,
            leases: true,
        });
        let cancel = CancellationToken::new();
        let running = run::serve(opts, cancel.clone()).await.expect("serve");
        nodes.push((cancel.drop_guard(), running));
    }
    let mut logs = Vec::new();
    for c in &cores {
        logs.push(LogStore::connect(&c.url()).await.unwrap());
    }
    // both nodes up: every shard held by its assigned node
    let start = Instant::now();
    for s in 0..SHARDS_HERE {
        let want = ids[owner[s as usize]].clone();
        let log = &mut logs[map.core_of(s)];
        while log.lease_holder(s).await.unwrap().map(|h| h.0) != Some(want.clone()) {
            assert!(
                start.elapsed() < RECOVER,
                "shard {s}: lease not taken by {want}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    proxy.cut();
    let cut = Instant::now();
    for &s in &moving {
        loop {
            let holder = logs[1].lease_holder(s).await.unwrap().map(|h| h.0);
            if holder.as_deref() == Some("b") {
                break;
            }
            assert!(
                cut.elapsed() < RECOVER,
                "shard {s} of core 1: held by {holder:?} {:?} after a lost its way to core 1",
                cut.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // and materialised by b: a message to a user of one of them reaches the mailbox
    let user = (0..)
        .map(|n| format!("u{n}"))
        .find(|u| map.route(u).shard == moving[0])
        .unwrap();
    let to = map.route(&user);
    let offset = logs[1]
        .commit(
            to.shard,
            "alice",
            "m1",
            &[user.as_str()],
            "after the cut",
            1,
            DEFAULT_DEDUPE_TTL_S,
        )
        .await
        .unwrap()
        .offset;
    let mut mb = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
        .await
        .unwrap();
    let sent = Instant::now();
    while mb
        .read_watermark(to.shard)
        .await
        .unwrap()
        .lanes
        .lane(to.lane)
        .w
        < offset
    {
        assert!(
            sent.elapsed() < RECOVER,
            "shard {} not materialised after a lost its way to core 1",
            to.shard
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (stop, running) in nodes {
        drop(stop);
        tokio::time::timeout(Duration::from_secs(20), running.shutdown())
            .await
            .expect("node did not stop in time")
            .expect("node stopped with an error");
    }
}

/// ADR-0114: while the node runs, another process registers its node id (as a replacement
/// started while the node was paused for longer than its record lives would: the record then
/// carries the other process's incarnation). Leases are keyed by node id, so the node would
/// renew the other's leases as its own, and the two workers would fence each other for ever.
/// The node must give up its leases (it stops renewing them: they expire; it does not
/// release them, they may be the other's) and say why on `/healthz`; once the other record
/// is gone, it takes the shards back by itself. Before, its heartbeat overwrote the record
/// and it kept renewing every lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_id_another_process_registered_holds_no_lease() {
    use tidemark_store::keys;
    let mut node = Node::start().await;
    let mut core = redis_at(&node.core_url).await;
    let record = format!("{}{NODE}", keys::NODE_PREFIX);
    let () = redis::cmd("HSET")
        .arg(&record)
        .arg("incarnation")
        .arg("inc-another-process")
        .query_async(&mut core)
        .await
        .unwrap();
    // the other process keeps its record alive (its own heartbeat, every TTL / 3)
    let keep = {
        let url = node.core_url.clone();
        let record = record.clone();
        tokio::spawn(async move {
            let mut c = redis_at(&url).await;
            loop {
                let _: () = redis::cmd("PEXPIRE")
                    .arg(&record)
                    .arg(TTL.as_millis() as u64)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                tokio::time::sleep(TTL / 3).await;
            }
        })
    };
    let start = Instant::now();
    for s in 0..SHARDS {
        loop {
            let holder = node.commits.lease_holder(s).await.unwrap();
            if holder.is_none() {
                break;
            }
            assert!(
                start.elapsed() < RECOVER,
                "shard {s}: the lease is still renewed ({holder:?}) {:?} after another \
                 process registered node id {NODE}",
                start.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let (status, body) = node.healthz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("node id in use"), "{body}");
    let inc: Option<String> = redis::cmd("HGET")
        .arg(&record)
        .arg("incarnation")
        .query_async(&mut core)
        .await
        .unwrap();
    assert_eq!(
        inc.as_deref(),
        Some("inc-another-process"),
        "the other's record is kept"
    );
    // the other process stops: its record goes; the node registers and takes every shard back
    keep.abort();
    let () = redis::cmd("DEL")
        .arg(&record)
        .query_async(&mut core)
        .await
        .unwrap();
    let back = Instant::now();
    for s in 0..SHARDS {
        while node.commits.lease_holder(s).await.unwrap().map(|h| h.0) != Some(NODE.into()) {
            assert!(back.elapsed() < RECOVER, "shard {s}: lease not taken back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    node.until_healthy().await;
    let to = route("bob");
    let offset = node.send(&to, "bob").await;
    node.until_materialized(&to, offset, "after the id came back")
        .await;
    node.stop().await;
}

/// 9. ADR-0121: one core instance's worker is stuck on a mailbox instance that does not answer
/// (SIGSTOP, a record in flight), and the node's shard set changes (a lease of that core
/// instance lost behind its back), so the lease loop stops that worker. It must not wait for
/// it: the node's other leases (core 1's shards, on a healthy mailbox instance) stay held —
/// their worker is never restarted, so the shard's epoch does not move — and are materialised
/// throughout. Before, the loop joined the worker, whose call waited for the response
/// timeout: nothing was renewed meanwhile and every lease of the node lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stuck_on_a_hung_mailbox_does_not_hold_up_the_lease_loop() {
    use tidemark_store::topology::Topology;
    let cores = [
        RedisProcess::start().expect("core redis-server"),
        RedisProcess::start().expect("core redis-server"),
    ];
    let mailboxes = [
        RedisProcess::start().expect("mailbox redis-server"),
        RedisProcess::start().expect("mailbox redis-server"),
    ];
    let mut opts = serve_options(
        cores[0].url(),
        mailboxes[0].url(),
        GatewayOptions {
            dev_auth: true,
            ..Default::default()
        },
        MaterializerOptions {
            block: Duration::from_millis(50),
            ..Default::default()
        },
    );
    // core i's shards are on mailbox i
    let topology = Topology::new(
        SHARDS,
        Layout::PackedV2,
        vec![cores[0].url(), cores[1].url()],
        vec![mailboxes[0].url(), mailboxes[1].url()],
    );
    let map = topology.validate().unwrap();
    assert!(map
        .all_shards()
        .all(|s| map.core_of(s) == map.mailbox_of(s)));
    opts.topology = topology;
    opts.node = Some(NodeOptions {
        id: NODE.into(),
        advertise: "ws://127.0.0.1:1/v1/ws".into(),
        role: Role::All,
        lease_ttl: TTL,
        leases: true,
    });
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let running = run::serve(opts, cancel.clone()).await.expect("serve");
    let mut logs = Vec::new();
    let mut mbs = Vec::new();
    for (c, m) in cores.iter().zip(&mailboxes) {
        logs.push(LogStore::connect(&c.url()).await.unwrap());
        mbs.push(
            MailboxStore::connect(&m.url(), Layout::PackedV2)
                .await
                .unwrap(),
        );
    }
    let start = Instant::now();
    for s in 0..SHARDS {
        let log = &mut logs[map.core_of(s)];
        while log.lease_holder(s).await.unwrap().map(|h| h.0) != Some(NODE.into()) {
            assert!(start.elapsed() < RECOVER, "shard {s}: lease not taken");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // a recipient on each core instance
    let user = |core: usize| {
        (0..)
            .map(|n| format!("u{n}"))
            .find(|u| map.core_of(route(u).shard) == core)
            .unwrap()
    };
    let users = [user(0), user(1)];
    let mut n = 0;
    let mut send = async |logs: &mut Vec<LogStore>, core: usize| {
        n += 1;
        logs[core]
            .commit(
                route(&users[core]).shard,
                "alice",
                &format!("h{n}"),
                &[users[core].as_str()],
                "body",
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap()
            .offset
    };
    let w = async |mbs: &mut Vec<MailboxStore>, core: usize| {
        let to = route(&users[core]);
        let wm = mbs[core].read_watermark(to.shard).await.unwrap();
        (wm.lanes.lane(to.lane).w, wm.epoch)
    };
    // both workers materialise, and core 1's has claimed its shards for good
    for core in [0, 1] {
        let offset = send(&mut logs, core).await;
        let start = Instant::now();
        while w(&mut mbs, core).await.0 < offset {
            assert!(start.elapsed() < RECOVER, "core {core}: first message");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let epoch = w(&mut mbs, 1).await.1;
    let pid = mailboxes[0].pid().expect("mailbox 0 runs").to_string();
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    // core 0's worker takes this record and waits on the hung instance
    send(&mut logs, 0).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // the node's shard set changes: it loses a lease of core 0 (and cannot win it back: the
    // ownership check of the hung instance times out), so core 0's worker is stopped
    let mut core0 = redis_at(&cores[0].url()).await;
    let deleted: i64 = redis::cmd("DEL")
        .arg(tidemark_store::keys::lease(route(&users[0]).shard))
        .query_async(&mut core0)
        .await
        .unwrap();
    assert_eq!(deleted, 1, "the node held the lease");
    let changed = Instant::now();
    // five lease TTLs: core 1's shard takes a message every half second
    while changed.elapsed() < TTL * 5 {
        let offset = send(&mut logs, 1).await;
        let sent = Instant::now();
        loop {
            let (got, now_epoch) = w(&mut mbs, 1).await;
            assert_eq!(
                now_epoch,
                epoch,
                "core 1's shard was claimed again {:?} after the change: its lease lapsed",
                changed.elapsed()
            );
            if got >= offset {
                break;
            }
            assert!(
                sent.elapsed() < TTL * 2,
                "a message to core 1's shard not materialised within {:?}, {:?} after the \
                 change",
                TTL * 2,
                changed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    signal("-CONT");
    tokio::time::timeout(Duration::from_secs(20), running.shutdown())
        .await
        .expect("node did not stop in time")
        .expect("node stopped with an error");
}

/// Starts `run::serve` for node `id` over `core_url` and `mailbox_url` (`SHARDS` shards):
/// a leases node (`owned: None`) or a static owner of `owned`.
async fn start_node(
    id: &str,
    core_url: &str,
    mailbox_url: &str,
    owned: Option<Vec<u32>>,
) -> (DropGuard, Running) {
    let mut opts = serve_options(
        core_url.to_string(),
        mailbox_url.to_string(),
        GatewayOptions {
            dev_auth: true,
            ..Default::default()
        },
        MaterializerOptions {
            block: Duration::from_millis(50),
            ..Default::default()
        },
    );
    opts.node = Some(NodeOptions {
        id: id.into(),
        advertise: "ws://127.0.0.1:1/v1/ws".into(),
        role: Role::All,
        lease_ttl: TTL,
        leases: owned.is_none(),
    });
    opts.owned_shards = owned;
    let cancel = CancellationToken::new();
    let running = run::serve(opts, cancel.clone()).await.expect("serve");
    (cancel.drop_guard(), running)
}

/// A user of shard `shard` (`SHARDS` shards).
fn user_of(shard: u32) -> String {
    (0..)
        .map(|n| format!("u{n}"))
        .find(|u| route(u).shard == shard)
        .unwrap()
}

/// 10. ADR-0131: a static owner of shard 0 (`--own-shards 0`, as during a migration from
/// static owners to leases) runs beside a leases node on the same core Redis. Every other
/// shard must be materialised by the leases node, shard 0 left to its static owner (its
/// epoch does not move, its lease is not taken); once the static node stops, the leases node
/// takes shard 0 too. Before, the static node's record looked like a leases node's: the
/// balanced assignment gave it about half of the shards, which it never takes, and which the
/// leases node left alone — owned by nobody while the static node ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_owner_beside_a_leases_node_leaves_no_shard_unowned() {
    let core = RedisProcess::start().expect("core redis-server");
    let mailbox = RedisProcess::start().expect("mailbox redis-server");
    let mut log = LogStore::connect(&core.url()).await.unwrap();
    let mut mb = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
        .await
        .unwrap();
    let (stop_s, static_node) = start_node("s", &core.url(), &mailbox.url(), Some(vec![0])).await;
    let start = Instant::now();
    while !log.live_nodes().await.unwrap().iter().any(|n| n.id == "s") {
        assert!(
            start.elapsed() < RECOVER,
            "the static node never registered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let epoch0 = mb.read_watermark(0).await.unwrap().epoch;
    let (_stop_a, leases_node) = start_node("a", &core.url(), &mailbox.url(), None).await;
    let mut n = 0;
    let mut send = async |log: &mut LogStore, shard: u32| {
        n += 1;
        let user = user_of(shard);
        let offset = log
            .commit(
                shard,
                "alice",
                &format!("m{n}"),
                &[user.as_str()],
                "body",
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap()
            .offset;
        (route(&user), offset)
    };
    async fn until_materialized(
        mb: &mut MailboxStore,
        log: &mut LogStore,
        to: &Route,
        offset: u64,
        what: &str,
    ) {
        let start = Instant::now();
        loop {
            let wm = mb.read_watermark(to.shard).await.unwrap();
            if wm.lanes.lane(to.lane).w >= offset {
                return;
            }
            let holder = log.lease_holder(to.shard).await.unwrap();
            assert!(
                start.elapsed() < RECOVER,
                "{what}: shard {} not materialised within {RECOVER:?} (W {}, epoch {}, lease \
                 {holder:?})",
                to.shard,
                wm.lanes.lane(to.lane).w,
                wm.epoch
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for shard in 0..SHARDS {
        let (to, offset) = send(&mut log, shard).await;
        until_materialized(&mut mb, &mut log, &to, offset, "beside the static owner").await;
    }
    // shard 0 stayed its static owner's
    assert_eq!(
        mb.read_watermark(0).await.unwrap().epoch,
        epoch0,
        "shard 0 was claimed away from its static owner"
    );
    assert_eq!(log.lease_holder(0).await.unwrap(), None, "shard 0's lease");
    // the static node stops (its record goes): the leases node takes shard 0 too
    drop(stop_s);
    tokio::time::timeout(Duration::from_secs(20), static_node.shutdown())
        .await
        .expect("static node did not stop in time")
        .expect("static node stopped with an error");
    let (to, offset) = send(&mut log, 0).await;
    until_materialized(
        &mut mb,
        &mut log,
        &to,
        offset,
        "after the static node stopped",
    )
    .await;
    assert_eq!(
        log.lease_holder(0).await.unwrap().map(|h| h.0).as_deref(),
        Some("a")
    );
    tokio::time::timeout(Duration::from_secs(20), leases_node.shutdown())
        .await
        .expect("node did not stop in time")
        .expect("node stopped with an error");
}

/// A TCP proxy to `upstream` on loopback whose replies (upstream to client) are held back
/// by a delay that the test sets (0 at first): a core Redis far away, or slowed by its disk.
/// Only latency is added: bytes read together are forwarded together, and what arrives
/// while earlier bytes wait is not held up further.
struct SlowProxy {
    addr: std::net::SocketAddr,
    delay_ms: std::sync::Arc<std::sync::atomic::AtomicU64>,
    tasks: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl SlowProxy {
    async fn start(upstream: std::net::SocketAddr) -> SlowProxy {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let delay_ms = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let tasks = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (d, t) = (delay_ms.clone(), tasks.clone());
        let accept = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let (mut down_r, mut down_w) = down.into_split();
                let (mut up_r, mut up_w) = up.into_split();
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
                let d = d.clone();
                let requests = tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut down_r, &mut up_w).await;
                });
                let replies = tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    while let Ok(n) = up_r.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        let due = Instant::now() + Duration::from_millis(d.load(Ordering::SeqCst));
                        if tx.send((due, buf[..n].to_vec())).is_err() {
                            break;
                        }
                    }
                });
                let forward = tokio::spawn(async move {
                    while let Some((due, bytes)) = rx.recv().await {
                        tokio::time::sleep_until(due.into()).await;
                        if down_w.write_all(&bytes).await.is_err() {
                            break;
                        }
                    }
                });
                t.lock().unwrap().extend([requests, replies, forward]);
            }
        });
        tasks.lock().unwrap().push(accept);
        SlowProxy {
            addr,
            delay_ms,
            tasks,
        }
    }

    fn set_delay(&self, delay: Duration) {
        self.delay_ms.store(
            delay.as_millis() as u64,
            std::sync::atomic::Ordering::SeqCst,
        );
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        for t in self.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }
}

/// 11. ADR-0132: one leases node with many shards on a core Redis whose every reply comes
/// 120 ms late (far below the lease loop's bound of one call, half a tick: 500 ms with a 3 s
/// TTL). Every lease must stay the node's, and no worker be restarted (a lease lost and won
/// back restarts its worker, which claims the shard: its epoch rises). Before, the lease loop
/// renewed one shard after the other, a round trip each: 48 renewals took about 6 s, twice
/// the TTL, so every lease lapsed between two of its renewals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leases_of_many_shards_are_kept_over_a_slow_core() {
    use tidemark_store::topology::Topology;
    const SHARDS_HERE: u32 = 48;
    const TTL_HERE: Duration = Duration::from_secs(3);
    const DELAY: Duration = Duration::from_millis(120);
    const WATCH: Duration = Duration::from_secs(10);
    let core = RedisProcess::start().expect("core redis-server");
    let mailbox = RedisProcess::start().expect("mailbox redis-server");
    let proxy = SlowProxy::start(core.addr()).await;
    let mut opts = serve_options(
        core.url(),
        mailbox.url(),
        GatewayOptions {
            dev_auth: true,
            ..Default::default()
        },
        MaterializerOptions {
            block: Duration::from_millis(50),
            ..Default::default()
        },
    );
    opts.topology = Topology::new(
        SHARDS_HERE,
        Layout::PackedV2,
        vec![format!("redis://{}/", proxy.addr)],
        vec![mailbox.url()],
    );
    opts.node = Some(NodeOptions {
        id: NODE.into(),
        advertise: "ws://127.0.0.1:1/v1/ws".into(),
        role: Role::All,
        lease_ttl: TTL_HERE,
        leases: true,
    });
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    let running = run::serve(opts, cancel.clone()).await.expect("serve");
    // read directly, not through the proxy
    let mut log = LogStore::connect(&core.url()).await.unwrap();
    let mut mb = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
        .await
        .unwrap();
    let shards: Vec<u32> = (0..SHARDS_HERE).collect();
    let start = Instant::now();
    loop {
        let holders = log.heads_and_holders(&shards).await.unwrap();
        if holders.iter().all(|(_, h)| h.as_deref() == Some(NODE)) {
            break;
        }
        assert!(
            start.elapsed() < RECOVER,
            "not every lease taken: {holders:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // the worker has claimed every shard (raised its epoch past the 1 it was created with)
    let mut epochs = async || {
        let mut out = Vec::new();
        for &s in &shards {
            out.push(mb.read_watermark(s).await.unwrap().epoch);
        }
        out
    };
    let start = Instant::now();
    let before = loop {
        let e = epochs().await;
        let (status, body) =
            gateway_support::http_at(running.addr, "GET", "/healthz", &[], None).await;
        if status == 200 && e.iter().all(|&e| e > 1) {
            break e;
        }
        assert!(
            start.elapsed() < RECOVER,
            "not every shard claimed: epochs {e:?}; /healthz {status}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    proxy.set_delay(DELAY);
    // the delay is in effect
    let mut slow = LogStore::connect(&format!("redis://{}/", proxy.addr))
        .await
        .unwrap();
    let t = Instant::now();
    slow.ping().await.unwrap();
    assert!(t.elapsed() >= DELAY, "the proxy did not delay a reply");
    let slowed = Instant::now();
    while slowed.elapsed() < WATCH {
        let holders = log.heads_and_holders(&shards).await.unwrap();
        for (s, (_, h)) in holders.iter().enumerate() {
            assert_eq!(
                h.as_deref(),
                Some(NODE),
                "shard {s}: its lease lapsed {:?} after core's replies were slowed by {DELAY:?}",
                slowed.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = epochs().await;
    let claimed: Vec<(u32, u64, u64)> = shards
        .iter()
        .zip(before.iter().zip(&after))
        .filter(|(_, (b, a))| b != a)
        .map(|(&s, (&b, &a))| (s, b, a))
        .collect();
    assert!(
        claimed.is_empty(),
        "shards claimed again (shard, epoch before, after): {claimed:?}"
    );
    proxy.set_delay(Duration::ZERO);
    tokio::time::timeout(Duration::from_secs(20), running.shutdown())
        .await
        .expect("node did not stop in time")
        .expect("node stopped with an error");
}
