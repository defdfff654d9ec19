//! The gateway against a real deployment (redis-server processes, the materializer, real
//! WebSocket and HTTP): send → commit → materialize → deliver, dedupe (and its expiry), acks
//! and resume (capped at the lane's W, trimming the mailbox, coalesced and flushed on a
//! timer), sync, auth, mailbox isolation, hostile frames, HTTP, metrics, health (a stuck
//! shard) and shutdown.

mod gateway_support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gateway_support::{
    encode, shard_of, start, start_full, start_with, token_for, users_in_distinct_shards,
    Deployment, SECRET, WAIT,
};
use serde_json::{json, Value};
use tidemark_protocol::token;

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

fn offset_of(offsets: &serde_json::Map<String, Value>, user: &str) -> u64 {
    offsets[&shard_of(user).to_string()].as_u64().unwrap()
}

/// Polls `GET /v1/mailbox` of `user` (dev auth) until it holds `n` entries after `after`.
async fn mailbox_with(d: &Deployment, user: &str, after: u64, n: usize) -> Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (status, page) = d
            .http_json(
                "GET",
                &format!("/v1/mailbox?after={after}&user={}", encode(user)),
                &[],
                None,
            )
            .await;
        assert_eq!(status, 200, "{page}");
        if page["entries"].as_array().unwrap().len() >= n {
            return page;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "mailbox of {user} never reached {n} entries: {page}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn send_ack_then_deliver_to_connected_and_late_recipients() {
    let d = start().await;
    let rcpts = users_in_distinct_shards("r", 3);
    let (early, late, other) = (&rcpts[0], &rcpts[1], &rcpts[2]);

    let mut e = d.ws_user(early).await;
    let ready = e.recv().await;
    assert_eq!(ready, json!({"type":"ready","user":early,"after":0}));

    let mut alice = d.ws_user("alice").await;
    assert_eq!(alice.recv().await["type"], "ready");
    let before = now_us();
    let offsets = alice
        .send_ok(
            "c-1",
            &[early.as_str(), late.as_str(), other.as_str()],
            "hi",
        )
        .await;
    assert_eq!(
        offsets.len(),
        3,
        "one offset per shard touched: {offsets:?}"
    );

    let m = e.deliver().await;
    assert_eq!(m["seq"].as_u64().unwrap(), offset_of(&offsets, early));
    assert_eq!(m["from"], "alice");
    assert_eq!(m["body"], "hi");
    let sent_at = m["sent_at_us"].as_u64().unwrap();
    assert!(sent_at >= before && sent_at <= now_us(), "{m}");

    // Connected after the message was committed: ready first, then the entry.
    let mut l = d.ws_user(late).await;
    assert_eq!(
        l.recv().await,
        json!({"type":"ready","user":late,"after":0})
    );
    let m = l.recv().await;
    assert_eq!(m["type"], "deliver");
    assert_eq!(m["seq"].as_u64().unwrap(), offset_of(&offsets, late));
    assert_eq!(
        (m["from"].as_str(), m["body"].as_str()),
        (Some("alice"), Some("hi"))
    );

    // Unicode and an empty body survive the round trip.
    let offsets = alice.send_ok("c-2", &[early.as_str()], "").await;
    let m = e.deliver().await;
    assert_eq!(m["seq"].as_u64().unwrap(), offset_of(&offsets, early));
    assert_eq!(m["body"], "");
    alice
        .send_ok("c-3", &[early.as_str()], "Grüße, 世界 \"\n")
        .await;
    assert_eq!(e.deliver().await["body"], "Grüße, 世界 \"\n");

    d.shutdown().await;
}

#[tokio::test]
async fn a_resent_id_returns_the_same_offsets_and_is_delivered_once() {
    let d = start().await;
    let mut bob = d.ws_user("bob").await;
    bob.recv().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;

    let first = alice.send_ok("dup-1", &["bob"], "once").await;
    let again = alice.send_ok("dup-1", &["bob"], "once").await;
    assert_eq!(first, again);
    // Same id from another connection of the same sender: still the same.
    let mut alice2 = d.ws_user("alice").await;
    alice2.recv().await;
    assert_eq!(alice2.send_ok("dup-1", &["bob"], "once").await, first);
    // Over HTTP too.
    let (status, r) = d
        .http_json(
            "POST",
            "/v1/messages?user=alice",
            &[],
            Some(br#"{"id":"dup-1","to":["bob"],"body":"once"}"#),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(r["offsets"], Value::Object(first.clone()));

    let next = alice.send_ok("dup-2", &["bob"], "twice?").await;
    let m1 = bob.deliver().await;
    assert_eq!(m1["seq"].as_u64().unwrap(), offset_of(&first, "bob"));
    let m2 = bob.deliver().await;
    assert_eq!(m2["seq"].as_u64().unwrap(), offset_of(&next, "bob"));
    assert_eq!(m2["body"], "twice?");

    d.shutdown().await;
}

/// Issue 10, item 5: idempotency is per message. A resend with the same id and the same
/// recipients (in any order) and body returns every original offset; the same id with other
/// recipients (a subset, a superset) or another body is refused with `id_reused` (422 over
/// HTTP) and commits nothing.
#[tokio::test]
async fn the_same_id_for_another_message_is_refused_with_id_reused() {
    let d = start().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let us = users_in_distinct_shards("idem-", 3);
    let (a, b, c) = (us[0].as_str(), us[1].as_str(), us[2].as_str());
    let first = alice.send_ok("w-1", &[a, b], "hello").await;
    assert_eq!(first.len(), 2, "two shards");
    // the same message, recipients listed the other way round: every original offset
    assert_eq!(alice.send_ok("w-1", &[b, a], "hello").await, first);
    for (to, body, what) in [
        (vec![a], "hello", "a subset of the recipients"),
        (vec![a, b, c], "hello", "more recipients"),
        (vec![a, b], "hello!", "another body"),
    ] {
        let r = alice.send_msg("w-1", &to, body).await;
        assert_eq!(r["type"], "error", "{what}: {r}");
        assert_eq!(r["code"], "id_reused", "{what}: {r}");
        assert_eq!(r["id"], "w-1");
    }
    let (status, r) = d
        .http_json(
            "POST",
            "/v1/messages?user=alice",
            &[],
            Some(format!(r#"{{"id":"w-1","to":["{a}"],"body":"hello"}}"#).as_bytes()),
        )
        .await;
    assert_eq!(
        (status, r["error"]["code"].as_str()),
        (422, Some("id_reused")),
        "{r}"
    );
    // nothing was committed by the refused sends: a later message to a and c is the only
    // thing after the first (shards are materialised in log order)
    alice.send_ok("w-2", &[a, c], "later").await;
    let page = mailbox_with(&d, a, 0, 2).await;
    let bodies: Vec<&str> = page["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["body"].as_str().unwrap())
        .collect();
    assert_eq!(bodies, ["hello", "later"]);
    let page = mailbox_with(&d, c, 0, 1).await;
    assert_eq!(page["entries"].as_array().unwrap().len(), 1, "{page}");
    assert_eq!(page["entries"][0]["body"], "later");
    d.shutdown().await;
}

#[tokio::test]
async fn ack_then_reconnect_resumes_after_the_acked_seq() {
    let d = start().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let mut bob = d.ws_user("bob").await;
    bob.recv().await;
    let mut seqs = Vec::new();
    for i in 0..3 {
        let o = alice
            .send_ok(&format!("m{i}"), &["bob"], &format!("n{i}"))
            .await;
        seqs.push(offset_of(&o, "bob"));
    }
    for s in &seqs {
        assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), *s);
    }
    bob.send_json(&json!({"type":"ack","seq":seqs[1]})).await;
    bob.barrier().await;
    bob.close().await;

    let mut bob = d.ws_user("bob").await;
    assert_eq!(
        bob.recv().await,
        json!({"type":"ready","user":"bob","after":seqs[1]})
    );
    let m = bob.deliver().await;
    assert_eq!(m["seq"].as_u64().unwrap(), seqs[2]);
    assert_eq!(m["body"], "n2");

    // An ack above what this connection has delivered is capped at it.
    bob.send_json(&json!({"type":"ack","seq":1_000_000_000u64}))
        .await;
    bob.barrier().await;
    let o = alice.send_ok("m3", &["bob"], "n3").await;
    let s3 = offset_of(&o, "bob");
    assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), s3);
    bob.close().await;
    let mut bob = d.ws_user("bob").await;
    assert_eq!(
        bob.recv().await,
        json!({"type":"ready","user":"bob","after":seqs[2]})
    );
    assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), s3);

    d.shutdown().await;
}

#[tokio::test]
async fn sync_restarts_the_stream_exactly_after_the_seq() {
    let d = start().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let mut bob = d.ws_user("bob").await;
    bob.recv().await;
    let mut seqs = Vec::new();
    for i in 0..4 {
        let o = alice
            .send_ok(&format!("s{i}"), &["bob"], &format!("b{i}"))
            .await;
        seqs.push(offset_of(&o, "bob"));
    }
    for s in &seqs {
        assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), *s);
    }
    bob.send_json(&json!({"type":"sync","after":seqs[1]})).await;
    assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), seqs[2]);
    assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), seqs[3]);
    bob.send_json(&json!({"type":"sync","after":0})).await;
    for s in &seqs {
        assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), *s);
    }
    // Then live entries keep streaming.
    let o = alice.send_ok("s4", &["bob"], "live").await;
    let m = bob.deliver().await;
    assert_eq!(m["seq"].as_u64().unwrap(), offset_of(&o, "bob"));
    assert_eq!(m["body"], "live");

    d.shutdown().await;
}

#[tokio::test]
async fn more_than_a_page_is_delivered_in_order() {
    let d = start().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    // Pipelined sends: all frames first, then the acks.
    let n = 300;
    for i in 0..n {
        alice
            .send_json(
                &json!({"type":"send","id":format!("p{i}"),"to":["bob"],"body":format!("{i}")}),
            )
            .await;
    }
    let mut last = 0;
    for _ in 0..n {
        let a = alice.recv_type("send_ack").await;
        let s = a["offsets"][shard_of("bob").to_string()].as_u64().unwrap();
        assert!(s > last, "a connection's sends commit in order");
        last = s;
    }
    let mut bob = d.ws_user("bob").await;
    bob.recv().await;
    let mut prev = 0;
    for i in 0..n {
        let m = bob.deliver().await;
        let s = m["seq"].as_u64().unwrap();
        assert!(s > prev, "ascending seqs");
        assert_eq!(m["body"], i.to_string());
        prev = s;
    }
    assert_eq!(prev, last);
    d.shutdown().await;
}

#[tokio::test]
async fn token_auth() {
    let d = start_with(|o| o.dev_auth = false).await;
    let good = token_for("alice");

    // Valid: header or query.
    let mut ws = d
        .ws("", &[("Authorization", &format!("Bearer {good}"))])
        .await;
    assert_eq!(
        ws.recv().await,
        json!({"type":"ready","user":"alice","after":0})
    );
    let mut ws = d.ws(&format!("token={good}"), &[]).await;
    assert_eq!(ws.recv().await["user"], "alice");

    let expect = |r: Result<_, (u16, String)>, code: &str| {
        let Err((status, body)) = r else {
            panic!("upgrade accepted, expected {code}")
        };
        assert_eq!(status, 401);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], code, "{body}");
    };
    let expired = token::sign(SECRET, "alice", gateway_support::now_unix() - 1);
    expect(
        d.try_ws(&format!("token={expired}"), &[]).await,
        "token_expired",
    );
    let forged = token::sign(b"not the secret", "alice", gateway_support::now_unix() + 60);
    expect(
        d.try_ws(&format!("token={forged}"), &[]).await,
        "unauthorized",
    );
    expect(d.try_ws("token=garbage", &[]).await, "unauthorized");
    expect(d.try_ws("", &[]).await, "unauthorized");
    // Dev users are refused without --dev-auth.
    expect(d.try_ws("user=alice", &[]).await, "unauthorized");

    // HTTP: header only.
    let (status, v) = d
        .http_json("GET", "/v1/mailbox?user=alice", &[], None)
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (401, Some("unauthorized"))
    );
    let (status, v) = d
        .http_json("GET", &format!("/v1/mailbox?token={good}"), &[], None)
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (401, Some("unauthorized"))
    );
    let (status, v) = d
        .http_json(
            "GET",
            "/v1/mailbox",
            &[("Authorization", &format!("Bearer {expired}"))],
            None,
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (401, Some("token_expired"))
    );
    let (status, v) = d
        .http_json(
            "POST",
            "/v1/messages",
            &[("Authorization", &format!("Bearer {forged}"))],
            Some(br#"{"id":"x","to":["bob"],"body":""}"#),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (401, Some("unauthorized"))
    );
    let (status, _) = d
        .http_json(
            "GET",
            "/v1/mailbox",
            &[("Authorization", &format!("Bearer {good}"))],
            None,
        )
        .await;
    assert_eq!(status, 200);

    d.shutdown().await;
}

#[tokio::test]
async fn a_user_reads_only_their_own_mailbox() {
    let d = start().await;
    let alice_token = token_for("alice");
    let auth = format!("Bearer {alice_token}");

    let (status, _) = d
        .http_json(
            "POST",
            "/v1/messages?user=carol",
            &[],
            Some(br#"{"id":"secret-1","to":["bob"],"body":"for bob only"}"#),
        )
        .await;
    assert_eq!(status, 200);
    mailbox_with(&d, "bob", 0, 1).await;

    // A token wins over ?user= (even with dev auth on): alice's mailbox, empty.
    let (status, page) = d
        .http_json(
            "GET",
            "/v1/mailbox?user=bob",
            &[("Authorization", &auth)],
            None,
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(page, json!({"entries":[],"next_after":0}));
    let mut ws = d.ws(&format!("token={alice_token}&user=bob"), &[]).await;
    assert_eq!(
        ws.recv().await,
        json!({"type":"ready","user":"alice","after":0})
    );
    // The first delivery is alice's own message, nothing of bob's.
    let (status, _) = d
        .http_json(
            "POST",
            "/v1/messages?user=carol",
            &[],
            Some(br#"{"id":"for-alice","to":["alice"],"body":"for alice"}"#),
        )
        .await;
    assert_eq!(status, 200);
    let m = ws.recv().await;
    assert_eq!(
        (m["type"].as_str(), m["body"].as_str()),
        (Some("deliver"), Some("for alice"))
    );
    // alice's ack cannot touch bob's mailbox.
    let (status, _) = d
        .http_json(
            "POST",
            "/v1/mailbox/ack?user=bob",
            &[("Authorization", &auth)],
            Some(br#"{"seq":100}"#),
        )
        .await;
    assert_eq!(status, 200);
    let page = mailbox_with(&d, "bob", 0, 1).await;
    assert_eq!(page["entries"][0]["body"], "for bob only");

    d.shutdown().await;
}

#[tokio::test]
async fn hostile_frames_get_error_frames_and_the_socket_keeps_working() {
    let d = start().await;
    let mut ws = d.ws_user("alice").await;
    ws.recv().await;

    let mut expect = async |frame: String, code: &str, id: Option<&str>| {
        ws.send_text(&frame).await;
        let e = ws.recv().await;
        assert_eq!(e["type"], "error", "{frame:.80}: {e}");
        assert_eq!(e["code"], code, "{frame:.80}: {e}");
        assert!(e["message"].is_string());
        match id {
            Some(id) => assert_eq!(e["id"], id),
            None => assert!(e.get("id").is_none(), "{e}"),
        }
    };
    expect("{not json".into(), "bad_json", None).await;
    expect("[1,2]".into(), "bad_json", None).await;
    expect(
        r#"{"type":"edit","id":"e-1"}"#.into(),
        "unknown_type",
        Some("e-1"),
    )
    .await;
    expect(r#"{"id":"x"}"#.into(), "bad_request", Some("x")).await;
    let oversized = format!(
        r#"{{"type":"send","id":"big","to":["bob"],"body":"{}"}}"#,
        "x".repeat(70_000)
    );
    expect(oversized, "frame_too_large", None).await;
    let body_too_large = json!({"type":"send","id":"b-1","to":["bob"],"body":"y".repeat(16_385)});
    expect(body_too_large.to_string(), "body_too_large", Some("b-1")).await;
    let many: Vec<String> = (0..101).map(|i| format!("u{i}")).collect();
    let too_many = json!({"type":"send","id":"t-1","to":many,"body":""});
    expect(too_many.to_string(), "too_many_recipients", Some("t-1")).await;
    expect(
        r#"{"type":"send","id":"d-1","to":["bob","bob"],"body":""}"#.into(),
        "bad_recipient",
        Some("d-1"),
    )
    .await;
    expect(
        r#"{"type":"send","id":"","to":["bob"],"body":""}"#.into(),
        "bad_id",
        None,
    )
    .await;
    expect(
        r#"{"type":"ack","seq":281474976710656}"#.into(),
        "seq_out_of_range",
        None,
    )
    .await;
    expect(
        r#"{"type":"sync","after":-1}"#.into(),
        "seq_out_of_range",
        None,
    )
    .await;
    expect(r#"{"type":"ack","seq":1.5}"#.into(), "bad_request", None).await;
    expect(r#"{"type":"ack","seq":"7"}"#.into(), "bad_request", None).await;
    expect(
        r#"{"type":"send","id":"w-1","to":"bob","body":"x"}"#.into(),
        "bad_request",
        Some("w-1"),
    )
    .await;
    expect(
        r#"{"type":"send","id":"w-2","to":["bob"],"body":7}"#.into(),
        "bad_request",
        Some("w-2"),
    )
    .await;
    expect(r#"{"type":7}"#.into(), "bad_request", None).await;
    expect("null".into(), "bad_json", None).await;
    // 10,000 recipients: refused by count (same name repeated fits the frame limit)
    let tenk = json!({"type":"send","id":"t-10k","to":vec!["b"; 10_000],"body":""});
    expect(tenk.to_string(), "too_many_recipients", Some("t-10k")).await;

    ws.send_binary(b"\x00\x01").await;
    let e = ws.recv().await;
    assert_eq!(
        (e["type"].as_str(), e["code"].as_str()),
        (Some("error"), Some("bad_request"))
    );

    // Still usable: a valid send is acked and delivered.
    let o = ws.send_ok("after-errors", &["alice"], "still here").await;
    let m = ws.deliver().await;
    assert_eq!(m["seq"].as_u64().unwrap(), offset_of(&o, "alice"));
    assert_eq!(m["body"], "still here");

    d.shutdown().await;
}

#[tokio::test]
async fn http_send_read_ack_round_trip() {
    let d = start().await;
    let (status, r) = d
        .http_json(
            "POST",
            "/v1/messages?user=alice",
            &[],
            Some(br#"{"id":"h-1","to":["bob"],"body":"over http"}"#),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["id"], "h-1");
    let seq = r["offsets"][shard_of("bob").to_string()].as_u64().unwrap();
    let (_, r2) = d
        .http_json(
            "POST",
            "/v1/messages?user=alice",
            &[],
            Some(br#"{"id":"h-2","to":["bob"],"body":"second"}"#),
        )
        .await;
    let seq2 = r2["offsets"][shard_of("bob").to_string()].as_u64().unwrap();

    let page = mailbox_with(&d, "bob", 0, 2).await;
    assert_eq!(page["entries"][0]["seq"].as_u64().unwrap(), seq);
    assert_eq!(page["entries"][0]["from"], "alice");
    assert_eq!(page["entries"][0]["body"], "over http");
    assert!(page["entries"][0]["sent_at_us"].as_u64().unwrap() > 0);
    assert_eq!(page["next_after"].as_u64().unwrap(), seq2);

    // Paging: limit=1.
    let (status, p1) = d
        .http_json("GET", "/v1/mailbox?user=bob&limit=1", &[], None)
        .await;
    assert_eq!(status, 200);
    assert_eq!(p1["entries"].as_array().unwrap().len(), 1);
    assert_eq!(p1["next_after"].as_u64().unwrap(), seq);

    // Ack the first; the default `after` is now the acked cursor.
    let (status, a) = d
        .http_json(
            "POST",
            "/v1/mailbox/ack?user=bob",
            &[],
            Some(format!(r#"{{"seq":{seq}}}"#).as_bytes()),
        )
        .await;
    assert_eq!((status, a), (200, json!({"acked":seq})));
    let (_, p) = d.http_json("GET", "/v1/mailbox?user=bob", &[], None).await;
    assert_eq!(p["entries"].as_array().unwrap().len(), 1);
    assert_eq!(p["entries"][0]["seq"].as_u64().unwrap(), seq2);
    // An ack never moves back, and never passes the lane's W.
    let (_, a) = d
        .http_json(
            "POST",
            "/v1/mailbox/ack?user=bob",
            &[],
            Some(br#"{"seq":1}"#),
        )
        .await;
    assert_eq!(a, json!({"acked":seq}));
    let (_, a) = d
        .http_json(
            "POST",
            "/v1/mailbox/ack?user=bob",
            &[],
            Some(br#"{"seq":1000000000}"#),
        )
        .await;
    // (bob's shard holds only these two records: its W is seq2)
    let acked = a["acked"].as_u64().unwrap();
    assert_eq!(acked, seq2, "{a}");
    let (_, p) = d.http_json("GET", "/v1/mailbox?user=bob", &[], None).await;
    assert_eq!(p, json!({"entries":[],"next_after":acked}));

    // Errors: JSON error bodies with the code's status.
    // (method, path, body, status, code)
    type Case = (
        &'static str,
        &'static str,
        Option<Vec<u8>>,
        u16,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "POST",
            "/v1/messages?user=alice",
            Some(b"{".to_vec()),
            400,
            "bad_json",
        ),
        (
            "POST",
            "/v1/messages?user=alice",
            Some(br#"{"id":"x","to":[],"body":""}"#.to_vec()),
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/messages?user=alice",
            Some(vec![b' '; 70_000]),
            413,
            "frame_too_large",
        ),
        (
            "GET",
            "/v1/mailbox?user=bob&limit=0",
            None,
            400,
            "bad_request",
        ),
        (
            "GET",
            "/v1/mailbox?user=bob&after=-1",
            None,
            400,
            "seq_out_of_range",
        ),
        (
            "GET",
            "/v1/mailbox?user=bob&after=1&after=2",
            None,
            400,
            "bad_request",
        ),
        (
            "POST",
            "/v1/mailbox/ack?user=bob",
            Some(br#"{"seq":"1"}"#.to_vec()),
            400,
            "bad_request",
        ),
        ("GET", "/v1/nope?user=bob", None, 404, "not_found"),
        // credentials are checked first: an anonymous caller learns nothing about paths
        ("GET", "/v1/nope", None, 401, "unauthorized"),
        ("DELETE", "/v1/mailbox", None, 401, "unauthorized"),
        // the JSON body for a wrong method too
        (
            "GET",
            "/v1/messages?user=bob",
            None,
            405,
            "method_not_allowed",
        ),
        (
            "DELETE",
            "/v1/mailbox?user=bob",
            None,
            405,
            "method_not_allowed",
        ),
    ];
    for (method, path, body, want_status, want_code) in cases {
        let (status, v) = d.http_json(method, path, &[], body.as_deref()).await;
        assert_eq!(status, want_status, "{method} {path}: {v}");
        assert_eq!(v["error"]["code"], want_code, "{method} {path}: {v}");
    }

    d.shutdown().await;
}

#[tokio::test]
async fn metrics_healthz_and_shutdown_closes_sockets() {
    let d = start().await;
    let mut ws = d.ws_user("alice").await;
    ws.recv().await;
    ws.send_ok("m-1", &["alice"], "x").await;
    ws.deliver().await;

    let (status, text) = d.http("GET", "/metrics", &[], None).await;
    assert_eq!(status, 200);
    for name in [
        "tidemark_commits_total",
        "tidemark_send_ack_seconds",
        "tidemark_delivery_latency_seconds",
        "tidemark_connected_clients",
        "tidemark_shard_min_w",
    ] {
        assert!(text.contains(name), "{name} missing from /metrics:\n{text}");
    }
    let (status, text) = d.http("GET", "/healthz", &[], None).await;
    assert_eq!((status, text.as_str()), (200, "ok"));

    // Shutdown: the socket is closed with 1001 and serve() returns after joining its tasks.
    d.cancel.cancel();
    assert_eq!(ws.closed().await, Some(1001));
    d.shutdown().await;
}

#[tokio::test]
async fn live_delivery_is_woken_by_hints_not_the_recheck() {
    // A re-check far beyond the wait: only a wake hint can deliver in time.
    let d = start_with(|o| o.recheck_interval = Duration::from_secs(60)).await;
    let mut bob = d.ws_user("bob").await;
    bob.recv().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    for i in 0..5 {
        let o = alice.send_ok(&format!("w{i}"), &["bob"], "ping").await;
        let m = bob.deliver().await;
        assert_eq!(m["seq"].as_u64().unwrap(), offset_of(&o, "bob"));
    }
    d.shutdown().await;
}

#[tokio::test]
async fn a_full_commit_pipeline_answers_overloaded_and_the_retry_succeeds() {
    let d = start_with(|o| o.max_inflight_commits = 1).await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let mut carol = d.ws_user("carol").await;
    carol.recv().await;

    // Pause the core: alice's commit holds the only permit until it resumes.
    let client = redis::Client::open(d.core_url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(1500)
        .arg("ALL")
        .query_async(&mut c)
        .await
        .unwrap();
    alice
        .send_json(&json!({"type":"send","id":"a-1","to":["bob"],"body":"first"}))
        .await;
    alice.barrier().await; // alice's send holds the permit now
    let r = carol.send_msg("c-1", &["bob"], "second").await;
    assert_eq!(r["type"], "error", "{r}");
    assert_eq!(r["code"], "overloaded");
    assert_eq!(r["id"], "c-1");
    // HTTP too: 503.
    let (status, v) = d
        .http_json(
            "POST",
            "/v1/messages?user=carol",
            &[],
            Some(br#"{"id":"c-1","to":["bob"],"body":"second"}"#),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("overloaded"))
    );

    // Once the core resumes, alice is acked and carol's retry (same id) goes through.
    let a = alice.recv_type("send_ack").await;
    assert_eq!(a["id"], "a-1");
    let o = carol.send_ok("c-1", &["bob"], "second").await;
    assert!(offset_of(&o, "bob") > a["offsets"][shard_of("bob").to_string()].as_u64().unwrap());
    d.shutdown().await;
}

/// A shard whose log has assigned its last u48 offset refuses further sends: `log_exhausted`
/// over WebSocket, 507 over HTTP, not retryable; nothing is written there, other shards go on.
#[tokio::test]
async fn a_send_to_an_exhausted_log_gets_log_exhausted_and_507() {
    let d = start().await;
    const U48_MAX: u64 = (1 << 48) - 1;
    let client = redis::Client::open(d.core_url.as_str()).unwrap();
    let mut core = client.get_multiplexed_async_connection().await.unwrap();
    let full = shard_of("bob");
    let head = format!("head:{{{full}}}");
    let () = redis::cmd("SET")
        .arg(&head)
        .arg(U48_MAX)
        .query_async(&mut core)
        .await
        .unwrap();
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;

    let r = alice.send_msg("x-1", &["bob"], "no room").await;
    assert_eq!(r["type"], "error", "{r}");
    assert_eq!(r["code"], "log_exhausted", "{r}");
    assert_eq!(r["id"], "x-1");
    let code: tidemark_protocol::ErrorCode = "log_exhausted".parse().unwrap();
    assert!(!code.retryable());
    // the connection keeps working
    alice.barrier().await;

    let (status, v) = d
        .http_json(
            "POST",
            "/v1/messages?user=alice",
            &[],
            Some(br#"{"id":"x-2","to":["bob"],"body":"no room"}"#),
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (507, Some("log_exhausted")),
        "{v}"
    );

    // nothing written in the full shard: head as it was, no record
    let (h, len): (u64, u64) = redis::pipe()
        .cmd("GET")
        .arg(&head)
        .cmd("XLEN")
        .arg(format!("dlog:{{{full}}}"))
        .query_async(&mut core)
        .await
        .unwrap();
    assert_eq!((h, len), (U48_MAX, 0));

    // a send that also touches the full shard is refused as a whole (the other shard may have
    // committed: see docs/protocol.md); a send to other shards goes through and is delivered
    let other = users_in_distinct_shards("o", 2)
        .into_iter()
        .find(|u| shard_of(u) != full)
        .unwrap();
    let r = alice
        .send_msg("x-3", &["bob", other.as_str()], "partly")
        .await;
    assert_eq!(r["code"], "log_exhausted", "{r}");
    let mut o = d.ws_user(&other).await;
    o.recv().await;
    let offsets = alice.send_ok("x-4", &[other.as_str()], "fine").await;
    let seq = offset_of(&offsets, &other);
    let m = o
        .recv_where(|v| v["type"] == "deliver" && v["body"] == "fine")
        .await;
    assert_eq!(m["seq"].as_u64().unwrap(), seq);
    d.shutdown().await;
}

/// docs/protocol.md, "Sends that touch several shards": a send whose commit fails in one
/// shard after another committed gets `internal`, not `send_ack`, yet the committed shard's
/// recipient receives it; a retry with the same id completes it, each recipient once.
#[tokio::test]
async fn a_partly_committed_send_is_completed_by_a_retry_with_the_same_id() {
    let d = start().await;
    let rs = users_in_distinct_shards("p", 2);
    let (ok, broken) = (&rs[0], &rs[1]);
    let client = redis::Client::open(d.core_url.as_str()).unwrap();
    let mut core = client.get_multiplexed_async_connection().await.unwrap();
    // the commit script fails in `broken`'s shard (its head is not a number)
    let head = format!("head:{{{}}}", shard_of(broken));
    let () = redis::cmd("SET")
        .arg(&head)
        .arg("not a number")
        .query_async(&mut core)
        .await
        .unwrap();
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let r = alice
        .send_msg("p-1", &[ok.as_str(), broken.as_str()], "partly")
        .await;
    assert_eq!(
        (r["type"].as_str(), r["code"].as_str()),
        (Some("error"), Some("internal"))
    );
    // no send_ack, but the shard that committed delivers
    let page = mailbox_with(&d, ok, 0, 1).await;
    let first_seq = page["entries"][0]["seq"].as_u64().unwrap();
    assert_eq!(page["entries"][0]["body"], "partly");

    // the shard recovers; the retry with the same id completes the send
    let () = redis::cmd("DEL")
        .arg(&head)
        .query_async(&mut core)
        .await
        .unwrap();
    let offsets = alice
        .send_ok("p-1", &[ok.as_str(), broken.as_str()], "partly")
        .await;
    assert_eq!(offsets.len(), 2);
    assert_eq!(offset_of(&offsets, ok), first_seq, "not committed twice");
    let page = mailbox_with(&d, broken, 0, 1).await;
    assert_eq!(
        page["entries"][0]["seq"].as_u64(),
        Some(offset_of(&offsets, broken))
    );
    // exactly once in each mailbox
    for u in [ok, broken] {
        let (_, page) = d
            .http_json("GET", &format!("/v1/mailbox?after=0&user={u}"), &[], None)
            .await;
        assert_eq!(page["entries"].as_array().unwrap().len(), 1, "{u}: {page}");
    }
    d.shutdown().await;
}

/// User ids and client ids refuse control characters (U+0000–U+001F, U+007F): as the caller
/// (dev auth) `unauthorized`, as a recipient `bad_recipient`, as a client id `bad_id`.
#[tokio::test]
async fn control_characters_in_ids_are_refused() {
    let d = start().await;
    for user in ["a%00b", "a%0A", "%7F"] {
        match d.try_ws(&format!("user={user}"), &[]).await {
            Ok(_) => panic!("{user}: upgraded"),
            Err((status, body)) => {
                assert_eq!(status, 401, "{user}: {body}");
                assert!(body.contains("unauthorized"), "{body}");
            }
        }
        let (status, v) = d
            .http_json("GET", &format!("/v1/mailbox?user={user}"), &[], None)
            .await;
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (401, Some("unauthorized"))
        );
    }
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    alice
        .send_json(&json!({"type":"send","id":"c\u{0}1","to":["bob"],"body":""}))
        .await;
    let r = alice.recv_type("error").await;
    assert_eq!(r["code"], "bad_id", "{r}");
    assert!(r.get("id").is_none(), "an invalid id is not echoed: {r}");
    let r = alice.send_msg("c-1", &["bob", "a\u{0}b"], "").await;
    assert_eq!(
        (r["type"].as_str(), r["code"].as_str()),
        (Some("error"), Some("bad_recipient"))
    );
    let r = alice.send_msg("c-2", &["bob\u{1f}"], "").await;
    assert_eq!(r["code"], "bad_recipient", "{r}");
    // a body may hold anything
    alice.send_ok("c-3", &["bob"], "line\n\u{0}end").await;
    for (body, code) in [
        (json!({"id":"c\u{7f}","to":["bob"],"body":""}), "bad_id"),
        (
            json!({"id":"c-4","to":["a\u{0}b"],"body":""}),
            "bad_recipient",
        ),
    ] {
        let (status, v) = d
            .http_json(
                "POST",
                "/v1/messages?user=alice",
                &[],
                Some(body.to_string().as_bytes()),
            )
            .await;
        assert_eq!((status, v["error"]["code"].as_str()), (400, Some(code)));
    }
    d.shutdown().await;
}

#[tokio::test]
async fn shutdown_does_not_wait_for_a_client_that_never_reads() {
    let d = start().await;
    let bob = d.ws_user("bob").await; // never reads
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    // Enough to fill bob's socket buffers and his connection's frame queue.
    let body = "z".repeat(16_000);
    let n = 1500;
    for i in 0..n {
        alice
            .send_json(&json!({"type":"send","id":format!("f{i}"),"to":["bob"],"body":body}))
            .await;
        if i % 100 == 99 {
            alice.barrier().await;
        }
    }
    let mut last = 0;
    for _ in 0..n {
        let a = alice.recv_type("send_ack").await;
        last = a["offsets"][shard_of("bob").to_string()].as_u64().unwrap();
    }
    // Materialized (so bob's delivery loop is pushing into a full queue).
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (_, page) = d
            .http_json(
                "GET",
                &format!("/v1/mailbox?user=bob&limit=1&after={}", last - 1),
                &[],
                None,
            )
            .await;
        if !page["entries"].as_array().unwrap().is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never materialized");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = std::time::Instant::now();
    d.shutdown().await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    drop(bob);
}

// ---- issue 11: acks, dedupe expiry, stuck shards -------------------------------------------

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use gateway_support::route;
use tidemark_server::materializer::{ChunkFault, MaterializerOptions};

/// Fails every chunk of one lane of one shard while `on`: that lane's W stays behind.
struct HoldLane {
    shard: u32,
    lane: usize,
    on: AtomicBool,
}

impl ChunkFault for HoldLane {
    fn fail(&self, shard: u32, _offset: u64, lane: usize, _attempt: u32) -> bool {
        shard == self.shard && lane == self.lane && self.on.load(Ordering::SeqCst)
    }
}

/// A deployment whose materializer holds `user`'s lane while the returned switch is on.
async fn start_holding(
    user: &str,
    on: bool,
    tweak: impl FnOnce(&mut tidemark_server::gateway::GatewayOptions),
) -> (Deployment, Arc<HoldLane>) {
    let r = route(user);
    let fault = Arc::new(HoldLane {
        shard: r.shard,
        lane: r.lane,
        on: AtomicBool::new(on),
    });
    let opts = MaterializerOptions {
        fault: Some(fault.clone()),
        ..MaterializerOptions::default()
    };
    (start_full(tweak, opts).await, fault)
}

/// A user of `user`'s shard in another lane.
fn neighbour_of(user: &str) -> String {
    let r = route(user);
    (0..)
        .map(|i| format!("n{i}"))
        .find(|u| {
            let q = route(u);
            q.shard == r.shard && q.lane != r.lane
        })
        .unwrap()
}

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The W of `user`'s lane, read from Redis.
async fn lane_w(d: &Deployment, user: &str) -> u64 {
    let r = route(user);
    let mut st = tidemark_store::redis::store::MailboxStore::connect(
        &d.mailbox_url,
        tidemark_store::redis::watermark::Layout::PackedV2,
    )
    .await
    .unwrap();
    st.read_watermark(r.shard)
        .await
        .unwrap()
        .lanes
        .lane(r.lane)
        .w
}

/// `user`'s acked cursor and the seqs (scores) of its mailbox, read from Redis.
async fn redis_mailbox(d: &Deployment, user: &str) -> (u64, Vec<u64>) {
    let s = shard_of(user);
    let mut c = redis_conn(&d.mailbox_url).await;
    let acked: Option<u64> = redis::cmd("HGET")
        .arg(tidemark_store::keys::acks(s))
        .arg(user)
        .query_async(&mut c)
        .await
        .unwrap();
    let seqs: Vec<(Vec<u8>, u64)> = redis::cmd("ZRANGE")
        .arg(tidemark_store::keys::mailbox(s, user))
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut c)
        .await
        .unwrap();
    (
        acked.unwrap_or(0),
        seqs.into_iter().map(|(_, s)| s).collect(),
    )
}

/// Issue 11, item 3: an HTTP ack above what is visible is capped at exactly the W of the
/// user's lane, not at the shard's head or its highest lane. Bob's lane is held (its chunks
/// fail) at `s1` while his neighbour's lane reaches `s3`, the shard's head.
#[tokio::test]
async fn an_http_ack_is_capped_at_exactly_the_lanes_w() {
    let (d, fault) = start_holding("bob", false, |_| {}).await;
    let n = neighbour_of("bob");
    let (_, r) = d
        .http_json(
            "POST",
            "/v1/messages?user=alice",
            &[],
            Some(br#"{"id":"k-1","to":["bob"],"body":"one"}"#),
        )
        .await;
    let s1 = r["offsets"][shard_of("bob").to_string()].as_u64().unwrap();
    mailbox_with(&d, "bob", 0, 1).await;
    fault.on.store(true, Ordering::SeqCst);
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    alice.send_ok("k-2", &["bob", n.as_str()], "two").await;
    let o3 = alice.send_ok("k-3", &[n.as_str()], "three").await;
    let s3 = offset_of(&o3, &n);
    mailbox_with(&d, &n, 0, 2).await; // the neighbour's lane is at s3
    assert_eq!(lane_w(&d, "bob").await, s1, "bob's lane is held");
    assert!(s1 < s3);

    let (status, a) = d
        .http_json(
            "POST",
            "/v1/mailbox/ack?user=bob",
            &[],
            Some(br#"{"seq":1000000000}"#),
        )
        .await;
    assert_eq!((status, a), (200, json!({ "acked": s1 })));
    assert_eq!(redis_mailbox(&d, "bob").await, (s1, vec![]));

    // the lane catches up: bob gets record 2, and the cap follows his lane's W
    fault.on.store(false, Ordering::SeqCst);
    let page = mailbox_with(&d, "bob", s1, 1).await;
    assert_eq!(page["entries"][0]["body"], "two");
    let w = lane_w(&d, "bob").await;
    assert_eq!(
        w, s3,
        "record 3 has no recipient in bob's lane: the lane passes it"
    );
    let (_, a) = d
        .http_json(
            "POST",
            "/v1/mailbox/ack?user=bob",
            &[],
            Some(br#"{"seq":1000000000}"#),
        )
        .await;
    assert_eq!(a, json!({ "acked": w }));
    d.shutdown().await;
}

/// Issue 11, item 5: an ack trims the mailbox in Redis: entries at or below the acked seq are
/// gone, the ones above it stay (WebSocket and HTTP acks alike).
#[tokio::test]
async fn acks_trim_the_mailbox_in_redis() {
    let d = start().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let mut bob = d.ws_user("bob").await;
    bob.recv().await;
    let mut seqs = Vec::new();
    for i in 0..4 {
        let o = alice.send_ok(&format!("t{i}"), &["bob"], "x").await;
        seqs.push(offset_of(&o, "bob"));
    }
    for s in &seqs {
        assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), *s);
    }
    assert_eq!(redis_mailbox(&d, "bob").await, (0, seqs.clone()));
    bob.send_json(&json!({"type":"ack","seq":seqs[1]})).await;
    bob.close().await; // a pending (coalesced) ack is written on close
    let deadline = tokio::time::Instant::now() + WAIT;
    while redis_mailbox(&d, "bob").await.0 != seqs[1] {
        assert!(tokio::time::Instant::now() < deadline, "ack never written");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        redis_mailbox(&d, "bob").await,
        (seqs[1], seqs[2..].to_vec()),
        "entries at or below the ack are gone, the ones above kept"
    );
    let (_, a) = d
        .http_json(
            "POST",
            "/v1/mailbox/ack?user=bob",
            &[],
            Some(format!(r#"{{"seq":{}}}"#, seqs[2]).as_bytes()),
        )
        .await;
    assert_eq!(a["acked"].as_u64(), Some(seqs[2]));
    assert_eq!(redis_mailbox(&d, "bob").await, (seqs[2], vec![seqs[3]]));
    d.shutdown().await;
}

/// Issue 11, item 11: coalesced acks are written by the 50 ms flush timer on their own. The
/// first ack is written at once; the second, right after it, is coalesced; then the client
/// sends nothing more and keeps the socket open: the acked cursor in Redis reaches the second
/// seq within a few flush periods anyway.
#[tokio::test]
async fn a_coalesced_ack_is_flushed_by_the_timer_with_the_socket_open() {
    let d = start().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let mut bob = d.ws_user("bob").await;
    bob.recv().await;
    let mut seqs = Vec::new();
    for i in 0..3 {
        let o = alice.send_ok(&format!("f{i}"), &["bob"], "x").await;
        seqs.push(offset_of(&o, "bob"));
    }
    for s in &seqs {
        assert_eq!(bob.deliver().await["seq"].as_u64().unwrap(), *s);
    }
    // more than a flush period since the connection opened: the first ack is written at once
    tokio::time::sleep(Duration::from_millis(100)).await;
    bob.send_json(&json!({"type":"ack","seq":seqs[0]})).await;
    bob.send_json(&json!({"type":"ack","seq":seqs[1]})).await;
    let sent = std::time::Instant::now();
    let mut took = None;
    while sent.elapsed() < Duration::from_secs(2) {
        if redis_mailbox(&d, "bob").await.0 == seqs[1] {
            took = Some(sent.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = took.expect("the coalesced ack was never written while the socket stayed open");
    println!("coalesced ack written {took:?} after it was sent");
    assert!(took < Duration::from_millis(500), "{took:?}");
    // the socket is still open and usable
    bob.barrier().await;
    assert_eq!(redis_mailbox(&d, "bob").await, (seqs[1], vec![seqs[2]]));
    d.shutdown().await;
}

/// Issue 11, item 6: dedupe records expire. Every record a send writes on core Redis (the id
/// claim on the sender's shard, the dedupe record of each shard touched) has a TTL of at most
/// 24 hours; once they are gone (here shortened to 1 ms), a resend with the same id commits a
/// second copy, as docs/protocol.md says.
#[tokio::test]
async fn a_resend_after_the_dedupe_records_expired_commits_anew() {
    use tidemark_store::keys;
    let d = start().await;
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    let rs = users_in_distinct_shards("d", 2);
    let to: Vec<&str> = rs.iter().map(String::as_str).collect();
    let first = alice.send_ok("e-1", &to, "again?").await;
    assert_eq!(alice.send_ok("e-1", &to, "again?").await, first, "deduped");
    let mut core = redis_conn(&d.core_url).await;
    let mut records = vec![keys::message_id(shard_of("alice"), "alice", "e-1")];
    for u in &rs {
        records.push(keys::dedupe(shard_of(u), "alice", "e-1"));
    }
    for k in &records {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(k)
            .query_async(&mut core)
            .await
            .unwrap();
        assert!(
            ttl > 0 && ttl <= 24 * 3600 * 1000,
            "{k:?}: PTTL {ttl} (-1: no TTL, -2: missing)"
        );
        let () = redis::cmd("PEXPIRE")
            .arg(k)
            .arg(1)
            .query_async(&mut core)
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let again = alice.send_ok("e-1", &to, "again?").await;
    for u in &rs {
        assert!(
            offset_of(&again, u) > offset_of(&first, u),
            "{u}: a new commit: {first:?} then {again:?}"
        );
        let page = mailbox_with(&d, u, 0, 2).await;
        let bodies: Vec<&str> = page["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["body"].as_str().unwrap())
            .collect();
        assert_eq!(bodies, ["again?", "again?"], "{u}: delivered twice");
    }
    d.shutdown().await;
}

/// Issue 11, item 9: `/healthz` reports a shard whose W stays below its head without moving
/// for `stuck_after` (here 300 ms): bob's lane is held by failing chunks after one record, so
/// W stops at 0 with the head at 1; once the fault is lifted, W moves and `/healthz` is 200.
#[tokio::test]
async fn healthz_reports_a_stuck_shard_and_recovers() {
    let (d, fault) =
        start_holding("bob", true, |o| o.stuck_after = Duration::from_millis(300)).await;
    let n = neighbour_of("bob");
    let (status, text) = d.http("GET", "/healthz", &[], None).await;
    assert_eq!((status, text.as_str()), (200, "ok"));
    let mut alice = d.ws_user("alice").await;
    alice.recv().await;
    // (W moves last when the other lanes take the record: after this instant)
    let sent = std::time::Instant::now();
    let o = alice.send_ok("st-1", &["bob", n.as_str()], "held").await;
    let s = shard_of("bob");
    let head = offset_of(&o, "bob");
    let want = format!("shard {s}: stuck at W=0 with head {head} for ");
    let deadline = tokio::time::Instant::now() + WAIT;
    let (status, text) = loop {
        let (status, text) = d.http("GET", "/healthz", &[], None).await;
        if status != 200 {
            break (status, text);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never reported stuck"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(sent.elapsed() >= Duration::from_millis(300), "{text}");
    assert_eq!(status, 503, "{text}");
    assert!(text.starts_with(&want), "{text}");
    assert_eq!(text.lines().count(), 1, "only that shard: {text}");
    fault.on.store(false, Ordering::SeqCst);
    let deadline = tokio::time::Instant::now() + WAIT;
    while d.http("GET", "/healthz", &[], None).await.0 != 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never healthy again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    d.shutdown().await;
}
