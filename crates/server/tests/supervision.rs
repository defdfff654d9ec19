//! Supervision (issue 8, defect 2): a materializer worker that panics is logged, counted in
//! `/metrics`, reported by `/healthz` (503 while its shards have no running owner) and started
//! again; delivery resumes without any further traffic. Real redis-servers, the real service
//! (`run::serve`), real HTTP.

mod gateway_support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway_support::{offset_of, route, Service};
use tidemark_server::gateway::{GatewayOptions, SendFault};
use tidemark_server::materializer::{ChunkFault, MaterializerOptions};
use tidemark_store::redis::dlog::{LogStore, DEFAULT_DEDUPE_TTL_S};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

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

/// The `tidemark_task_restarts_total` line of `task` for panics in `metrics` (a `/metrics` body).
fn panic_restarts<'m>(metrics: &'m str, task: &str) -> &'m str {
    let label = format!("task=\"{task}\"");
    metrics
        .lines()
        .find(|l| {
            l.starts_with("tidemark_task_restarts_total")
                && l.contains(&label)
                && l.contains("reason=\"panic\"")
        })
        .unwrap_or_else(|| panic!("restart counter of {task} in /metrics:\n{metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_worker_is_restarted_and_delivery_resumes() {
    let bob = route("bob");
    let fault = Arc::new(PanicAt {
        shard: bob.shard,
        offset: 2,
        times: 3,
        fired: AtomicU32::new(0),
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
    let svc = Service::start(gateway, materializer).await;
    let mut commits = LogStore::connect(&svc.core_url).await.unwrap();
    let mb = MailboxStore::connect(&svc.mailbox_url, Layout::PackedV2)
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
        let (status, body) = svc.get_text("/healthz").await;
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
    while svc.get_text("/healthz").await.0 != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "/healthz not 200"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, metrics) = svc.get_text("/metrics").await;
    let line = panic_restarts(&metrics, "materializer");
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
    svc.stop().await;
}

/// `conn` is closed as an internal error (1011) and one panic of `task` is counted.
async fn closed_by_panic(
    d: &gateway_support::Deployment,
    conn: &mut gateway_support::Ws,
    task: &str,
) {
    assert_eq!(
        conn.closed().await,
        Some(1011),
        "closed as an internal error"
    );
    panic_counted_once(d, task).await;
}

/// `/metrics` counts exactly one panic of `task`.
async fn panic_counted_once(d: &gateway_support::Deployment, task: &str) {
    let (_, metrics) = d.get_text("/metrics").await;
    let line = panic_restarts(&metrics, task);
    assert!(line.ends_with(" 1"), "{line}");
}

/// Panics the commit of send `id` the first `times` times.
#[derive(Debug)]
struct PanicCommit {
    id: &'static str,
    times: u32,
    fired: AtomicU32,
}

impl SendFault for PanicCommit {
    fn panic_commit(&self, _sender: &str, id: &str) -> bool {
        id == self.id && self.fired.fetch_add(1, Ordering::SeqCst) < self.times
    }
}

/// A connection's sends are committed by its reader (ADR-0054). A commit that panics must
/// close that connection (1011) and be counted, not leave it open with nobody reading it; the
/// client reconnects, sends the same id again, and it is committed and delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_whose_commit_panics_closes_its_connection_and_its_resend_goes_through() {
    let fault = Arc::new(PanicCommit {
        id: "c-2",
        times: 1,
        fired: AtomicU32::new(0),
    });
    let f = fault.clone();
    let d = gateway_support::start_with(move |g| g.send_fault = Some(f)).await;
    let (mut alice, mut bob) = d.pair("alice", "bob").await;
    let one = offset_of(&alice.send_ok("c-1", &["bob"], "one").await, "bob");
    bob.expect_message(one, "one").await;
    alice.send_only("c-2", &["bob"], "two").await;
    closed_by_panic(&d, &mut alice, "send_loop").await;
    assert_eq!(fault.fired.load(Ordering::SeqCst), 1);
    // the client reconnects and sends the same id again: committed once, delivered once
    let mut alice = d.ready("alice").await;
    let two = offset_of(&alice.send_ok("c-2", &["bob"], "two").await, "bob");
    assert_eq!(
        two,
        one + 1,
        "nothing was committed by the send that panicked"
    );
    bob.expect_message(two, "two").await;
    let more: Vec<_> = bob
        .quiet_for(Duration::from_millis(300))
        .await
        .into_iter()
        .filter(|f| f["type"] == "deliver")
        .collect();
    assert!(more.is_empty(), "delivered once: {more:?}");
    d.shutdown().await;
}

/// Panics the delivery loop of `user`'s connection once, at its first delivery after `armed`.
#[derive(Debug)]
struct PanicDelivery {
    user: &'static str,
    armed: std::sync::atomic::AtomicBool,
    fired: AtomicU32,
}

impl SendFault for PanicDelivery {
    fn panic_commit(&self, _sender: &str, _id: &str) -> bool {
        false
    }

    fn panic_delivery(&self, user: &str, _seq: u64) -> bool {
        user == self.user
            && self.armed.load(Ordering::SeqCst)
            && self.fired.fetch_add(1, Ordering::SeqCst) == 0
    }
}

/// A connection's delivery loop is a task of its own. If it panics, the connection must be
/// closed (1011) and the panic counted: a connection left open whose reader still answers
/// pings but whose delivery is dead would look healthy and deliver nothing. (The reader
/// learns of it through the connection's one token, ADR-0061.) The client reconnects and
/// gets the entry whose push panicked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_loop_that_panics_closes_its_connection_and_the_entry_comes_on_reconnect() {
    let fault = Arc::new(PanicDelivery {
        user: "bob",
        armed: Default::default(),
        fired: AtomicU32::new(0),
    });
    let f = fault.clone();
    let d = gateway_support::start_with(move |g| g.send_fault = Some(f)).await;
    let (mut alice, mut bob) = d.pair("alice", "bob").await;
    let one = offset_of(&alice.send_ok("d-1", &["bob"], "one").await, "bob");
    bob.expect_message(one, "one").await;
    fault.armed.store(true, Ordering::SeqCst);
    let two = offset_of(&alice.send_ok("d-2", &["bob"], "two").await, "bob");
    closed_by_panic(&d, &mut bob, "delivery_loop").await;
    assert_eq!(fault.fired.load(Ordering::SeqCst), 1);
    // bob acked nothing: both come on the new connection, in order
    let mut bob = d.ready("bob").await;
    bob.expect_message(one, "one").await;
    bob.expect_message(two, "two").await;
    d.shutdown().await;
}

/// Panics a connection task of `user` once armed: the writer before it writes an entry
/// (`write`), or the reader on a `sync` frame (`!write`).
#[derive(Debug)]
struct PanicConnTask {
    user: &'static str,
    write: bool,
    armed: std::sync::atomic::AtomicBool,
    fired: AtomicU32,
}

impl PanicConnTask {
    fn new(user: &'static str, write: bool) -> Arc<PanicConnTask> {
        Arc::new(PanicConnTask {
            user,
            write,
            armed: Default::default(),
            fired: AtomicU32::new(0),
        })
    }

    fn fire(&self, user: &str, write: bool) -> bool {
        user == self.user
            && write == self.write
            && self.armed.load(Ordering::SeqCst)
            && self.fired.fetch_add(1, Ordering::SeqCst) == 0
    }
}

/// A deployment whose bob's writer (`write`) or reader panics once armed: alice and bob
/// connected, entry `one` delivered to bob, then the fault armed.
async fn armed_after_one(
    write: bool,
) -> (
    gateway_support::Deployment,
    Arc<PanicConnTask>,
    gateway_support::Ws,
    gateway_support::Ws,
    u64,
) {
    let fault = PanicConnTask::new("bob", write);
    let f = fault.clone();
    let d = gateway_support::start_with(move |g| g.send_fault = Some(f)).await;
    let (mut alice, mut bob) = d.pair("alice", "bob").await;
    let one = offset_of(&alice.send_ok("a-1", &["bob"], "one").await, "bob");
    bob.expect_message(one, "one").await;
    fault.armed.store(true, Ordering::SeqCst);
    (d, fault, alice, bob, one)
}

impl SendFault for PanicConnTask {
    fn panic_commit(&self, _sender: &str, _id: &str) -> bool {
        false
    }

    fn panic_write(&self, user: &str, _seq: u64) -> bool {
        self.fire(user, true)
    }

    fn panic_sync(&self, user: &str, _after: u64) -> bool {
        self.fire(user, false)
    }
}

/// The writer owns the socket's sink. If it panics, the connection must end and the panic be
/// counted: before, the delivery loop found the queue gone and ended quietly, the reader went
/// on reading, and the client kept an open connection that delivered nothing (until its next
/// `send` or the idle timeout; never, for a client that pings). The close frame cannot be
/// written without the sink: the socket simply closes. bob reconnects and gets the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_panics_ends_its_connection_and_the_entry_comes_on_reconnect() {
    let (d, fault, mut alice, mut bob, one) = armed_after_one(true).await;
    let two = offset_of(&alice.send_ok("w-2", &["bob"], "two").await, "bob");
    // any end: with the sink gone there is no close frame
    let _ = bob.closed().await;
    assert_eq!(fault.fired.load(Ordering::SeqCst), 1);
    panic_counted_once(&d, "writer").await;
    let mut bob = d.ready("bob").await;
    bob.expect_message(one, "one").await;
    bob.expect_message(two, "two").await;
    d.shutdown().await;
}

/// The reader runs inside the connection's own task. If it panics, the connection must close
/// with 1011 and the panic be counted, as for the other tasks of a connection; before, the
/// task unwound, the writer closed with 1000 (normal) and nothing was logged or counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_panics_closes_its_connection_as_an_internal_error() {
    let (d, fault, _alice, mut bob, one) = armed_after_one(false).await;
    bob.send_text(r#"{"type":"sync","after":0}"#).await;
    closed_by_panic(&d, &mut bob, "reader").await;
    assert_eq!(fault.fired.load(Ordering::SeqCst), 1);
    let mut bob = d.ready("bob").await;
    bob.expect_message(one, "one").await;
    d.shutdown().await;
}
