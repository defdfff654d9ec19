//! The materializer against real core and mailbox redis-servers: log order, exactly once,
//! held lanes and convergence, fencing (by the epoch alone), GC by the lowest W while lanes
//! differ, resume after restart, gaps and log discontinuities re-read from W, and the hot
//! path's hand-off to the chunked path.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use redis::AsyncCommands;
use tidemark_protocol::entry::decode_entry;
use tidemark_redis_proc::RedisProcess;
use tidemark_server::health::{HealthBoard, ShardStatus};
use tidemark_server::materializer::{
    ChunkFault, CommitFeed, MaterializerOptions, Worker, FEED_POLL, QUIET_POLLS,
};
use tidemark_store::keys;
use tidemark_store::redis::dlog::{DispatchRecord, LogStore, DEFAULT_DEDUPE_TTL_S};
use tidemark_store::redis::store::{Fence, MailboxStore};
use tidemark_store::redis::watermark::{encode_blob, LaneWatermarks, Layout};
use tidemark_store::topology::Topology;
use tidemark_store::wake::WakeHint;
use tokio_util::sync::CancellationToken;

mod gateway_support;
use gateway_support::until_within;

const SHARDS: u32 = 4;

/// Routing in a `SHARDS`-shard deployment.
fn route(user: &str) -> tidemark_store::topology::Route {
    let t = tidemark_store::topology::Topology::single(SHARDS, Layout::PackedV2, "", "");
    t.validate().unwrap().route(user)
}

struct Env {
    core: RedisProcess,
    mailbox: RedisProcess,
    core_store: LogStore,
    mb_store: MailboxStore,
}

async fn env() -> Env {
    let core = RedisProcess::start().unwrap();
    let mailbox = RedisProcess::start().unwrap();
    let core_store = LogStore::connect(&core.url()).await.unwrap();
    let mut mb_store = MailboxStore::connect(&mailbox.url(), Layout::PackedV2)
        .await
        .unwrap();
    for s in 0..SHARDS {
        mb_store
            .init_watermark(s, Layout::PackedV2, 1, 0, false)
            .await
            .unwrap();
    }
    Env {
        core,
        mailbox,
        core_store,
        mb_store,
    }
}

fn fast_opts() -> MaterializerOptions {
    MaterializerOptions {
        block: Duration::from_millis(50),
        gc_interval: Duration::from_millis(100),
        ..Default::default()
    }
}

/// A running materializer worker.
struct Running {
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    health: Arc<HealthBoard>,
}

impl Running {
    /// Shard `s`'s status on this worker's health board.
    fn status(&self, s: u32) -> Option<ShardStatus> {
        self.health.snapshot().get(&s).map(|h| h.status.clone())
    }

    /// Cancels the worker and waits for it to return.
    async fn stop(self) {
        self.cancel.cancel();
        self.task.await.unwrap();
    }
}

async fn start_worker(e: &Env, opts: MaterializerOptions) -> Running {
    let health = Arc::new(HealthBoard::default());
    let shards: Vec<u32> = (0..SHARDS).collect();
    let map = Topology::new(
        SHARDS,
        Layout::PackedV2,
        vec![e.core.url()],
        vec![e.mailbox.url()],
    )
    .validate()
    .unwrap();
    let w = Worker::start(
        map,
        0,
        vec![e.mb_store.clone()],
        &shards,
        opts,
        health.clone(),
    )
    .await
    .unwrap();
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    let task = tokio::spawn(async move {
        w.run(c).await.unwrap();
    });
    Running {
        cancel,
        task,
        health,
    }
}

/// Commits `to` from `from` per shard; returns offsets by shard.
async fn send(e: &mut Env, from: &str, id: &str, to: &[&str], body: &str) -> BTreeMap<u32, u64> {
    let mut by_shard: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for r in to {
        by_shard.entry(route(r).shard).or_default().push(r);
    }
    let mut out = BTreeMap::new();
    for (s, rs) in by_shard {
        let c = e
            .core_store
            .commit(s, from, id, &rs, body, 1, DEFAULT_DEDUPE_TTL_S)
            .await
            .unwrap();
        out.insert(s, c.offset);
    }
    out
}

async fn mailbox(e: &Env, user: &str) -> Vec<(u64, String)> {
    let mut c = e.mb_store.connection();
    let s = route(user).shard;
    let v: Vec<(Vec<u8>, f64)> = c
        .zrange_withscores(keys::mailbox(s, user), 0, -1)
        .await
        .unwrap();
    v.into_iter()
        .map(|(m, sc)| {
            let en = decode_entry(&m).unwrap();
            assert_eq!(en.seq, sc as u64);
            (en.seq, en.body)
        })
        .collect()
}

async fn wait_until<F, Fut>(what: &str, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    until_within(what, Duration::from_secs(20), f).await
}

/// Writes `lanes` as shard `s`'s packed-v2 watermark blob.
async fn put_lanes(e: &Env, s: u32, lanes: &LaneWatermarks) {
    let blob = encode_blob(Layout::PackedV2, lanes);
    let mut c = e.mb_store.connection();
    let () = c.hset(keys::wm(s), "wm_blob", blob).await.unwrap();
}

async fn min_w(e: &Env, s: u32) -> u64 {
    let mut st = e.mb_store.clone();
    st.read_watermark(s)
        .await
        .unwrap()
        .lanes
        .min_present_w()
        .unwrap()
}

async fn all_caught_up(e: &Env) -> bool {
    let mut core = e.core_store.clone();
    for s in 0..SHARDS {
        if min_w(e, s).await < core.head(s).await.unwrap() {
            return false;
        }
    }
    true
}

fn users(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("user-{i}")).collect()
}

#[tokio::test]
async fn single_and_multi_recipient_exactly_once_in_log_order() {
    let mut e = env().await;
    let w = start_worker(&e, fast_opts()).await;
    let us = users(30);
    let mut expected: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for i in 0..300usize {
        let n = if i % 3 == 0 { 1 + i % 17 } else { 1 };
        let to: Vec<&str> = (0..n)
            .map(|k| us[(i * 7 + k * 3) % us.len()].as_str())
            .collect();
        let mut to = to;
        to.sort();
        to.dedup();
        let offs = send(
            &mut e,
            "sender",
            &format!("m{i}"),
            &to,
            &format!("body {i}"),
        )
        .await;
        for r in &to {
            expected
                .entry(r.to_string())
                .or_default()
                .push(offs[&route(r).shard]);
        }
    }
    wait_until("caught up", || all_caught_up(&e)).await;
    for (u, seqs) in &expected {
        let got: Vec<u64> = mailbox(&e, u).await.into_iter().map(|(s, _)| s).collect();
        assert_eq!(
            &got, seqs,
            "mailbox of {u}: every message once, in log order"
        );
    }
    // uniform again: 19 bytes
    let mut c = e.mb_store.connection();
    for s in 0..SHARDS {
        let b: Vec<u8> = c.hget(keys::wm(s), "wm_blob").await.unwrap();
        assert_eq!(b.len(), 19, "shard {s}");
    }
    w.stop().await;
}

/// Commits like [`send`] and hands each record to `feed` as this process's gateway would
/// (ADR-0049), except the shards in `skip` (a record the feed does not carry).
async fn send_fed(
    e: &mut Env,
    feed: &CommitFeed,
    id: &str,
    to: &[&str],
    skip: &[u32],
) -> BTreeMap<u32, u64> {
    let offs = send(e, "sender", id, to, id).await;
    for (&s, &offset) in &offs {
        if skip.contains(&s) {
            continue;
        }
        let recipients = to
            .iter()
            .filter(|r| route(r).shard == s)
            .map(|r| r.to_string())
            .collect();
        let rec = DispatchRecord {
            offset,
            prev: offset - 1,
            sender: "sender".into(),
            client_id: id.into(),
            recipients,
            body: id.into(),
            sent_at_us: 1,
        };
        if let Some(f) = feed.shard(s) {
            f.offer(rec);
        }
    }
    offs
}

/// Zeroes core Redis's command statistics.
async fn reset_core_stats(e: &Env) {
    let mut c = e.core_store.connection();
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut c)
        .await
        .unwrap();
}

/// `XREAD` calls core Redis has served since [`reset_core_stats`].
async fn xread_calls(e: &Env) -> u64 {
    let mut c = e.core_store.connection();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut c)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_xread:calls="))
        .map(|r| r.split(',').next().unwrap().parse().unwrap())
        .unwrap_or(0)
}

/// ADR-0049: once in feed mode, the worker takes the records handed over and polls the log
/// only every FEED_POLL; a record the feed did not carry (another gateway's commit) is found
/// by a poll with no more traffic, in order, and puts the worker back in log mode, where
/// everything still arrives; with the feed offered again, it returns to feed mode.
#[tokio::test]
async fn handed_over_records_are_not_read_back_and_the_rest_is_found_by_itself() {
    let mut e = env().await;
    let feed = CommitFeed::default();
    // as this process's gateway would say: its commits wait for no replica (ADR-0094)
    feed.set_commit_wait(&e.core.url(), 0);
    let opts = MaterializerOptions {
        feed: Some(feed.clone()),
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    let us = users(8);
    let to = |i: usize| vec![us[i % us.len()].as_str()];
    // log mode first; the feed is tried after a second without a backlog
    tokio::time::sleep(Duration::from_millis(1500)).await;
    reset_core_stats(&e).await;
    let started = Instant::now();
    let mut expected: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for i in 0..200 {
        let offs = send_fed(&mut e, &feed, &format!("f{i}"), &to(i), &[]).await;
        expected
            .entry(to(i)[0].to_string())
            .or_default()
            .extend(offs.values());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    wait_until("caught up", || all_caught_up(&e)).await;
    let secs = started.elapsed().as_secs_f64();
    let calls = xread_calls(&e).await;
    // a poll every FEED_POLL (100 ms) and a few after holes; log mode reads about once per
    // record at this pace (its linger is 2 ms)
    let most = (secs / FEED_POLL.as_secs_f64()) as u64 * 2 + 10;
    assert!(
        calls <= most,
        "{calls} XREADs in {secs:.2} s for 200 records handed over (at most {most})"
    );
    for (u, seqs) in &expected {
        let got: Vec<u64> = mailbox(&e, u).await.into_iter().map(|(s, _)| s).collect();
        assert_eq!(&got, seqs, "mailbox of {u}");
    }

    // a record handed over, one not (committed elsewhere), one handed over after it: then no
    // more traffic; a poll finds the hole and all three arrive in log order
    let u = us[0].as_str();
    let s = route(u).shard;
    let a = send_fed(&mut e, &feed, "h1", &[u], &[]).await[&s];
    let b = send_fed(&mut e, &feed, "h2", &[u], &[s]).await[&s];
    let c = send_fed(&mut e, &feed, "h3", &[u], &[]).await[&s];
    let want: Vec<u64> = expected[u].iter().copied().chain([a, b, c]).collect();
    until_within(
        "the record the feed missed, quietly",
        Duration::from_secs(3),
        || async {
            let got: Vec<u64> = mailbox(&e, u).await.into_iter().map(|(s, _)| s).collect();
            got == want
        },
    )
    .await;
    // log mode now: records not handed over at all still arrive
    let d = send_fed(&mut e, &feed, "h4", &[u], &[s]).await[&s];
    let want: Vec<u64> = want.into_iter().chain([d]).collect();
    until_within("log mode", Duration::from_secs(3), || async {
        let got: Vec<u64> = mailbox(&e, u).await.into_iter().map(|(s, _)| s).collect();
        got == want
    })
    .await;
    w.stop().await;
}

/// ADR-0092: in feed mode under steady load, with records handed over for some shard at
/// every turn, a record the feed does not carry (another gateway's commit) is still found by
/// the periodic poll. Before, a due poll waited for a turn with nothing in hand, so the record
/// waited until everything handed over had been applied. Here 7,200 records are handed over
/// for three shards and the worker takes one record per shard a turn (`batch` 1), so it has
/// records in hand for thousands of turns; the record committed elsewhere, in the fourth
/// shard, must be applied while those are still being applied.
#[tokio::test]
async fn a_record_the_feed_did_not_carry_is_found_under_steady_load() {
    use tidemark_store::redis::dlog::CommitRequest;
    const PER: usize = 2400;
    let e = env().await;
    let feed = CommitFeed::default();
    // as this process's gateway would say: its commits wait for no replica (ADR-0094)
    feed.set_commit_wait(&e.core.url(), 0);
    let opts = MaterializerOptions {
        feed: Some(feed.clone()),
        batch: 1,
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    // the user the feed misses, and three loaders, one in each other shard
    let missed = "missed-user";
    let sm = route(missed).shard;
    let mut loaders: Vec<String> = Vec::new();
    for i in 0.. {
        let u = format!("load-{i}");
        let s = route(&u).shard;
        if s != sm && loaders.iter().all(|l| route(l).shard != s) {
            loaders.push(u);
        }
        if loaders.len() == SHARDS as usize - 1 {
            break;
        }
    }
    // log mode first; the feed is tried after a second without a backlog
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut core = e.core_store.clone();
    for chunk in 0..PER / 100 {
        for u in &loaders {
            let s = route(u).shard;
            let ids: Vec<String> = (0..100).map(|i| format!("{u}-{chunk}-{i}")).collect();
            let to = [u.as_str()];
            let reqs: Vec<CommitRequest> = ids
                .iter()
                .map(|id| CommitRequest {
                    sender: "sender",
                    client_id: id,
                    recipients: &to,
                    body: id,
                    sent_at_us: 1,
                    digest: "d",
                    claim_home: None,
                })
                .collect();
            let got = core
                .commit_group(s, &reqs, DEFAULT_DEDUPE_TTL_S)
                .await
                .unwrap();
            let f = feed.shard(s).expect("the worker takes the shard");
            for (id, c) in ids.iter().zip(got) {
                let c = c.unwrap();
                f.offer(DispatchRecord {
                    offset: c.offset,
                    prev: c.offset - 1,
                    sender: "sender".into(),
                    client_id: id.clone(),
                    recipients: vec![u.clone()],
                    body: id.clone(),
                    sent_at_us: 1,
                });
            }
        }
    }
    let t0 = Instant::now();
    core.commit(sm, "sender", "x", &[missed], "x", 1, DEFAULT_DEDUPE_TTL_S)
        .await
        .unwrap();
    let applied = || async {
        let mut n = 0;
        for u in &loaders {
            n += mailbox(&e, u).await.len();
        }
        n
    };
    let mut found = None;
    while found.is_none() && t0.elapsed() < Duration::from_secs(20) {
        if mailbox(&e, missed).await.len() == 1 {
            found = Some((t0.elapsed(), applied().await));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (after, loaded) = found.expect("the record committed elsewhere was never applied");
    let total = PER * loaders.len();
    assert!(
        loaded < total,
        "the record committed elsewhere was applied only after all {total} records handed \
         over ({after:?} after its commit)"
    );
    until_within("the loaders' records", Duration::from_secs(30), || async {
        applied().await == total
    })
    .await;
    w.stop().await;
}

/// ADR-0068: a worker in feed mode with nothing to do waits on the log instead of polling it
/// every FEED_POLL, so an idle process reads core Redis about once per block time, not ten
/// times a second; a record handed over and one committed elsewhere (never handed over) each
/// end that wait at once, with no more traffic, and after a record the worker polls again
/// (it is still in feed mode, not in log mode, whose reads would also be few).
#[tokio::test]
async fn a_quiet_worker_in_feed_mode_waits_on_the_log_instead_of_polling_it() {
    let mut e = env().await;
    let feed = CommitFeed::default();
    // as this process's gateway would say: its commits wait for no replica (ADR-0094)
    feed.set_commit_wait(&e.core.url(), 0);
    // a long block time: a record held until the wait's end would take 10 s, not < 1 s
    let block = Duration::from_secs(10);
    let opts = MaterializerOptions {
        feed: Some(feed.clone()),
        block,
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    let u = "quiet-user";
    let s = route(u).shard;
    // log mode first; the feed is tried after the first read that ends a second or more
    // after the start and finds no backlog: this record's
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut want = vec![send_fed(&mut e, &feed, "q0", &[u], &[]).await[&s]];
    until_within("the first record", Duration::from_secs(3), || {
        mailbox_is(&e, u, &want)
    })
    .await;
    // feed mode polls after a record: several reads within a second (log mode: one at most)
    let polls = xreads_in(&e, FEED_POLL * 8).await;
    assert!(
        polls >= 4,
        "{polls} XREADs in the 800 ms after a record: not polling"
    );
    // quiet once QUIET_POLLS polls in a row found nothing: sampled until it shows (at most
    // one read per 300 ms), so a slow machine's longer polls do not count against it
    let mut quiet = false;
    for _ in 0..30 {
        if xreads_in(&e, Duration::from_millis(300)).await <= 1 {
            quiet = true;
            break;
        }
    }
    assert!(
        quiet,
        "still polling {QUIET_POLLS} polls after the last record"
    );
    let window = Duration::from_secs(3);
    let calls = xreads_in(&e, window).await;
    // polling: one read per FEED_POLL (30 in the window); waiting: one per block (1)
    assert!(
        calls <= 3,
        "{calls} XREADs in {window:?} of no traffic (at most 3: one per block time)"
    );
    // a record handed over ends the wait at once, and the worker polls again after it
    want.push(send_fed(&mut e, &feed, "q1", &[u], &[]).await[&s]);
    until_within("a record handed over", Duration::from_secs(1), || {
        mailbox_is(&e, u, &want)
    })
    .await;
    let polls = xreads_in(&e, FEED_POLL * 8).await;
    assert!(
        polls >= 4,
        "{polls} XREADs in the 800 ms after a record: not in feed mode"
    );
    // quiet again; a record committed elsewhere (never handed over) ends the wait too
    tokio::time::sleep(FEED_POLL * (QUIET_POLLS + 10)).await;
    want.push(send_fed(&mut e, &feed, "q2", &[u], &[s]).await[&s]);
    until_within(
        "a record committed elsewhere",
        Duration::from_secs(1),
        || mailbox_is(&e, u, &want),
    )
    .await;
    w.stop().await;
}

/// Whether `u`'s mailbox holds exactly the entries `want`, in that order.
async fn mailbox_is(e: &Env, u: &str, want: &[u64]) -> bool {
    let got: Vec<u64> = mailbox(e, u).await.into_iter().map(|(s, _)| s).collect();
    got == want
}

/// `XREAD` calls core Redis serves during the next `d`.
async fn xreads_in(e: &Env, d: Duration) -> u64 {
    reset_core_stats(e).await;
    tokio::time::sleep(d).await;
    xread_calls(e).await
}

/// Counts the lane chunk writes the chunked path makes (fails none).
#[derive(Default)]
struct CountChunks(AtomicU32);

impl ChunkFault for CountChunks {
    fn fail(&self, _shard: u32, _offset: u64, _lane: usize, _attempt: u32) -> bool {
        self.0.fetch_add(1, Ordering::SeqCst);
        false
    }
}

/// ADR-0048: records of up to `hot_recipients` recipients are applied in one call of the hot
/// path, with no lane chunk written; with `hot_recipients: 1`, and for a record of more than
/// `MAX_HOT_RECIPIENTS`, the chunked path writes their chunks.
#[tokio::test]
async fn records_of_a_few_recipients_take_the_hot_path_without_staging() {
    use tidemark_store::redis::store::MAX_HOT_RECIPIENTS;
    let in_shard_0: Vec<String> = (0..2000)
        .map(|i| format!("member-{i}"))
        .filter(|u| route(u).shard == 0)
        .take(MAX_HOT_RECIPIENTS + 1)
        .collect();
    assert_eq!(in_shard_0.len(), MAX_HOT_RECIPIENTS + 1);
    let group: Vec<&str> = in_shard_0.iter().take(5).map(String::as_str).collect();
    let crowd: Vec<&str> = in_shard_0.iter().map(String::as_str).collect();
    for (hot_recipients, sends, staging) in [
        (MAX_HOT_RECIPIENTS, vec![&group[..]; 10], false),
        (1, vec![&group[..]; 10], true),
        (MAX_HOT_RECIPIENTS, vec![&crowd[..]], true),
    ] {
        let mut e = env().await;
        let chunks = Arc::new(CountChunks::default());
        let opts = MaterializerOptions {
            hot_recipients,
            fault: Some(chunks.clone()),
            ..fast_opts()
        };
        let w = start_worker(&e, opts).await;
        let mut seqs = Vec::new();
        for (i, to) in sends.iter().enumerate() {
            let offs = send(&mut e, "sender", &format!("g{i}"), to, "hello").await;
            seqs.push(offs[&0]);
        }
        wait_until("caught up", || all_caught_up(&e)).await;
        let to = sends[0];
        for u in to {
            let got: Vec<u64> = mailbox(&e, u).await.into_iter().map(|(s, _)| s).collect();
            assert_eq!(got, seqs, "{u}'s mailbox (hot_recipients {hot_recipients})");
        }
        let written = chunks.0.load(Ordering::SeqCst);
        assert_eq!(
            written > 0,
            staging,
            "{written} chunks written with hot_recipients {hot_recipients}, {} recipients",
            to.len()
        );
        let mut c = e.mb_store.connection();
        let b: Vec<u8> = c.hget(keys::wm(0), "wm_blob").await.unwrap();
        assert_eq!(b.len(), 19, "uniform again");
        w.stop().await;
    }
}

struct FailLaneOnce {
    lane: usize,
    shard: u32,
    fails: u32,
    seen: AtomicU32,
}

impl ChunkFault for FailLaneOnce {
    fn fail(&self, shard: u32, _offset: u64, lane: usize, attempt: u32) -> bool {
        if shard == self.shard && lane == self.lane && attempt < self.fails {
            self.seen.fetch_add(1, Ordering::SeqCst);
            return true;
        }
        false
    }
}

#[tokio::test]
async fn failed_chunk_holds_only_its_lane_and_converges() {
    let mut e = env().await;
    // two recipients of shard 0 in different lanes
    let us = users(400);
    let in0: Vec<&String> = us.iter().filter(|u| route(u).shard == 0).collect();
    let a = in0[0];
    let b = in0.iter().find(|u| route(u).lane != route(a).lane).unwrap();
    let held_lane = route(a).lane;
    let fault = Arc::new(FailLaneOnce {
        lane: held_lane,
        shard: 0,
        fails: 1_000_000, // until we lift it below
        seen: AtomicU32::new(0),
    });
    // a fault whose failures we can end: wrap in a switch
    struct Switch(Arc<FailLaneOnce>, Arc<std::sync::atomic::AtomicBool>);
    impl ChunkFault for Switch {
        fn fail(&self, s: u32, o: u64, l: usize, at: u32) -> bool {
            self.1.load(Ordering::SeqCst) && self.0.fail(s, o, l, at)
        }
    }
    let on = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let opts = MaterializerOptions {
        fault: Some(Arc::new(Switch(fault.clone(), on.clone()))),
        // chunk faults are injected on the chunked path: records of two or more recipients
        // take it (ADR-0048 would write them in one call)
        hot_recipients: 1,
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    let offs = send(&mut e, "s", "x1", &[a.as_str(), b.as_str()], "both").await;
    let o = offs[&0];
    // b's lane moves, a's lane is held: the blob diverges
    wait_until("b delivered", || async { !mailbox(&e, b).await.is_empty() }).await;
    wait_until("lane of b at o", || async {
        let mut st = e.mb_store.clone();
        let wm = st.read_watermark(0).await.unwrap();
        wm.lanes.lane(route(b).lane).w >= o
    })
    .await;
    let mut st = e.mb_store.clone();
    let wm = st.read_watermark(0).await.unwrap();
    assert_eq!(wm.blob_len, 1216);
    assert!(wm.lanes.lane(held_lane).w < o, "held lane stays below o");
    assert!(mailbox(&e, a).await.is_empty(), "a's chunk never landed");
    // a later single-recipient message to b still flows (chunked path while diverged)
    let offs2 = send(&mut e, "s", "x2", &[b.as_str()], "later").await;
    wait_until("b got later", || async { mailbox(&e, b).await.len() == 2 }).await;
    assert!(fault.seen.load(Ordering::SeqCst) > 0);
    // lift the fault: the retry lands, lanes meet, 19 bytes again
    on.store(false, Ordering::SeqCst);
    wait_until("converged", || async {
        let mut st = e.mb_store.clone();
        let wm = st.read_watermark(0).await.unwrap();
        wm.blob_len == 19 && wm.lanes.min_present_w() == Some(offs2[&0])
    })
    .await;
    assert_eq!(mailbox(&e, a).await, vec![(o, "both".to_string())]);
    w.stop().await;
}

#[tokio::test]
async fn older_owner_is_fenced_and_writes_nothing() {
    let mut e = env().await;
    let w1 = start_worker(&e, fast_opts()).await;
    send(&mut e, "s", "a1", &["zed"], "one").await;
    wait_until("first delivered", || async {
        mailbox(&e, "zed").await.len() == 1
    })
    .await;
    // stop the first owner's reading without letting it know, by starting a second owner
    let w2 = start_worker(&e, fast_opts()).await;
    // first owner is now a zombie with the old epoch; new messages reach it too
    send(&mut e, "s", "a2", &["zed"], "two").await;
    wait_until("second delivered once", || async {
        mailbox(&e, "zed").await.len() == 2
    })
    .await;
    let s = route("zed").shard;
    wait_until("zombie fenced", || async {
        matches!(w1.status(s), Some(ShardStatus::Fenced { .. }))
    })
    .await;
    assert_eq!(
        mailbox(&e, "zed")
            .await
            .into_iter()
            .map(|(_, b)| b)
            .collect::<Vec<_>>(),
        vec!["one", "two"]
    );
    w1.stop().await;
    w2.stop().await;
}

/// Issue 11, item 2: the fence alone stops a stale owner. The owner keeps running while its
/// shards are fenced (`tidemark shard fence`: the epoch raised, nobody else materialising), so
/// every write it then tries passes the W check (its record's prev is W): the hot path (one
/// recipient) and the chunked path (two recipients) both stop the shard as `Fenced` and write
/// nothing: no mailbox entry, no staging, W unchanged.
#[tokio::test]
async fn a_fenced_owner_writes_nothing_although_its_w_check_would_pass() {
    let mut e = env().await;
    let w = start_worker(&e, fast_opts()).await;
    let hot = users_in_distinct_lanes(0, 1);
    let pair = users_in_distinct_lanes(1, 2);
    send(&mut e, "s", "warm-0", &[hot[0].as_str()], "before").await;
    send(&mut e, "s", "warm-1", &[pair[0].as_str()], "before").await;
    wait_until("first records materialised", || async {
        min_w(&e, 0).await == 1 && min_w(&e, 1).await == 1
    })
    .await;
    let epoch = w.health.snapshot()[&0].epoch;
    let mut fencer = e.mb_store.clone();
    let new0 = fencer.claim(0).await.unwrap();
    let new1 = fencer.claim(1).await.unwrap();
    assert_eq!((new0, new1), (epoch + 1, epoch + 1));
    send(&mut e, "s", "late-0", &[hot[0].as_str()], "after").await;
    send(
        &mut e,
        "s",
        "late-1",
        &[pair[0].as_str(), pair[1].as_str()],
        "after",
    )
    .await;
    wait_until("both shards fenced", || async {
        let snap = w.health.snapshot();
        snap[&0].status
            == ShardStatus::Fenced {
                current_epoch: Some(new0),
            }
            && snap[&1].status
                == ShardStatus::Fenced {
                    current_epoch: Some(new1),
                }
    })
    .await;
    // a few more loop turns: still nothing written
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!((min_w(&e, 0).await, min_w(&e, 1).await), (1, 1));
    assert_eq!(
        mailbox(&e, &hot[0]).await.len(),
        1,
        "no entry after the fence"
    );
    assert_eq!(
        mailbox(&e, &pair[0]).await.len(),
        1,
        "no entry after the fence"
    );
    assert!(
        mailbox(&e, &pair[1]).await.is_empty(),
        "no entry after the fence"
    );
    let mut c = e.mb_store.connection();
    let staged: u64 = c.zcard(keys::staging_index(1)).await.unwrap();
    assert_eq!(staged, 0, "no lane chunk staged after the fence");
    assert!(w
        .health
        .problems(Duration::from_secs(3600))
        .iter()
        .any(|p| p.starts_with("shard 0: Fenced")));
    w.stop().await;
}

#[tokio::test]
async fn gc_trims_only_at_or_below_lowest_w_and_restart_resumes() {
    let mut e = env().await;
    let w = start_worker(&e, fast_opts()).await;
    let us = users(20);
    for i in 0..100 {
        let to = [us[i % 20].as_str(), us[(i + 5) % 20].as_str()];
        send(&mut e, "s", &format!("g{i}"), &to, "x").await;
    }
    wait_until("caught up", || all_caught_up(&e)).await;
    // GC: staging and core log at or below W are gone
    wait_until("gc done", || async {
        let mut core = e.core_store.clone();
        let mut c = e.mb_store.connection();
        let mut ok = true;
        for s in 0..SHARDS {
            let n: u64 = c.zcard(keys::staging_index(s)).await.unwrap();
            ok &= n == 0 && core.log_len(s).await.unwrap() == 0;
        }
        ok
    })
    .await;
    w.stop().await;
    // while stopped, more messages are committed; a new owner resumes from W
    for i in 100..150 {
        send(&mut e, "s", &format!("g{i}"), &[us[i % 20].as_str()], "y").await;
    }
    let mut core = e.core_store.clone();
    let lens: u64 = {
        let mut t = 0;
        for s in 0..SHARDS {
            t += core.log_len(s).await.unwrap();
        }
        t
    };
    assert_eq!(lens, 50, "records above W are kept");
    let w = start_worker(&e, fast_opts()).await;
    wait_until("caught up after restart", || all_caught_up(&e)).await;
    let mut total = 0;
    for u in &us {
        let m = mailbox(&e, u).await;
        let seqs: Vec<u64> = m.iter().map(|x| x.0).collect();
        let mut sorted = seqs.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(seqs, sorted, "in order, no duplicates");
        total += m.len();
    }
    assert_eq!(total, 100 * 2 + 50);
    w.stop().await;
}

/// Fails every chunk of one lane while `on`.
struct HoldLane {
    shard: u32,
    lane: usize,
    on: std::sync::atomic::AtomicBool,
}

impl ChunkFault for HoldLane {
    fn fail(&self, shard: u32, _offset: u64, lane: usize, _attempt: u32) -> bool {
        shard == self.shard && lane == self.lane && self.on.load(Ordering::SeqCst)
    }
}

/// Issue 11, item 4: GC while the lanes of a shard differ goes by the *lowest* W. One lane is
/// held at 0 by failing chunks while the others reach 2; GC runs many times meanwhile (it
/// collects another shard): the held lane's records stay in the core log and in staging. A
/// new owner (the first stopped while the lane is held, the fault gone) re-reads them from the
/// log and delivers them. GC by the highest W would drop the staging and trim records 1 and 2
/// from the log: the new owner would find a discontinuity and never deliver.
#[tokio::test]
async fn gc_while_lanes_differ_keeps_what_the_lowest_lane_needs() {
    let mut e = env().await;
    let us = users_in_distinct_lanes(0, 2);
    let (held_user, other) = (us[0].as_str(), us[1].as_str());
    let fault = Arc::new(HoldLane {
        shard: 0,
        lane: route(held_user).lane,
        on: true.into(),
    });
    let opts = MaterializerOptions {
        fault: Some(fault.clone()),
        // chunk faults are injected on the chunked path: records of two or more recipients
        // take it (ADR-0048 would write them in one call)
        hot_recipients: 1,
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    send(&mut e, "s", "g1", &[held_user, other], "held").await;
    send(&mut e, "s", "g2", &[other], "later").await;
    // shard 1 gets a two-recipient record too: its staging is collected, so GC is running
    let pair1 = users_in_distinct_lanes(1, 2);
    send(&mut e, "s", "g3", &[&pair1[0], &pair1[1]], "x").await;
    wait_until("the other lane at 2, shard 1 collected", || async {
        let wm = e.mb_store.clone().read_watermark(0).await.unwrap();
        let mut c = e.mb_store.connection();
        let staged1: u64 = c.zcard(keys::staging_index(1)).await.unwrap();
        let log1 = e.core_store.clone().log_len(1).await.unwrap();
        wm.lanes.lane(route(other).lane).w == 2 && staged1 == 0 && log1 == 0
    })
    .await;
    // many GC intervals (100 ms) while the lanes differ
    tokio::time::sleep(Duration::from_millis(800)).await;
    let wm = e.mb_store.read_watermark(0).await.unwrap();
    assert_eq!(
        (wm.lanes.min_present_w(), wm.lanes.max_present_w()),
        (Some(0), Some(2)),
        "the lanes differ"
    );
    let kept: Vec<u64> = e
        .core_store
        .clone()
        .read_after(0, 0, 10)
        .await
        .unwrap()
        .iter()
        .map(|r| r.offset)
        .collect();
    assert_eq!(kept, vec![1, 2], "the held lane's records stay in the log");
    let mut c = e.mb_store.connection();
    let staged: Vec<u64> = c.zrange(keys::staging_index(0), 0, -1).await.unwrap();
    // (record 2 went through the chunked path too: the watermark was not uniform)
    assert_eq!(
        staged,
        vec![1, 2],
        "staging state above the lowest W is kept"
    );
    let lanes_done: Vec<String> = c.hkeys(keys::staging(0, 1)).await.unwrap();
    assert_eq!(
        lanes_done,
        vec![route(other).lane.to_string()],
        "with the other lane's chunk marked durable"
    );
    assert!(mailbox(&e, held_user).await.is_empty());
    // the owner goes away while the lane is held; a new one (no fault) delivers from the log
    w.stop().await;
    let w = start_worker(&e, fast_opts()).await;
    wait_until("the held lane catches up", || async {
        min_w(&e, 0).await == 2
    })
    .await;
    assert_eq!(mailbox(&e, held_user).await, vec![(1, "held".to_string())]);
    assert_eq!(
        mailbox(&e, other).await,
        vec![(1, "held".to_string()), (2, "later".to_string())]
    );
    // and now GC may take everything
    wait_until("collected once every lane passed", || async {
        let staged: u64 = e
            .mb_store
            .connection()
            .zcard(keys::staging_index(0))
            .await
            .unwrap();
        staged == 0 && e.core_store.clone().log_len(0).await.unwrap() == 0
    })
    .await;
    w.stop().await;
}

/// `n` user ids of shard `s`, each in a different lane.
fn users_in_distinct_lanes(s: u32, n: usize) -> Vec<String> {
    let mut lanes = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for i in 0.. {
        let u = format!("lane-user-{i}");
        let r = route(&u);
        if r.shard == s && lanes.insert(r.lane) {
            out.push(u);
            if out.len() == n {
                break;
            }
        }
    }
    out
}

/// Issue 8, defect 5: a record with recipients in an empty lane (a valid 1216-byte packed-v2
/// blob with one lane of 19 zero bytes) is never dropped. No lane takes it (so GC cannot trim
/// it), the shard reports it, and once the lane is initialised the owner resumes by itself.
#[tokio::test]
async fn a_record_for_an_empty_lane_is_held_never_dropped() {
    use tidemark_store::redis::watermark::LaneRecord;
    let mut e = env().await;
    let s = 0;
    let us = users_in_distinct_lanes(s, 2);
    let (empty_user, other) = (us[0].as_str(), us[1].as_str());
    let empty_lane = route(empty_user).lane;
    let other_lane = route(other).lane;
    let mut lanes = LaneWatermarks::uniform(LaneRecord::at(0, 0));
    lanes.0[empty_lane] = LaneRecord::EMPTY;
    put_lanes(&e, s, &lanes).await;
    let w = start_worker(&e, fast_opts()).await;
    // 1: only the present lane; 2: both lanes; 3: only the present lane again
    send(&mut e, "a", "m1", &[other], "one").await;
    send(&mut e, "a", "m2", &[empty_user, other], "two").await;
    send(&mut e, "a", "m3", &[other], "three").await;
    wait_until("record 2 reported as held by the empty lane", || async {
        w.health.snapshot()[&s].status
            == ShardStatus::LaneEmpty {
                lane: empty_lane,
                offset: 2,
            }
    })
    .await;
    // several GC intervals pass: nothing beyond record 1 is taken, nothing is trimmed
    tokio::time::sleep(Duration::from_millis(600)).await;
    let wm = e.mb_store.read_watermark(s).await.unwrap();
    assert_eq!(wm.lanes.lane(other_lane).w, 1, "no lane passes record 2");
    assert_eq!(wm.lanes.max_present_w(), Some(1));
    let kept: Vec<u64> = {
        let mut core = e.core_store.clone();
        core.read_after(s, 0, 10)
            .await
            .unwrap()
            .iter()
            .map(|r| r.offset)
            .collect()
    };
    assert!(
        kept.contains(&2) && kept.contains(&3),
        "records 2 and 3 stay in the log: {kept:?}"
    );
    // (entries of later records may already sit in the mailbox, above W: readers never see
    // them until W passes them)
    let visible: Vec<u64> = mailbox(&e, other)
        .await
        .into_iter()
        .map(|(seq, _)| seq)
        .filter(|&seq| seq <= wm.lanes.lane(other_lane).w)
        .collect();
    assert_eq!(visible, vec![1], "nothing visible after the held record");
    assert!(w
        .health
        .problems(Duration::from_secs(3600))
        .iter()
        .any(|p| p.contains("which is empty")));
    // the operator initialises the lane at the record's prev: the owner resumes by itself
    let mut lanes = e.mb_store.read_watermark(s).await.unwrap().lanes;
    lanes.0[empty_lane] = LaneRecord::at(1, 1);
    put_lanes(&e, s, &lanes).await;
    wait_until("records 2 and 3 materialised", || async {
        min_w(&e, s).await == 3
    })
    .await;
    assert_eq!(mailbox(&e, other).await.len(), 3);
    assert_eq!(mailbox(&e, empty_user).await, vec![(2, "two".to_string())]);
    wait_until("shard running again", || async {
        w.health.snapshot()[&s].status == ShardStatus::Running
    })
    .await;
    w.stop().await;
}

/// Fails every chunk of record `offset` while `on`.
struct HoldRecord {
    offset: u64,
    on: std::sync::atomic::AtomicBool,
}

impl ChunkFault for HoldRecord {
    fn fail(&self, _shard: u32, offset: u64, _lane: usize, _attempt: u32) -> bool {
        offset == self.offset && self.on.load(Ordering::SeqCst)
    }
}

/// Issue 8, defect 6: with a backlog of more than one advance call (256 records), an early
/// call that moves lanes publishes its wake-up hint even when the last call moves nothing.
#[tokio::test]
async fn a_hint_is_published_when_an_early_batch_of_a_backlog_moved() {
    let mut e = env().await;
    let s = 1;
    let every_lane = users_in_distinct_lanes(s, 64);
    let pair: Vec<&str> = every_lane[..2].iter().map(String::as_str).collect();
    let all: Vec<&str> = every_lane.iter().map(String::as_str).collect();
    // A backlog committed before the worker starts: 256 two-recipient records (the first
    // advance call), then record 257 with a recipient in every lane, whose chunks fail (no
    // lane can move in the second call), then three more.
    for i in 0..256 {
        send(&mut e, "a", &format!("b{i}"), &pair, "x").await;
    }
    send(&mut e, "a", "all", &all, "to every lane").await;
    for i in 0..3 {
        send(&mut e, "a", &format!("c{i}"), &pair, "x").await;
    }
    let client = redis::Client::open(e.mailbox.url()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe(keys::wake(s)).await.unwrap();
    let fault = Arc::new(HoldRecord {
        offset: 257,
        on: true.into(),
    });
    let opts = MaterializerOptions {
        fault: Some(fault.clone()),
        // chunk faults are injected on the chunked path: records of two or more recipients
        // take it (ADR-0048 would write them in one call)
        hot_recipients: 1,
        batch: 1000,
        ..fast_opts()
    };
    let worker = start_worker(&e, opts).await;
    // hints are numbered from the claim's, 0 (ADR-0035), which may already name recipients
    let mut hints = pubsub.on_message();
    let mut expect_seq = 0;
    let hint = loop {
        let msg = tokio::time::timeout(Duration::from_secs(5), hints.next())
            .await
            .expect("a wake-up hint while record 257 is held")
            .unwrap();
        let hint = WakeHint::decode(msg.get_payload_bytes()).unwrap();
        assert_eq!(
            hint.seq.map(|q| q.seq),
            Some(expect_seq),
            "numbered in sequence"
        );
        expect_seq += 1;
        if !hint.recipients.is_empty() {
            break hint;
        }
    };
    let (w, named) = (hint.min_w, hint.recipients);
    assert_eq!(w, 256, "the hint carries the lowest W reached");
    assert!(named.iter().any(|n| n == pair[0]));
    assert_eq!(min_w(&e, s).await, 256);
    fault.on.store(false, Ordering::SeqCst);
    wait_until("backlog done", || async { min_w(&e, s).await == 260 }).await;
    assert_eq!(mailbox(&e, pair[0]).await.len(), 260);
    worker.stop().await;
}

/// Issue 8, defect 3: a shard whose log head reached 2^48−1 (commits refused with
/// `log_exhausted`) is reported by the owner's health, hence `/healthz`.
#[tokio::test]
async fn an_exhausted_log_is_reported() {
    let e = env().await;
    let w = start_worker(&e, fast_opts()).await;
    let mut core = e.core_store.connection();
    let _: () = core.set(keys::head(2), (1u64 << 48) - 1).await.unwrap();
    wait_until("log exhausted reported", || async {
        w.health.snapshot()[&2].log_exhausted
            && w.health
                .problems(Duration::from_secs(3600))
                .iter()
                .any(|p| p.starts_with("shard 2: log exhausted"))
    })
    .await;
    assert!(!w.health.snapshot()[&1].log_exhausted);
    w.stop().await;
}

/// Issue 10, item 3: a log that does not continue from W (trimmed above W, or W moved back by
/// a restore) holds only that shard, reported with what the log holds; the other shards keep
/// materialising. Both shapes: a hole (the next record is above W + 1) and an empty log.
#[tokio::test]
async fn a_log_discontinuity_holds_only_its_shard() {
    let mut e = env().await;
    let users_of = |s: u32| users_in_distinct_lanes(s, 1).pop().unwrap();
    let (u0, u1, u2) = (users_of(0), users_of(1), users_of(2));
    for i in 0..5 {
        send(&mut e, "a", &format!("h{i}"), &[&u0], "x").await;
    }
    for i in 0..2 {
        send(&mut e, "a", &format!("e{i}"), &[&u2], "x").await;
    }
    let mut core = e.core_store.connection();
    // shard 0 loses records 1 and 2; shard 2 loses its whole log
    let _: u64 = redis::cmd("XTRIM")
        .arg(keys::dlog(0))
        .arg("MINID")
        .arg("3-0")
        .query_async(&mut core)
        .await
        .unwrap();
    let _: u64 = redis::cmd("XTRIM")
        .arg(keys::dlog(2))
        .arg("MAXLEN")
        .arg(0)
        .query_async(&mut core)
        .await
        .unwrap();
    let w = start_worker(&e, fast_opts()).await;
    wait_until("both shards held", || async {
        let snap = w.health.snapshot();
        snap[&0].status
            == ShardStatus::Discontinuity {
                w: 0,
                next: Some(3),
            }
            && snap[&2].status == ShardStatus::Discontinuity { w: 0, next: None }
    })
    .await;
    // the other shards run: a message to shard 1 is materialised
    send(&mut e, "a", "other", &[&u1], "fine").await;
    wait_until("shard 1 materialises", || async { min_w(&e, 1).await == 1 }).await;
    let problems = w.health.problems(Duration::from_secs(3600));
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("shard 0: log discontinuity: W=0")),
        "{problems:?}"
    );
    assert_eq!(w.health.snapshot()[&1].status, ShardStatus::Running);
    assert_eq!(min_w(&e, 0).await, 0, "nothing materialised past the hole");
    // Issue 11, item 9: the re-check resyncs. The operator accepts the loss (`shard rebase`):
    // W moves to the record before the log's first; within a re-check (5 s) the held shards
    // run again, shard 0 delivers records 3..5 and shard 2 (log empty, W at the head) is idle.
    let mut st = e.mb_store.clone();
    st.rebase_lanes(0, 2).await.unwrap();
    st.rebase_lanes(2, 2).await.unwrap();
    let start = Instant::now();
    wait_until("the held shards resume", || async {
        let snap = w.health.snapshot();
        min_w(&e, 0).await == 5
            && snap[&0].status == ShardStatus::Running
            && snap[&2].status == ShardStatus::Running
    })
    .await;
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "{:?}",
        start.elapsed()
    );
    let seqs: Vec<u64> = mailbox(&e, &u0).await.into_iter().map(|(s, _)| s).collect();
    assert_eq!(seqs, vec![3, 4, 5]);
    w.stop().await;
}

/// Issue 11, item 9: a gap (a record whose prev is above W: W moved back under a running owner,
/// as a mailbox restore does, while the log still holds the records) makes the owner re-read
/// from W, on the hot path (one recipient, `Materialized::Gap`) and on the chunked path (two
/// recipients, `Advance::Gap`). Without the re-read the owner would wait for ever: its read
/// position is past records 2 and 3, and nothing else re-reads them.
#[tokio::test]
async fn a_gap_makes_the_owner_reread_from_w() {
    use tidemark_store::redis::watermark::LaneRecord;
    let mut e = env().await;
    // GC (and its trim of the log) runs once at the start, then not for an hour: the log
    // keeps records 1..3. A record of shard 3 committed first shows when that GC has run.
    let marker = users_in_distinct_lanes(3, 1).pop().unwrap();
    send(&mut e, "s", "marker", &[&marker], "x").await;
    let opts = MaterializerOptions {
        gc_interval: Duration::from_secs(3600),
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    wait_until("the first GC ran", || async {
        w.health.snapshot().get(&3).is_some_and(|h| h.head == 1)
    })
    .await;
    let hot = users_in_distinct_lanes(0, 1).pop().unwrap();
    let pair = users_in_distinct_lanes(1, 2);
    let pair: Vec<&str> = pair.iter().map(String::as_str).collect();
    for i in 1..=3 {
        send(&mut e, "s", &format!("h{i}"), &[&hot], &format!("n{i}")).await;
        send(&mut e, "s", &format!("c{i}"), &pair, &format!("n{i}")).await;
    }
    wait_until("both shards at 3", || async {
        min_w(&e, 0).await == 3 && min_w(&e, 1).await == 3
    })
    .await;
    // the mailbox side moves back to W = 1 (watermark, entries, staging), same epoch
    let mut c = e.mb_store.connection();
    for (s, users) in [(0u32, vec![hot.as_str()]), (1, pair.clone())] {
        let lanes = LaneWatermarks::uniform(LaneRecord::at(1, 0));
        put_lanes(&e, s, &lanes).await;
        for u in users {
            let _: () = c
                .zrembyscore(keys::mailbox(s, u), "(1", "+inf")
                .await
                .unwrap();
        }
        for o in 2..=3 {
            let _: () = c.del(keys::staging(s, o)).await.unwrap();
            let _: () = c.zrem(keys::staging_index(s), o).await.unwrap();
        }
    }
    assert_eq!(mailbox(&e, &hot).await.len(), 1);
    // record 4 of each shard has prev 3 > W = 1: a gap
    send(&mut e, "s", "h4", &[&hot], "n4").await;
    send(&mut e, "s", "c4", &pair, "n4").await;
    wait_until("both shards re-read from W and reach 4", || async {
        min_w(&e, 0).await == 4 && min_w(&e, 1).await == 4
    })
    .await;
    let want: Vec<(u64, String)> = (1..=4).map(|i| (i, format!("n{i}"))).collect();
    assert_eq!(mailbox(&e, &hot).await, want, "hot path");
    for u in &pair {
        assert_eq!(mailbox(&e, u).await, want, "chunked path, {u}");
    }
    w.stop().await;
}

/// Issue 11, item 9: the hot path hands a record it cannot take (`NotUniform`: here the
/// watermark is still packed-v1, which only the chunked path rewrites) to the chunked path,
/// together with every later record of the same batch, in order. Three one-recipient records
/// committed before the owner starts arrive in one read; all are delivered once, in order,
/// the watermark becomes packed-v2 (19 bytes), and the hot path takes the next record.
#[tokio::test]
async fn the_hot_path_hands_a_not_uniform_batch_to_the_chunked_path() {
    let mut e = env().await;
    let s = 0;
    e.mb_store
        .init_watermark(s, Layout::PackedV1, 1, 0, true)
        .await
        .unwrap();
    let us = users_in_distinct_lanes(s, 3);
    for (i, u) in us.iter().enumerate() {
        send(
            &mut e,
            "s",
            &format!("v{i}"),
            &[u.as_str()],
            &format!("n{i}"),
        )
        .await;
    }
    let w = start_worker(&e, fast_opts()).await;
    wait_until("the batch is materialised", || async {
        min_w(&e, s).await == 3
    })
    .await;
    for (i, u) in us.iter().enumerate() {
        assert_eq!(
            mailbox(&e, u).await,
            vec![(i as u64 + 1, format!("n{i}"))],
            "{u}"
        );
    }
    let wm = e.mb_store.read_watermark(s).await.unwrap();
    assert_eq!((wm.layout, wm.blob_len), (Layout::PackedV2, 19));
    send(&mut e, "s", "v3", &[us[0].as_str()], "n3").await;
    wait_until("the next record", || async { min_w(&e, s).await == 4 }).await;
    assert_eq!(mailbox(&e, &us[0]).await.len(), 2);
    w.stop().await;
}

/// ADR-0042: without a backlog, two log reads start at least `read_linger` apart, so live
/// records are read in fewer, larger batches; a backlog (a read that filled its COUNT) is
/// read on at once. Both halves fail without the rule: a linger on every read makes the
/// backlog take about 8 s, and no linger makes one read (or two) per live record.
#[tokio::test]
async fn live_reads_linger_and_a_backlog_is_read_at_once() {
    for linger in [Duration::from_millis(400), Duration::ZERO] {
        let mut e = env().await;
        for i in 0..2000 {
            send(&mut e, "alice", &format!("b{i}"), &["bob"], "backlog").await;
        }
        let opts = MaterializerOptions {
            read_linger: linger,
            batch: 100,
            ..fast_opts()
        };
        let started = Instant::now();
        let w = start_worker(&e, opts).await;
        wait_until("the backlog is drained", || all_caught_up(&e)).await;
        // 20 reads of 100 records: with a linger on each, 20 x 400 ms
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "backlog drained in {:?} (linger {linger:?})",
            started.elapsed()
        );
        let before = gateway_support::command_calls(&e.core.url(), "xread").await;
        for i in 0..20 {
            send(&mut e, "alice", &format!("l{i}"), &["bob"], "live").await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        wait_until("the live records are applied", || all_caught_up(&e)).await;
        let reads = gateway_support::command_calls(&e.core.url(), "xread").await - before;
        if linger.is_zero() {
            assert!(
                reads >= 15,
                "{reads} log reads for 20 live records, no linger"
            );
        } else {
            assert!(
                reads <= 10,
                "{reads} log reads for 20 live records, linger {linger:?}"
            );
        }
        assert_eq!(mailbox(&e, "bob").await.len(), 2020);
        w.stop().await;
    }
}

/// ADR-0042 and ADR-0085, the quiet path of the linger: it spaces a read from the start of
/// the read before it and no more, so once the reads that follow a record are done (the read
/// ahead, a linger after it) the loop waits in a blocking read, and the first record after a
/// quiet spell is taken at once, not a linger later. Seen to fail (1.0 s) with a linger
/// waited after every read that found records.
#[tokio::test]
async fn the_first_record_after_a_quiet_spell_is_not_held_by_the_linger() {
    let mut e = env().await;
    let linger = Duration::from_secs(1);
    let opts = MaterializerOptions {
        read_linger: linger,
        // longer than the linger, as the defaults are (500 ms against 4 ms)
        block: Duration::from_secs(3),
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    send(&mut e, "alice", "q0", &["bob"], "before").await;
    wait_until("the first record", || async {
        mailbox(&e, "bob").await.len() == 1
    })
    .await;
    // quiet: past the read ahead and the linger after it, inside the next blocking read
    tokio::time::sleep(linger * 5 / 2).await;
    let sent = Instant::now();
    send(&mut e, "alice", "q1", &["bob"], "after the quiet spell").await;
    wait_until("the record after the quiet spell", || async {
        mailbox(&e, "bob").await.len() == 2
    })
    .await;
    assert!(
        sent.elapsed() < linger / 2,
        "the record after a quiet spell took {:?} (linger {linger:?})",
        sent.elapsed()
    );
    w.stop().await;
}

/// ADR-0046, the quiet path of a fence: a second owner claims the shards, and no record
/// comes after it. The first owner never applies anything again, so no script answers it
/// `fenced`; its garbage collection sees the newer epoch and stops the shard as `Fenced`
/// by itself, without writing (W stays where it was).
#[tokio::test]
async fn an_owner_fenced_while_no_records_come_learns_it_by_itself() {
    let mut e = env().await;
    let opts = || MaterializerOptions {
        gc_idle_interval: Duration::from_millis(300),
        ..fast_opts()
    };
    let w1 = start_worker(&e, opts()).await;
    send(&mut e, "s", "q1", &["quiet"], "one").await;
    wait_until("first delivered", || async {
        mailbox(&e, "quiet").await.len() == 1
    })
    .await;
    let s = route("quiet").shard;
    let before = min_w(&e, s).await;
    let w2 = start_worker(&e, opts()).await;
    let new_epoch = w2.health.snapshot()[&s].epoch;
    wait_until("the old owner fenced with no traffic", || async {
        matches!(
            w1.status(s),
            Some(ShardStatus::Fenced { current_epoch: Some(ep) }) if ep == new_epoch
        )
    })
    .await;
    assert_eq!(min_w(&e, s).await, before);
    assert_eq!(w2.health.snapshot()[&s].status, ShardStatus::Running);
    w1.stop().await;
    w2.stop().await;
}

/// ADR-0097: a worker (re)started while one of its mailbox instances is down serves the
/// shards of the others at once, and claims the down instance's shards by itself once it is
/// back (no record needs to come). Before, the start failed on the first shard it could not
/// claim: every shard of the core instance waited for the down one, the supervisor
/// restarting the worker into the same error. And a shard owned unclaimed (epoch 0) whose
/// watermark came back was stopped as fenced, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_while_a_mailbox_instance_is_down_claims_its_shards_when_it_is_back() {
    use futures::FutureExt;
    use tidemark_redis_proc::RedisOptions;
    let core = RedisProcess::start().unwrap();
    let a = RedisProcess::start().unwrap();
    let mut b = RedisProcess::start_with(RedisOptions {
        appendonly: true,
        appendfsync: "always".into(),
        ..Default::default()
    })
    .unwrap();
    let map = Topology::new(
        SHARDS,
        Layout::PackedV2,
        vec![core.url()],
        vec![a.url(), b.url()],
    )
    .validate()
    .unwrap();
    let mut stores = Vec::new();
    for url in [a.url(), b.url()] {
        stores.push(MailboxStore::connect(&url, Layout::PackedV2).await.unwrap());
    }
    for s in 0..SHARDS {
        stores[map.mailbox_of(s)]
            .init_watermark(s, Layout::PackedV2, 1, 0, false)
            .await
            .unwrap();
    }
    // a recipient on each mailbox instance
    let on = |i: usize| {
        (0..)
            .map(|n| format!("user-{n}"))
            .find(|u| map.mailbox_of(route(u).shard) == i)
            .unwrap()
    };
    let (ua, ub) = (on(0), on(1));
    let commits = LogStore::connect(&core.url()).await.unwrap();
    let commit = |id: &'static str, to: String| {
        let mut c = commits.clone();
        async move {
            c.commit(
                route(&to).shard,
                "s",
                id,
                &[to.as_str()],
                id,
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap()
        }
    };
    commit("to-a", ua.clone()).await;
    commit("to-b", ub.clone()).await;
    let entries = |i: usize, user: String| {
        let mut c = stores[i].connection();
        async move {
            let v: Vec<Vec<u8>> = c
                .zrange(keys::mailbox(route(&user).shard, &user), 0, -1)
                .await
                .unwrap_or_default();
            v.len()
        }
    };

    b.kill();
    let health = Arc::new(HealthBoard::default());
    let shards: Vec<u32> = (0..SHARDS).collect();
    let w = Worker::start(
        map.clone(),
        0,
        stores.clone(),
        &shards,
        fast_opts(),
        health.clone(),
    )
    .await
    .expect("the worker starts with a mailbox instance down");
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    let task = tokio::spawn(async move { w.run(c).await.unwrap() });
    wait_until("the up instance's shard served", || {
        entries(0, ua.clone()).map(|n| n == 1)
    })
    .await;

    b.restart().unwrap();
    let sb = route(&ub).shard;
    wait_until(
        "the down instance's shard claimed and served once it is back",
        || entries(1, ub.clone()).map(|n| n == 1),
    )
    .await;
    let h = health.snapshot()[&sb].clone();
    assert_eq!(h.status, ShardStatus::Running, "{h:?}");
    assert_eq!(h.epoch, 2, "claimed over the epoch it had (1): {h:?}");
    // and it goes on: a record committed now is applied too
    commit("to-b-2", ub.clone()).await;
    wait_until("a later record on the shard", || {
        entries(1, ub.clone()).map(|n| n == 2)
    })
    .await;
    assert_eq!(health.snapshot()[&sb].status, ShardStatus::Running);
    cancel.cancel();
    task.await.unwrap();
}

/// ADR-0100: a watermark that went back in its owner's epoch (a promoted mailbox replica that
/// had the claim but not the last moves) is re-fenced, and a hint in the new epoch is published
/// at once, with no record to come: gateways let their hinted W go back only on a new epoch.
/// The lost entries are re-materialised from the log. Before, the epoch stayed, and the hint
/// came (in the old epoch) only once a step moved W again.
#[tokio::test]
async fn a_watermark_gone_back_in_its_epoch_is_re_fenced_and_hinted_at_once() {
    use tidemark_store::redis::watermark::LaneRecord;
    let mut e = env().await;
    let u = "regressed";
    let s = route(u).shard;
    let opts = MaterializerOptions {
        // W is never confirmed on a replica (there is none): the log keeps every record, as
        // it keeps those above the W a promoted replica has
        mailbox_wait: tidemark_store::redis::dlog::WaitPolicy {
            replicas: Some(1),
            timeout: Duration::from_millis(20),
        },
        // a quiet shard's GC, which finds W gone back, every 300 ms
        gc_idle_interval: Duration::from_millis(300),
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    for i in 1..=3 {
        send(&mut e, "a", &format!("r{i}"), &[u], &format!("n{i}")).await;
    }
    wait_until("three delivered", || async {
        mailbox(&e, u).await.len() == 3
    })
    .await;
    let epoch = w.health.snapshot()[&s].epoch;
    let client = redis::Client::open(e.mailbox.url()).unwrap();
    let mut pubsub = client.get_async_pubsub().await.unwrap();
    pubsub.subscribe(keys::wake(s)).await.unwrap();
    // the mailbox side back at W = 1 in the same epoch, entries 2 and 3 gone
    put_lanes(&e, s, &LaneWatermarks::uniform(LaneRecord::at(1, 0))).await;
    let mut c = e.mb_store.connection();
    let _: () = c
        .zrembyscore(keys::mailbox(s, u), "(1", "+inf")
        .await
        .unwrap();
    let mut hints = pubsub.on_message();
    let hint = loop {
        let msg = tokio::time::timeout(Duration::from_secs(5), hints.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "no hint in a new epoch after the regression: {:?}",
                    w.health.snapshot()[&s]
                )
            })
            .unwrap();
        let hint = WakeHint::decode(msg.get_payload_bytes()).unwrap();
        if hint.seq.is_some_and(|q| q.epoch != epoch) {
            break hint;
        }
    };
    assert_eq!(hint.seq.unwrap().epoch, epoch + 1, "{hint:?}");
    let mut st = e.mb_store.clone();
    assert_eq!(st.read_watermark(s).await.unwrap().epoch, epoch + 1);
    wait_until("re-materialised from the log", || async {
        mailbox(&e, u).await.len() == 3 && min_w(&e, s).await == 3
    })
    .await;
    let want: Vec<(u64, String)> = (1..=3).map(|i| (i, format!("n{i}"))).collect();
    assert_eq!(mailbox(&e, u).await, want);
    w.stop().await;
}

/// Loses the reply of the first re-fence (ADR-0100) after its script ran.
#[derive(Default)]
struct LoseFenceReply {
    /// Re-fences asked about (the first one's reply is lost).
    asked: AtomicU32,
}

impl ChunkFault for LoseFenceReply {
    fn fail(&self, _shard: u32, _offset: u64, _lane: usize, _attempt: u32) -> bool {
        false
    }
    fn lose_fence_reply(&self, _shard: u32, _epoch: u64) -> bool {
        self.asked.fetch_add(1, Ordering::SeqCst) == 0
    }
}

/// ADR-0120: as in `a_watermark_gone_back_in_its_epoch_is_re_fenced_and_hinted_at_once`, the
/// watermark goes back in its epoch and the owner re-fences it, but the re-fence's reply is
/// lost after its script raised the epoch (the connection cut by the same failover). The next
/// resync finds the epoch it asked for, which may be its own: it fences past it and
/// re-materialises. Before, it took that epoch for another owner's and stopped the shard as
/// fenced, for good (static ownership restarts nothing).
#[tokio::test]
async fn a_re_fence_whose_reply_was_lost_does_not_stop_the_shard() {
    use tidemark_store::redis::watermark::LaneRecord;
    let mut e = env().await;
    let u = "regressed";
    let s = route(u).shard;
    let fault = Arc::new(LoseFenceReply::default());
    let opts = MaterializerOptions {
        mailbox_wait: tidemark_store::redis::dlog::WaitPolicy {
            replicas: Some(1),
            timeout: Duration::from_millis(20),
        },
        gc_idle_interval: Duration::from_millis(300),
        fault: Some(fault.clone()),
        ..fast_opts()
    };
    let w = start_worker(&e, opts).await;
    for i in 1..=3 {
        send(&mut e, "a", &format!("r{i}"), &[u], &format!("n{i}")).await;
    }
    wait_until("three delivered", || async {
        mailbox(&e, u).await.len() == 3
    })
    .await;
    let epoch = w.health.snapshot()[&s].epoch;
    // the mailbox side back at W = 1 in the same epoch, entries 2 and 3 gone
    put_lanes(&e, s, &LaneWatermarks::uniform(LaneRecord::at(1, 0))).await;
    let mut c = e.mb_store.connection();
    let _: () = c
        .zrembyscore(keys::mailbox(s, u), "(1", "+inf")
        .await
        .unwrap();
    until_within(
        "the shard re-materialised after its re-fence's reply was lost",
        Duration::from_secs(10),
        || async {
            let status = w.status(s);
            assert!(
                !matches!(status, Some(ShardStatus::Fenced { .. })),
                "the shard stopped as fenced: {status:?}"
            );
            mailbox(&e, u).await.len() == 3 && min_w(&e, s).await == 3
        },
    )
    .await;
    assert!(
        fault.asked.load(Ordering::SeqCst) >= 2,
        "a re-fence's reply was lost, and another re-fence followed"
    );
    assert_eq!(w.status(s), Some(ShardStatus::Running));
    let mut st = e.mb_store.clone();
    let stored = st.read_watermark(s).await.unwrap().epoch;
    assert_eq!(
        stored,
        epoch + 2,
        "fenced past the epoch of the unanswered re-fence"
    );
    assert_eq!(
        w.health.snapshot()[&s].epoch,
        stored,
        "the owner writes in it"
    );
    let want: Vec<(u64, String)> = (1..=3).map(|i| (i, format!("n{i}"))).collect();
    assert_eq!(mailbox(&e, u).await, want);
    w.stop().await;
}

/// Sends `sig` (`-STOP`, `-CONT`) to process `pid`.
fn signal(pid: u32, sig: &str) {
    let ok = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok, "kill {sig} {pid}");
}

/// Sends SIGCONT to a SIGSTOPped redis-server when dropped (a failed assertion included), so
/// that it is torn down as a running process.
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        signal(self.0, "-CONT");
    }
}

/// ADR-0129: one worker, two mailbox instances, and B hangs (SIGSTOP: its connection stays
/// open, nothing answers). A record for B comes at once, B's quiet shards are due for GC every
/// 200 ms, and the owner marks come due ten seconds after the worker's start. Meanwhile a
/// record for a recipient on A is committed every half second, and each must be in A's
/// mailbox within 3 s; B's shards, the quiet ones too, are reported on the health board. Once
/// B resumes, its record arrives and its shards are healthy again. Before, each call of the
/// loop to B (the record's pipeline, its GC, the marks) waited for the connection's 30 s
/// response timeout: A's shards were stepped about once every 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_mailbox_instance_does_not_hold_up_the_shards_of_the_other() {
    let core = RedisProcess::start().unwrap();
    let a = RedisProcess::start().unwrap();
    let b = RedisProcess::start().unwrap();
    let map = Topology::new(
        SHARDS,
        Layout::PackedV2,
        vec![core.url()],
        vec![a.url(), b.url()],
    )
    .validate()
    .unwrap();
    let mut stores = Vec::new();
    for url in [a.url(), b.url()] {
        stores.push(MailboxStore::connect(&url, Layout::PackedV2).await.unwrap());
    }
    for s in 0..SHARDS {
        stores[map.mailbox_of(s)]
            .init_watermark(s, Layout::PackedV2, 1, 0, false)
            .await
            .unwrap();
    }
    let on = |i: usize| {
        (0..)
            .map(|n| format!("user-{n}"))
            .find(|u| map.mailbox_of(route(u).shard) == i)
            .unwrap()
    };
    let (ua, ub) = (on(0), on(1));
    let mut commits = LogStore::connect(&core.url()).await.unwrap();
    let mut commit = async |id: String, to: &str| {
        commits
            .commit(
                route(to).shard,
                "s",
                &id,
                &[to],
                &id,
                1,
                DEFAULT_DEDUPE_TTL_S,
            )
            .await
            .unwrap()
            .offset
    };
    // the reads of the test's own: A's, and B's once it resumes
    let (mut read_a, read_b) = (stores[0].clone(), stores[1].clone());
    let health = Arc::new(HealthBoard::default());
    let shards: Vec<u32> = (0..SHARDS).collect();
    let w = Worker::start(
        map.clone(),
        0,
        stores,
        &shards,
        MaterializerOptions {
            // a quiet shard is collected every 200 ms: B's GC is due as soon as it hangs
            gc_idle_interval: Duration::from_millis(200),
            ..fast_opts()
        },
        health.clone(),
    )
    .await
    .unwrap();
    // the owner marks were refreshed at the loop's first pass, and are due again 10 s later
    let started = Instant::now();
    let cancel = CancellationToken::new();
    let c = cancel.clone();
    let task = tokio::spawn(async move { w.run(c).await.unwrap() });
    let ra = route(&ua);
    let first = commit("a0".into(), &ua).await;
    until_within("the worker serves A", Duration::from_secs(5), || {
        let mut st = read_a.clone();
        async move {
            st.read_watermark(ra.shard)
                .await
                .unwrap()
                .lanes
                .lane(ra.lane)
                .w
                >= first
        }
    })
    .await;

    let pid = b.pid().expect("B runs");
    signal(pid, "-STOP");
    let hung = Instant::now();
    let resume = Resume(pid);
    let to_b = commit("b1".into(), &ub).await;
    let mut n = 0;
    while started.elapsed() < Duration::from_secs(11) {
        n += 1;
        let tick = Instant::now();
        let offset = commit(format!("a{n}"), &ua).await;
        loop {
            let wm = read_a.read_watermark(ra.shard).await.unwrap();
            if wm.lanes.lane(ra.lane).w >= offset {
                break;
            }
            assert!(
                tick.elapsed() < Duration::from_secs(3),
                "message {n} for A not materialised within 3 s, {:?} into B's hang",
                hung.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep_until((tick + Duration::from_millis(500)).into()).await;
    }
    // B's shards are reported, the quiet ones too
    let board = health.snapshot();
    for s in (0..SHARDS).filter(|&s| map.mailbox_of(s) == 1) {
        let why = board[&s].retrying.as_ref().map(|r| r.0.as_str());
        assert!(
            why.is_some_and(|w| w.contains("does not answer")),
            "shard {s} of the hung instance: {why:?}"
        );
    }
    drop(resume);
    let rb = route(&ub);
    until_within(
        "B's record materialised once B answers",
        Duration::from_secs(10),
        || {
            let mut st = read_b.clone();
            async move {
                st.read_watermark(rb.shard)
                    .await
                    .is_ok_and(|wm| wm.lanes.lane(rb.lane).w >= to_b)
            }
        },
    )
    .await;
    // once B is probed again: at most STALL_MAX (5 s) after its last timeout
    until_within("B's shards healthy again", Duration::from_secs(10), || {
        let board = health.snapshot();
        async move { board.values().all(|h| h.retrying.is_none()) }
    })
    .await;
    cancel.cancel();
    task.await.unwrap();
}

/// ADR-0130: in leases mode a worker started while a shard's lease gate is closed (a worker
/// started again after a panic, after the node's lease lapsed and before the lease loop's next
/// tick) does not claim it: another node may hold the lease and have claimed the shard, and a
/// claim would fence it. Here another owner's claim stored epoch 7 and every gate is closed:
/// the start, and the worker's retries after it, leave the epoch at 7. Before, the start raised
/// it to 8.
#[tokio::test]
async fn a_worker_started_with_its_lease_gates_closed_claims_nothing() {
    let e = env().await;
    let mut st = e.mb_store.clone();
    for s in 0..SHARDS {
        let f = st.fence_epoch(s, 1, 7).await.unwrap();
        assert!(matches!(f, Fence::Raised { epoch: 7 }), "{f:?}");
    }
    let gate = Arc::new(tidemark_server::ownership::LeaseGate::default());
    let w = start_worker(
        &e,
        MaterializerOptions {
            lease_gate: Some(gate),
            ..fast_opts()
        },
    )
    .await;
    for s in 0..SHARDS {
        let epoch = st.read_watermark(s).await.unwrap().epoch;
        assert_eq!(
            epoch, 7,
            "shard {s}: the start claimed a shard whose lease gate is closed"
        );
    }
    // nor once it runs: its retries wait for the gate (ADR-0097)
    tokio::time::sleep(Duration::from_millis(300)).await;
    for s in 0..SHARDS {
        let epoch = st.read_watermark(s).await.unwrap().epoch;
        assert_eq!(
            epoch, 7,
            "shard {s}: claimed while its lease gate is closed"
        );
    }
    w.stop().await;
}
