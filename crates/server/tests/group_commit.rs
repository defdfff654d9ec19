//! Group commit (ADR-0036) through the gateway, against real redis-servers: many connections
//! send to one shard at once, so their commits meet in that shard's queue and go to Redis in
//! groups. Every send must still get its own answer (its offset, duplicate, `id_reused`),
//! each connection's sends must keep their order, and the mailbox entry at each acknowledged
//! offset must be the message that was acknowledged with it.

mod gateway_support;

use std::collections::BTreeMap;

use gateway_support::{offset_of, start, Deployment, Ws};
use serde_json::Value;

/// Connections sending at once.
const CONNS: usize = 24;
/// New messages per connection.
const PER: usize = 25;

/// The next `send_ack` or `error` frame (deliveries stay pending).
async fn answer(ws: &mut Ws) -> Value {
    ws.recv_where(|v| v["type"] == "send_ack" || v["type"] == "error")
        .await
}

/// The first `n` deliveries to `user` (a new connection): seq -> (from, body), checking
/// that they come in seq order.
async fn delivered(d: &Deployment, user: &str, n: usize) -> BTreeMap<u64, (String, String)> {
    let mut ws = d.ready(user).await;
    let mut out = BTreeMap::new();
    let mut last = 0;
    for _ in 0..n {
        let m = ws.deliver().await;
        let seq = m["seq"].as_u64().unwrap();
        assert!(seq > last, "deliveries in seq order");
        last = seq;
        let from = m["from"].as_str().unwrap().to_string();
        out.insert(seq, (from, m["body"].as_str().unwrap().to_string()));
    }
    out
}

/// `(count, sum)` of the group-size histogram in `/metrics`.
async fn group_sizes(d: &Deployment) -> (f64, f64) {
    let (status, text) = d.get_text("/metrics").await;
    assert_eq!(status, 200);
    let field = |suffix: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("tidemark_commit_group_size_{suffix} ")))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field("count"), field("sum"))
}

#[tokio::test]
async fn concurrent_connections_each_get_their_own_answers_in_their_own_order() {
    let d = start().await;
    let bob = "bob";
    let users: Vec<String> = (0..CONNS).map(|i| format!("g{i}")).collect();
    let mut socks = d.ready_all(&users).await;
    // Every connection queues all its sends at once. The gateway commits a connection's
    // sends one after another, so the connections' sends meet in the shard's queue. After
    // its new messages, each connection resends m-3 (the same message: a duplicate) and
    // reuses m-5 for another body (id_reused).
    for (i, ws) in socks.iter_mut().enumerate() {
        for j in 0..PER {
            ws.send_only(&format!("m-{j}"), &[bob], &format!("{i}:{j}"))
                .await;
        }
        ws.send_only("m-3", &[bob], &format!("{i}:3")).await;
        ws.send_only("m-5", &[bob], &format!("{i}:5 again")).await;
    }
    // offset -> the (sender, body) it was acknowledged for
    let mut acked: BTreeMap<u64, (String, String)> = BTreeMap::new();
    for (i, ws) in socks.iter_mut().enumerate() {
        let mut mine = Vec::new();
        for j in 0..PER {
            let a = answer(ws).await;
            assert_eq!(
                (&a["type"], &a["id"]),
                (&"send_ack".into(), &format!("m-{j}").into())
            );
            let off = offset_of(a["offsets"].as_object().unwrap(), bob);
            let prev = acked.insert(off, (users[i].clone(), format!("{i}:{j}")));
            assert!(prev.is_none(), "offset {off} acknowledged twice: {prev:?}");
            mine.push(off);
        }
        assert!(
            mine.windows(2).all(|w| w[0] < w[1]),
            "connection {i}'s sends out of order: {mine:?}"
        );
        let resend = answer(ws).await;
        assert_eq!(resend["type"], "send_ack", "{resend}");
        assert_eq!(
            offset_of(resend["offsets"].as_object().unwrap(), bob),
            mine[3],
            "a resend is answered with the first offset"
        );
        let reused = answer(ws).await;
        assert_eq!(
            (
                reused["type"].as_str(),
                reused["code"].as_str(),
                reused["id"].as_str()
            ),
            (Some("error"), Some("id_reused"), Some("m-5")),
            "{reused}"
        );
    }
    // the offsets are exactly 1..=CONNS*PER, and bob's mailbox entry at each offset is the
    // message acknowledged with it
    let n = (CONNS * PER) as u64;
    assert_eq!(
        acked.keys().copied().collect::<Vec<_>>(),
        (1..=n).collect::<Vec<_>>()
    );
    assert_eq!(delivered(&d, bob, CONNS * PER).await, acked);
    // and the commits really went in groups
    let (count, sum) = group_sizes(&d).await;
    assert!(
        sum > count,
        "no commit call held more than one message (calls {count}, messages {sum})"
    );
}

/// Two connections of one user send the same messages at once (a resend racing the first
/// send): both are answered with the same offset, the message is in the mailbox once.
#[tokio::test]
async fn a_resend_racing_its_first_send_gets_the_same_offset() {
    let d = start().await;
    let bob = "bob";
    let mut a = d.ready("twin").await;
    let mut b = d.ready("twin").await;
    const N: usize = 40;
    for j in 0..N {
        a.send_only(&format!("t-{j}"), &[bob], &format!("body {j}"))
            .await;
        b.send_only(&format!("t-{j}"), &[bob], &format!("body {j}"))
            .await;
    }
    let mut offsets = BTreeMap::new();
    for j in 0..N {
        let (x, y) = (answer(&mut a).await, answer(&mut b).await);
        assert_eq!(
            (&x["type"], &y["type"]),
            (&"send_ack".into(), &"send_ack".into())
        );
        let (ox, oy) = (
            offset_of(x["offsets"].as_object().unwrap(), bob),
            offset_of(y["offsets"].as_object().unwrap(), bob),
        );
        assert_eq!(ox, oy, "t-{j}: {x} {y}");
        offsets.insert(ox, ("twin".to_string(), format!("body {j}")));
    }
    assert_eq!(offsets.len(), N);
    // each message once in bob's mailbox, at the offset both were answered with
    assert_eq!(delivered(&d, bob, N).await, offsets);
}

/// A send whose connection closes while its commit is in flight is dropped by its send loop:
/// the send queued behind it on the same shard must still be committed, and the shard must
/// take later sends. (A variant where the first send made the call in its own task, tried
/// and not kept — docs/performance.md — needed a guard for exactly this.) Core Redis holds every write for a
/// while (`CLIENT PAUSE … WRITE`), so the first call is surely in flight when the second
/// send queues.
#[tokio::test]
async fn a_send_dropped_mid_commit_leaves_no_send_behind_it_waiting() {
    let d = start().await;
    let mut alice = d.ready("alice").await;
    let mut carol = d.ready("carol").await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("WRITE")
        .query_async(&mut d.core().await)
        .await
        .unwrap();
    alice.send_only("lead", &["bob"], "from alice").await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    carol.send_only("behind", &["bob"], "from carol").await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    alice.close().await; // her send's commit is dropped mid-call
    let a = answer(&mut carol).await;
    assert_eq!(a["type"], "send_ack", "{a}");
    assert_eq!(a["id"], "behind");
    let later = carol.send_ok("later", &["bob"], "again").await;
    assert!(offset_of(&later, "bob") > offset_of(a["offsets"].as_object().unwrap(), "bob"));
}

/// ADR-0045: the rounds are per core instance, not per shard, and the linger spaces them.
/// With a linger of one second: a send to a quiet instance goes at once; six sends to the
/// instance's three other shards made right after it all wait for the next round (their
/// shards were quiet, so a per-shard queue would have sent them at once), and all go in that
/// one round (a third
/// round could not start before two lingers had passed). After a quiet spell longer than
/// the linger, a lone send goes at once again.
#[tokio::test]
async fn a_round_carries_every_shard_of_its_instance_and_rounds_keep_the_linger_apart() {
    use std::time::{Duration, Instant};
    const LINGER: Duration = Duration::from_secs(1);
    let d = gateway_support::start_with(|o| o.commit_linger = LINGER).await;
    let rcpts = gateway_support::users_in_distinct_shards("r", 4);
    let senders: Vec<String> = (0..6).map(|i| format!("s{i}")).collect();
    let mut socks = d.ready_all(&senders).await;
    let mut lead = d.ready("lead").await;

    let t0 = Instant::now();
    lead.send_ok("first", &[rcpts[3].as_str()], "lead").await;
    assert!(
        t0.elapsed() < LINGER,
        "a send to a quiet instance waited {:?}",
        t0.elapsed()
    );
    for (i, ws) in socks.iter_mut().enumerate() {
        ws.send_only("m", &[rcpts[i % 3].as_str()], &format!("from {i}"))
            .await;
    }
    for (i, ws) in socks.iter_mut().enumerate() {
        let a = answer(ws).await;
        assert_eq!(a["type"], "send_ack", "{a}");
        let at = t0.elapsed();
        // the first round started after t0, the next one a linger after it
        assert!(
            at >= LINGER,
            "send {i} answered after {at:?}, inside the linger"
        );
        assert!(
            at < 2 * LINGER,
            "send {i} answered after {at:?}: not in the round after the first"
        );
    }

    tokio::time::sleep(LINGER + Duration::from_millis(200)).await;
    let t1 = Instant::now();
    lead.send_ok("after quiet", &[rcpts[0].as_str()], "again")
        .await;
    assert!(
        t1.elapsed() < LINGER,
        "a send after a quiet spell waited {:?}",
        t1.elapsed()
    );
}

/// ADR-0089: a connection's sends to one shard (each claiming its id in its commit call) are
/// queued for a round as soon as they arrive, not one round each. With a linger of one
/// second: after a first send (a quiet instance: at once), ten sends made back to back by the
/// same connection to three shards are all answered, in the order sent, before a second
/// linger has passed (one round each would take ten seconds). A send to two shards (its id
/// claimed first, in a call of its own) between two sends to one shard keeps its place: the
/// mailbox of the shared recipient holds the three in the order sent, and so do the answers.
#[tokio::test]
async fn a_connections_sends_share_a_round_and_keep_their_order() {
    use std::time::{Duration, Instant};
    const LINGER: Duration = Duration::from_secs(1);
    let d = gateway_support::start_with(|o| o.commit_linger = LINGER).await;
    let rcpts = gateway_support::users_in_distinct_shards("p", 3);
    let r: Vec<&str> = rcpts.iter().map(String::as_str).collect();
    let mut alice = d.ready("alice").await;

    let t0 = Instant::now();
    alice.send_ok("first", &[r[0]], "lead").await;
    for i in 0..10 {
        alice
            .send_only(&format!("q{i}"), &[r[i % 3]], &format!("body {i}"))
            .await;
    }
    let mut last = BTreeMap::new();
    for i in 0..10 {
        let a = answer(&mut alice).await;
        assert_eq!(a["type"], "send_ack", "{a}");
        assert_eq!(a["id"], format!("q{i}"), "answers in the order sent");
        let to = r[i % 3];
        let off = offset_of(a["offsets"].as_object().unwrap(), to);
        if let Some(prev) = last.insert(to, off) {
            assert!(off > prev, "a shard's offsets follow the order sent");
        }
    }
    assert!(
        t0.elapsed() < 2 * LINGER,
        "ten sends of one connection took {:?}: not one round",
        t0.elapsed()
    );

    alice.send_only("a", &[r[0]], "A").await;
    alice.send_only("b", &[r[0], r[1]], "B").await;
    alice.send_only("c", &[r[0]], "C").await;
    let mut offs = Vec::new();
    for id in ["a", "b", "c"] {
        let a = answer(&mut alice).await;
        assert_eq!(a["type"], "send_ack", "{a}");
        assert_eq!(a["id"], id, "answers in the order sent");
        offs.push(offset_of(a["offsets"].as_object().unwrap(), r[0]));
    }
    assert!(offs[0] < offs[1] && offs[1] < offs[2], "log order {offs:?}");
    // r[0]'s mailbox: the lead, the four q sends to it, then A, B, C
    let got = delivered(&d, r[0], 8).await;
    let bodies: Vec<&str> = got.values().map(|(_, b)| b.as_str()).collect();
    assert_eq!(
        bodies,
        ["lead", "body 0", "body 3", "body 6", "body 9", "A", "B", "C"]
    );
}

/// ADR-0090: a round starts at once when a full call's worth of messages (128) waits for the
/// instance, whatever the linger. With a linger of four seconds, after a first send (a quiet
/// instance: at once), four connections send 40 messages each back to back: at least 128 of
/// the 160 are answered within two seconds (without the trigger none is: every one waits for
/// the round a linger after the first).
#[tokio::test]
async fn a_full_call_starts_its_round_before_the_linger_ends() {
    use std::time::Duration;
    const LINGER: Duration = Duration::from_secs(4);
    let d = gateway_support::start_with(|o| o.commit_linger = LINGER).await;
    let senders: Vec<String> = (0..4).map(|i| format!("f{i}")).collect();
    let mut socks = d.ready_all(&senders).await;
    let mut lead = d.ready("lead").await;
    lead.send_ok("first", &["bob"], "lead").await;
    let t0 = tokio::time::Instant::now();
    for ws in socks.iter_mut() {
        for j in 0..40 {
            ws.send_only(&format!("m{j}"), &["bob"], "x").await;
        }
    }
    let deadline = t0 + LINGER / 2;
    let mut early = 0;
    for ws in socks.iter_mut() {
        for _ in 0..40 {
            match tokio::time::timeout_at(deadline, answer(ws)).await {
                Ok(a) => {
                    assert_eq!(a["type"], "send_ack", "{a}");
                    early += 1;
                }
                Err(_) => break,
            }
        }
    }
    assert!(
        early >= 128,
        "{early} of 160 sends answered within half the linger: a full call waited for it"
    );
}

/// ADR-0089 under load: with no linger, two flush tasks take rounds as fast as they can, so
/// many rounds are in flight while eight connections each send 60 messages to one mailbox
/// back to back. Every connection's answers come in the order sent with increasing offsets,
/// and the mailbox holds each connection's messages in the order sent.
#[tokio::test]
async fn a_connections_sends_keep_their_order_with_many_rounds_in_flight() {
    const PER: usize = 60;
    let d = gateway_support::start_with(|o| o.commit_linger = std::time::Duration::ZERO).await;
    let senders: Vec<String> = (0..8).map(|i| format!("o{i}")).collect();
    let mut socks = d.ready_all(&senders).await;
    for j in 0..PER {
        for (i, ws) in socks.iter_mut().enumerate() {
            ws.send_only(&format!("m{j}"), &["bob"], &format!("{i}:{j}"))
                .await;
        }
    }
    for ws in socks.iter_mut() {
        let mut last = 0;
        for j in 0..PER {
            let a = answer(ws).await;
            assert_eq!(a["type"], "send_ack", "{a}");
            assert_eq!(a["id"], format!("m{j}"), "answers in the order sent");
            let off = offset_of(a["offsets"].as_object().unwrap(), "bob");
            assert!(off > last, "offsets in the order sent");
            last = off;
        }
    }
    let got = delivered(&d, "bob", 8 * PER).await;
    let mut next = [0usize; 8];
    for (_, (_, body)) in got {
        let (i, j) = body.split_once(':').unwrap();
        let (i, j): (usize, usize) = (i.parse().unwrap(), j.parse().unwrap());
        assert_eq!(j, next[i], "sender {i}'s messages in the order sent");
        next[i] += 1;
    }
    assert!(next.iter().all(|&n| n == PER));
}

/// ADR-0091: a one-shard send whose id already holds a bare claim of its own (its first
/// attempt claimed the id in a call of its own, as the slow path does, and never committed)
/// is answered "needs its dedupe keys" in its round's call and committed by a second call
/// (ADR-0043). The connection's later sends in that round wait for it: the answers, the
/// offsets and the mailbox keep the order sent. Before, they were committed in the first
/// call, below it. The real service, so that the deployment has one-key claims (ADR-0040).
#[tokio::test]
async fn a_send_that_needs_a_second_call_keeps_its_place_among_its_connections_sends() {
    use gateway_support::{ready_at, redis_at, shard_of, Service};
    use std::time::Duration;
    use tidemark_store::keys;
    use tidemark_store::redis::dlog::request_digest;
    const N: usize = 12;
    let gateway = tidemark_server::gateway::GatewayOptions {
        dev_auth: true,
        commit_linger: Duration::from_millis(300),
        ..Default::default()
    };
    let svc = Service::start(gateway, Default::default()).await;
    let addr = svc.running().addr;
    // m5's first attempt: its claim, a bare digest of the same message
    let digest = request_digest(&["bob"], "body 5");
    let mut core = redis_at(&svc.core_url).await;
    let () = redis::cmd("SET")
        .arg(keys::message_id(shard_of("alice"), "alice", "m5"))
        .arg(&digest)
        .arg("EX")
        .arg(3600)
        .query_async(&mut core)
        .await
        .unwrap();
    let mut alice = ready_at(addr, "alice").await;
    alice.send_ok("lead", &["bob"], "lead").await;
    for j in 0..N {
        alice
            .send_only(&format!("m{j}"), &["bob"], &format!("body {j}"))
            .await;
    }
    let mut last = 0;
    for j in 0..N {
        let a = answer(&mut alice).await;
        assert_eq!(a["type"], "send_ack", "{a}");
        assert_eq!(a["id"], format!("m{j}"), "answers in the order sent");
        let off = offset_of(a["offsets"].as_object().unwrap(), "bob");
        assert!(
            off > last,
            "m{j} at offset {off}, after {last}: offsets in the order sent"
        );
        last = off;
    }
    // a one-key claim for m4 (no dedupe record), and the second call wrote m5's
    let dedupe = |id: &str| {
        redis::cmd("GET")
            .arg(keys::dedupe(shard_of("bob"), "alice", id))
            .clone()
    };
    let dd4: Option<String> = dedupe("m4").query_async(&mut core).await.unwrap();
    assert_eq!(dd4, None, "m4 went with its claim alone");
    let dd5: Option<String> = dedupe("m5").query_async(&mut core).await.unwrap();
    assert!(
        dd5.as_deref().is_some_and(|v| v.ends_with(&digest)),
        "m5 committed by the call with its dedupe keys: {dd5:?}"
    );
    let mut bob = ready_at(addr, "bob").await;
    let mut bodies = Vec::new();
    for _ in 0..=N {
        bodies.push(bob.deliver().await["body"].as_str().unwrap().to_string());
    }
    let want: Vec<String> = std::iter::once("lead".to_string())
        .chain((0..N).map(|j| format!("body {j}")))
        .collect();
    assert_eq!(bodies, want, "bob's mailbox in the order sent");
    svc.stop().await;
}

/// Backpressure (docs/protocol.md, "A connection's sends"): while 64 sends of a connection
/// wait for their answers, the server reads no more frames from it. Core Redis is paused, so
/// no send is answered: after 64 sends, a malformed frame (answered with an error as soon as
/// it is read) stays unread until the pause ends; after 63, it is read and answered at once.
/// Before, the send awaited at the time was not counted, and the 65th frame was read.
#[tokio::test]
async fn a_connection_with_64_sends_waiting_is_not_read_further() {
    use std::time::Duration;
    let d = gateway_support::start().await;
    let mut full = d.ready("bp-full").await;
    let mut under = d.ready("bp-under").await;
    full.send_ok("warm", &["bob"], "w").await;
    under.send_ok("warm", &["bob"], "w").await;
    d.pause_core(3000).await;
    let t0 = std::time::Instant::now();
    for (ws, n) in [(&mut full, 64), (&mut under, 63)] {
        for i in 0..n {
            ws.send_only(&format!("m{i}"), &["bob"], &format!("body {i}"))
                .await;
        }
        ws.send_text("{not json").await;
    }
    let is_bad = |v: &Value| v["type"] == "error" && v["code"] == "bad_json";
    let early = tokio::time::timeout(Duration::from_millis(1500), under.recv_where(is_bad)).await;
    assert!(
        early.is_ok(),
        "63 sends waiting: the next frame is read and answered at once"
    );
    let early = tokio::time::timeout(Duration::from_millis(200), full.recv_where(is_bad)).await;
    assert!(
        early.is_err(),
        "64 sends waiting: the next frame was read ({:?} into a 3 s pause of core Redis)",
        t0.elapsed()
    );
    assert!(
        t0.elapsed() < Duration::from_millis(2500),
        "the checks ran within the pause"
    );
    // after the pause: every send answered, and the malformed frame too
    for (ws, n) in [(&mut full, 64), (&mut under, 63)] {
        for i in 0..n {
            let a = ws.recv_where(|v| v["type"] == "send_ack").await;
            assert_eq!(a["id"], format!("m{i}"));
        }
    }
    full.recv_where(is_bad).await;
}

/// ADR-0093: a connection that reuses an id for another message in the same round (the
/// first still awaiting its answer) gets the first acknowledged and the second refused
/// (`id_reused`), as one after the other would. The first goes to a shard after the second's:
/// in one call the parts run in shard order, so before, the second took the id and the
/// first was refused.
#[tokio::test]
async fn an_id_reused_in_one_round_is_refused_to_the_later_send() {
    use gateway_support::shard_of;
    use std::time::Duration;
    let d = gateway_support::start_with(|o| o.commit_linger = Duration::from_millis(300)).await;
    let mut users = gateway_support::users_in_distinct_shards("r", 2);
    users.sort_by_key(|u| shard_of(u));
    let (low, high) = (users[0].as_str(), users[1].as_str());
    let mut alice = d.ready("alice").await;
    alice.send_ok("lead", &[low], "lead").await;
    alice.send_only("dup", &[high], "first").await;
    alice.send_only("dup", &[low], "second").await;
    alice.send_only("after", &[low], "after").await;
    let a = answer(&mut alice).await;
    assert_eq!(
        (&a["type"], &a["id"]),
        (&"send_ack".into(), &"dup".into()),
        "{a}"
    );
    let b = answer(&mut alice).await;
    assert_eq!(
        (&b["type"], &b["code"], &b["id"]),
        (&"error".into(), &"id_reused".into(), &"dup".into()),
        "{b}"
    );
    let c = answer(&mut alice).await;
    assert_eq!(
        (&c["type"], &c["id"]),
        (&"send_ack".into(), &"after".into()),
        "{c}"
    );
    // high's mailbox holds the first message; low's the lead and "after" only
    let got = delivered(&d, high, 1).await;
    assert_eq!(got.values().next().unwrap().1, "first");
    let got = delivered(&d, low, 2).await;
    let bodies: Vec<&str> = got.values().map(|(_, b)| b.as_str()).collect();
    assert_eq!(bodies, ["lead", "after"]);
}

/// ADR-0095: a send queued for its round keeps its room among the commits in flight until
/// it is answered, also when its connection closes first. With the user's share at 8 and core
/// Redis paused, a connection queues 8 sends in one round and closes; a second connection of
/// the same user finds no room (`overloaded`) while those 8 still wait for Redis. Before, the
/// close freed their room at once, and the user could queue another 8 per connection.
#[tokio::test]
async fn a_closed_connections_queued_sends_keep_their_room_until_answered() {
    use std::time::Duration;
    let d = gateway_support::start_with(|o| {
        o.max_inflight_commits_per_user = 8;
        o.commit_linger = Duration::from_millis(500);
    })
    .await;
    let mut first = d.ready("carl").await;
    first.send_ok("warm", &["bob"], "w").await;
    // within the linger of the warm round: the 8 sends wait for the next round, all in it
    d.pause_core(3000).await;
    for i in 0..8 {
        first
            .send_only(&format!("q{i}"), &["bob"], &format!("queued {i}"))
            .await;
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    drop(first);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut second = d.ready("carl").await;
    let t0 = std::time::Instant::now();
    second.send_only("late", &["bob"], "late").await;
    let a = answer(&mut second).await;
    assert_eq!(
        (&a["type"], &a["code"]),
        (&"error".into(), &"overloaded".into()),
        "the closed connection's 8 queued sends still hold the user's share: {a} (after {:?})",
        t0.elapsed()
    );
    // once core Redis runs again, the 8 are committed and delivered, and room comes back
    let got = delivered(&d, "bob", 9).await;
    let bodies: Vec<&str> = got.values().map(|(_, b)| b.as_str()).collect();
    let want: Vec<String> = std::iter::once("w".to_string())
        .chain((0..8).map(|i| format!("queued {i}")))
        .collect();
    assert_eq!(bodies, want);
    second.send_ok("later", &["bob"], "later").await;
}
