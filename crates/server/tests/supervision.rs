//! Supervision (issue 8, defect 2): a materializer worker that panics is logged, counted in
//! `/metrics`, reported by `/healthz` (503 while its shards have no running owner) and started
//! again; delivery resumes without any further traffic. Real redis-servers, the real service
//! (`run::serve`), real HTTP.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tidemark_redis_proc::RedisProcess;
use tidemark_server::gateway::GatewayOptions;
use tidemark_server::materializer::{ChunkFault, MaterializerOptions};
use tidemark_server::run::{self, ServeOptions};
use tidemark_store::redis::dlog::{LogStore, DEFAULT_DEDUPE_TTL_S};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::Topology;
use tokio_util::sync::CancellationToken;

const SHARDS: u32 = 4;

/// Panics the first `times` times record `offset` of `shard` is about to be materialised.
struct PanicAt {
    shard: u32,
    offset: u64,
    times: u32,
    fired: AtomicU32,
}

impl ChunkFault for PanicAt {
    fn fail(&self, _: u32, _: u64, _: usize, _: u32) -> bool {
        false
    }
    fn panic_before(&self, shard: u32, offset: u64) -> bool {
        shard == self.shard
            && offset == self.offset
            && self.fired.fetch_add(1, Ordering::SeqCst) < self.times
    }
}

fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let status = resp
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = resp
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Routing in a `SHARDS`-shard deployment.
fn route(user: &str) -> tidemark_store::topology::Route {
    let t = tidemark_store::topology::Topology::single(SHARDS, Layout::PackedV2, "", "");
    t.validate().unwrap().route(user)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_worker_is_restarted_and_delivery_resumes() {
    let core = RedisProcess::start().unwrap();
    let mailbox = RedisProcess::start().unwrap();
    let bob = route("bob");
    let fault = Arc::new(PanicAt {
        shard: bob.shard,
        offset: 2,
        times: 3,
        fired: AtomicU32::new(0),
    });
    let cancel = CancellationToken::new();
    let running = run::serve(
        ServeOptions {
            topology: Topology::new(
                SHARDS,
                Layout::PackedV2,
                vec![core.url()],
                vec![mailbox.url()],
            ),
            listen: "127.0.0.1:0".parse().unwrap(),
            gateway: GatewayOptions {
                dev_auth: true,
                ..Default::default()
            },
            materializer: MaterializerOptions {
                block: Duration::from_millis(50),
                fault: Some(fault.clone()),
                ..Default::default()
            },
            owned_shards: None,
            node: None,
        },
        cancel.clone(),
    )
    .await
    .unwrap();
    let addr = running.addr;
    let mut commits = LogStore::connect(&core.url()).await.unwrap();
    let mb = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
        .await
        .unwrap();
    let w = |mut mb: MailboxStore| async move {
        mb.read_watermark(bob.shard)
            .await
            .unwrap()
            .lanes
            .lane(bob.lane)
            .w
    };
    for (i, body) in ["one", "two"].iter().enumerate() {
        let c = commits
            .commit(
                bob.shard,
                "alice",
                &format!("m{i}"),
                &["bob"],
                body,
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap();
        assert_eq!(c.offset, i as u64 + 1);
    }
    // the worker panics on record 2 three times; /healthz says so while it restarts
    let start = Instant::now();
    let mut saw_503 = None;
    while w(mb.clone()).await < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "record 2 not materialised after the panics"
        );
        let (status, body) = http_get(addr, "/healthz");
        if status == 503 && body.contains("panicked") {
            saw_503.get_or_insert(body);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        fault.fired.load(Ordering::SeqCst),
        4,
        "3 panics, then it went through"
    );
    let body = saw_503.expect("/healthz was 503 while the worker restarted");
    assert!(
        body.contains(&format!("shard {}:", bob.shard)),
        "names the shard: {body}"
    );
    // healthy again, and the panics are counted
    let start = Instant::now();
    while http_get(addr, "/healthz").0 != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "/healthz not 200"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, metrics) = http_get(addr, "/metrics");
    let line = metrics
        .lines()
        .find(|l| {
            l.starts_with("tidemark_task_restarts_total")
                && l.contains("task=\"materializer\"")
                && l.contains("reason=\"panic\"")
        })
        .unwrap_or_else(|| panic!("restart counter in /metrics:\n{metrics}"));
    assert!(line.ends_with(" 3"), "{line}");
    // still materialising: a third message goes through the restarted worker
    commits
        .commit(
            bob.shard,
            "alice",
            "m3",
            &["bob"],
            "three",
            1,
            DEFAULT_DEDUPE_TTL_S,
        )
        .await
        .unwrap();
    let start = Instant::now();
    while w(mb.clone()).await < 3 {
        assert!(start.elapsed() < Duration::from_secs(10), "record 3");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let entries: Vec<String> = redis::AsyncCommands::zrange(
        &mut mb.connection(),
        tidemark_store::keys::mailbox(bob.shard, "bob"),
        0,
        -1,
    )
    .await
    .unwrap();
    assert_eq!(entries.len(), 3, "each message once");
    running.shutdown().await.unwrap();
}
