//! Slow, idle and greedy clients against a real deployment (issue 9; ADR-0025): token expiry
//! on an open WebSocket, header-read timeout, connection caps, ping/idle timeout, outbound
//! byte budgets, mailbox page caps, per-user connection caps, fair commit admission and the
//! per-user send rate.

mod gateway_support;

use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gateway_support::{
    assert_error, now_unix, poll, start, start_with, token_for, until, Deployment, SECRET, WAIT,
};
use serde_json::Value;
use tidemark_protocol::token;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the server closes the connection (EOF or reset) or `limit` passes; returns
/// the bytes read and whether it closed.
async fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let until = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(until, s.read(&mut buf)).await {
            Err(_) => return (got, false),
            Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// A WebSocket handshake on a raw socket (dev auth as `user`); returns the socket after the
/// 101 head, so the test decides what (not) to read and answer.
async fn raw_ws(addr: SocketAddr, user: &str) -> TcpStream {
    raw_ws_on(TcpStream::connect(addr).await.expect("connect"), addr, user).await
}

/// A socket with a 4 KiB receive buffer: a peer that does not read fills it at once.
async fn small_window(addr: SocketAddr) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    sock.connect(addr).await.expect("connect")
}

/// The server's WebSocket frames (unmasked) in `b`: (opcode, payload); a cut frame at the end
/// is left out.
fn ws_frames(mut b: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    while b.len() >= 2 {
        let op = b[0] & 0x0f;
        let (len, head) = match b[1] & 0x7f {
            126 if b.len() >= 4 => (u16::from_be_bytes([b[2], b[3]]) as usize, 4),
            127 if b.len() >= 10 => (
                u64::from_be_bytes(b[2..10].try_into().unwrap()) as usize,
                10,
            ),
            126 | 127 => break,
            n => (n as usize, 2),
        };
        if b.len() < head + len {
            break;
        }
        out.push((op, b[head..head + len].to_vec()));
        b = &b[head + len..];
    }
    out
}

/// Commits `n` messages of `body_len` bytes to `to` over HTTP and waits until the last one
/// is visible in the mailbox; returns the seqs.
async fn fill_mailbox(d: &Deployment, to: &str, n: usize, body_len: usize) -> Vec<u64> {
    let body = "z".repeat(body_len);
    let mut seqs = Vec::new();
    for i in 0..n {
        let req = serde_json::json!({"id": format!("fill-{i}"), "to": [to], "body": body});
        let (status, v) = d.post_message("filler", req.to_string().as_bytes()).await;
        assert_eq!(status, 200, "{v}");
        let offsets = v["offsets"].as_object().unwrap();
        seqs.push(offsets.values().next().unwrap().as_u64().unwrap());
    }
    d.wait_visible(to, *seqs.last().unwrap()).await;
    seqs
}

/// A WebSocket handshake on `s` (dev auth as `user`); returns it after the 101 head.
async fn raw_ws_on(mut s: TcpStream, addr: SocketAddr, user: &str) -> TcpStream {
    let req = format!(
        "GET /v1/ws?user={user} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Version: 13\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.expect("write handshake");
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(WAIT, s.read(&mut b))
            .await
            .expect("handshake answered")
            .expect("read handshake");
        assert_eq!(
            n,
            1,
            "closed during the handshake: {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    s
}

/// The status and body of a raw HTTP response.
fn status_and_body(resp: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(resp);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad response: {text:?}"));
    (status, body.to_string())
}

/// Polls `/metrics` until `line` (a metric with its labels) is at least `n`.
async fn metric_reaches(d: &Deployment, line: &str, n: f64) {
    until(&format!("{line} to reach {n}"), || async {
        let (_, text) = d.get_text("/metrics").await;
        let v = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(line)
                    .and_then(|r| r.trim().parse::<f64>().ok())
            })
            .unwrap_or(0.0);
        v >= n
    })
    .await
}

#[tokio::test]
async fn a_websocket_is_closed_with_4001_when_its_token_expires() {
    let d = start().await;
    let exp = now_unix() + 2;
    let short = token::sign(SECRET, "alice", exp);
    let mut ws = d.ready_query(&format!("token={short}")).await;
    // Same user, a long-lived token and a dev-auth connection: both stay open.
    let mut long = d
        .ready_query(&format!("token={}", token_for("alice")))
        .await;
    let mut dev = d.ready("alice").await;

    let opened = Instant::now();
    let e: Value = ws.recv_type("error").await;
    assert_eq!(e["code"], "token_expired", "{e}");
    assert_eq!(ws.closed().await, Some(4001));
    let after = opened.elapsed();
    assert!(
        SystemTime::now() >= UNIX_EPOCH + Duration::from_secs(exp),
        "closed before exp"
    );
    assert!(
        after < Duration::from_secs(4),
        "closed {after:?} after opening"
    );
    eprintln!("token with exp in ≤ 2 s: closed {after:?} after opening");

    // The expired token cannot reconnect; a new one can.
    let (status, body) = d.refused(&format!("token={short}"), &[]).await;
    assert_eq!(status, 401);
    assert!(body.contains("token_expired"), "{body}");
    let _again = d
        .ready_query(&format!("token={}", token_for("alice")))
        .await;

    // The others were not touched.
    long.barrier().await;
    dev.barrier().await;
    d.shutdown().await;
}

#[tokio::test]
async fn half_sent_requests_are_closed_after_the_header_read_timeout() {
    let timeout = Duration::from_secs(1);
    let d = start_with(|o| o.header_read_timeout = timeout).await;
    // 200 connections with half a request head each, and one that sends nothing. Times are
    // taken from before the first connect (no socket can be closed earlier than its timeout
    // after it) and from after the last (all must be closed within the timeout plus slack,
    // however long a loaded machine took to open them).
    let t0 = Instant::now();
    let mut socks = Vec::new();
    for _ in 0..200 {
        let mut s = TcpStream::connect(d.addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await
            .unwrap();
        socks.push(s);
    }
    let mut silent = TcpStream::connect(d.addr).await.unwrap();
    let started = Instant::now();
    let opening = started - t0;
    // Meanwhile the gateway answers.
    let (status, body) = d.get_text("/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok"));

    let (_, closed) = read_until_closed(&mut socks[0], WAIT).await;
    let first = t0.elapsed();
    assert!(closed, "a half-sent request was not closed within {WAIT:?}");
    for s in &mut socks[1..] {
        let (_, closed) = read_until_closed(s, Duration::from_secs(2)).await;
        assert!(closed, "a half-sent request stayed open");
    }
    let all = started.elapsed();
    let (_, closed) = read_until_closed(&mut silent, Duration::from_secs(2)).await;
    assert!(closed, "a silent connection stayed open");
    eprintln!("header-read timeout {timeout:?}: first half-sent request closed {first:?} after its connect, all 200 {all:?} after the last connect (opening them took {opening:?})");
    assert!(first >= timeout - Duration::from_millis(100), "{first:?}");
    assert!(all < timeout + Duration::from_secs(2), "{all:?}");

    // A body that trickles is refused once the same time has passed.
    let mut slow = TcpStream::connect(d.addr).await.unwrap();
    slow.write_all(
        b"POST /v1/messages?user=a HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{\"id\"",
    )
    .await
    .unwrap();
    let t = Instant::now();
    let (resp, _) = read_until_closed(&mut slow, WAIT).await;
    let (status, body) = status_and_body(&resp);
    assert_eq!(status, 400, "{body}");
    assert!(
        t.elapsed() >= timeout - Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );

    // A keep-alive connection that goes quiet after a response is closed the same way.
    let mut ka = TcpStream::connect(d.addr).await.unwrap();
    ka.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (resp, closed) = read_until_closed(&mut ka, timeout * 3).await;
    assert!(closed, "an idle keep-alive connection stayed open");
    assert_eq!(status_and_body(&resp).0, 200);
    d.shutdown().await;
}

#[tokio::test]
async fn connections_beyond_the_cap_get_503_and_healthz_still_answers() {
    let cap = 4;
    let d = start_with(|o| {
        o.max_connections = cap;
        o.health_reserve = 2;
    })
    .await;
    // Four WebSockets fill the cap (they count for as long as they are open).
    let mut held = d.ready_all((0..cap).map(|i| format!("u{i}"))).await;
    // Above the cap: health and metrics answer, everything else is 503 `overloaded`.
    let (status, body) = d.get_text("/healthz").await;
    assert_eq!((status, body.as_str()), (200, "ok"));
    assert_eq!(d.get_text("/metrics").await.0, 200);
    assert_error(&d.get("/v1/mailbox?user=u0").await, 503, "overloaded");
    // a WebSocket above the cap is refused
    let (status, body) = d.refused("user=u9", &[]).await;
    assert_eq!(status, 503, "{body}");

    // Fill the reserve with silent sockets: the next connection gets a 503 written raw.
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(TcpStream::connect(d.addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await; // accepted
    let mut s = TcpStream::connect(d.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (resp, closed) = read_until_closed(&mut s, WAIT).await;
    assert!(closed);
    let (status, body) = status_and_body(&resp);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("overloaded"), "{body}");
    drop(silent);
    metric_reaches(&d, "tidemark_connections_refused_total", 4.0).await;

    // A closed WebSocket frees its slot.
    held.pop().unwrap().close().await;
    until("the slot was never freed", || async {
        d.get_text("/v1/mailbox?user=u0").await.0 == 200
    })
    .await;
    d.shutdown().await;
}

#[tokio::test]
async fn a_websocket_that_answers_no_ping_is_closed_with_4002() {
    let d = start_with(|o| {
        o.ping_interval = Duration::from_millis(200);
        o.idle_timeout = Duration::from_secs(1);
    })
    .await;
    // A client that reads but never answers: pings, then 4002 after the idle timeout.
    let mut mute = raw_ws(d.addr, "mute").await;
    let started = Instant::now();
    // A client library answers pings by itself: it stays.
    let mut polite = d.ready("polite").await;

    // Both at once: the polite client must be polled to answer its pings.
    let ((bytes, closed, after), polite_got) = tokio::join!(
        async {
            let (bytes, closed) = read_until_closed(&mut mute, WAIT).await;
            (bytes, closed, started.elapsed())
        },
        polite.quiet_for(Duration::from_secs(3)),
    );
    assert!(polite_got.is_empty(), "{polite_got:?}");
    assert!(closed, "the mute client was not closed");
    assert!(
        bytes.windows(2).any(|w| w == [0x89, 0x00]),
        "no ping frame seen"
    );
    // close frame: FIN+close opcode, length, then the code 4002 big-endian
    let close = bytes
        .windows(2)
        .position(|w| w[0] == 0x88)
        .expect("a close frame");
    assert_eq!(&bytes[close + 2..close + 4], &4002u16.to_be_bytes());
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(3),
        "{after:?}"
    );
    eprintln!("idle timeout 1 s: the mute client was closed after {after:?}");

    polite.barrier().await;
    metric_reaches(&d, "tidemark_ws_closes_total{code=\"idle_timeout\"}", 1.0).await;
    d.shutdown().await;
}

#[tokio::test]
async fn a_websocket_that_does_not_read_is_closed_with_4003_and_loses_nothing() {
    let grace = Duration::from_secs(1);
    let d = start_with(|o| {
        o.max_queued_bytes = 64 * 1024;
        o.slow_client_grace = grace;
    })
    .await;
    // More than the socket buffers, the writer's buffer and the queue can hold.
    let seqs = fill_mailbox(&d, "bob", 300, 16_000).await;
    let mut bob = raw_ws_on(small_window(d.addr).await, d.addr, "bob").await;
    let started = Instant::now();
    metric_reaches(&d, "tidemark_ws_closes_total{code=\"slow_consumer\"}", 1.0).await;
    let decided = started.elapsed();
    assert!(decided >= grace, "closed after {decided:?}");
    // Reading now: what was already in the socket, then the close frame 4003.
    let (bytes, closed) = read_until_closed(&mut bob, WAIT).await;
    assert!(closed, "not closed");
    let frames = ws_frames(&bytes);
    let delivered = frames.iter().filter(|(op, _)| *op == 1).count();
    let (op, payload) = frames.last().expect("frames");
    assert_eq!(*op, 8, "the last frame is the close frame");
    assert_eq!(payload[..2], 4003u16.to_be_bytes());
    assert!(
        delivered < seqs.len(),
        "{delivered} frames: the queue was not dropped"
    );
    eprintln!("a never-reading client was closed (4003) {decided:?} after connecting; {delivered} of {} deliveries had reached its socket", seqs.len());

    // Nothing is lost: a reading client gets every entry, in order.
    let mut again = d.resume("bob", 0).await;
    again.expect_seqs(&seqs).await;
    d.shutdown().await;
}

#[tokio::test]
async fn mailbox_pages_are_capped_in_bytes_and_unread_responses_are_dropped() {
    let cap = 64 * 1024;
    let d = start_with(|o| {
        o.max_page_bytes = cap;
        o.slow_client_grace = Duration::from_secs(1);
    })
    .await;
    let seqs = fill_mailbox(&d, "carol", 20, 16_000).await;
    // Paging through with limit=1000 returns everything, in pages of about the cap.
    let (mut after, mut got, mut pages) = (0u64, Vec::new(), 0);
    loop {
        let path = format!("/v1/mailbox?user=carol&limit=1000&after={after}");
        let (status, page) = d.get(&path).await;
        assert_eq!(status, 200, "{page}");
        let entries = page["entries"].as_array().unwrap();
        if entries.is_empty() {
            break;
        }
        pages += 1;
        let bytes: usize = entries
            .iter()
            .map(|e| e["body"].as_str().unwrap().len())
            .sum();
        assert!(bytes <= cap + 16_000, "a page of {bytes} body bytes");
        assert!(entries.len() < seqs.len());
        got.extend(entries.iter().map(|e| e["seq"].as_u64().unwrap()));
        after = page["next_after"].as_u64().unwrap();
    }
    assert_eq!(got, seqs);
    assert!(pages >= 4, "{pages} pages");

    // A response nobody reads does not stay: with a page cap of 4 MiB, its writes stall and
    // the connection is dropped after the grace period.
    d.shutdown().await;
    let d = start_with(|o| {
        o.max_page_bytes = 4 << 20;
        o.slow_client_grace = Duration::from_secs(1);
    })
    .await;
    fill_mailbox(&d, "dave", 300, 16_000).await;
    let mut s = small_window(d.addr).await;
    s.write_all(b"GET /v1/mailbox?user=dave&limit=1000 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    metric_reaches(&d, "tidemark_write_stalls_total", 1.0).await;
    let (bytes, closed) = read_until_closed(&mut s, WAIT).await;
    assert!(closed);
    assert!(
        bytes.len() < 300 * 16_000,
        "{} bytes: the whole page",
        bytes.len()
    );
    d.shutdown().await;
}

#[tokio::test]
async fn a_user_may_open_only_so_many_websockets() {
    let d = start_with(|o| o.max_connections_per_user = 2).await;
    let a1 = d.ready("alice").await;
    let mut a2 = d
        .ready_query(&format!("token={}", token_for("alice")))
        .await;
    // A third one of alice's, however authenticated, is refused before the upgrade.
    let (status, body) = d.refused("user=alice", &[]).await;
    assert_eq!(status, 429, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "too_many_connections", "{v}");
    // Other users are not affected; alice's HTTP requests neither.
    let _b = d.ready("bob").await;
    assert_eq!(d.get_text("/v1/mailbox?user=alice").await.0, 200);
    // Once one closes, alice may connect again.
    a1.close().await;
    let mut a3 = poll("the slot was never freed", || async {
        match d.try_ws("user=alice", &[]).await {
            Ok(ws) => Some(ws),
            Err((429, _)) => None,
            Err(other) => panic!("{other:?}"),
        }
    })
    .await;
    assert_eq!(a3.recv().await["type"], "ready");
    a2.barrier().await;
    d.shutdown().await;
}

#[tokio::test]
async fn one_user_flooding_commits_does_not_starve_the_others() {
    // 8 permits in all, 2 per user: before, one user's queued sends took all 8.
    let share = 2;
    let d = start_with(|o| {
        o.max_inflight_commits = 8;
        o.max_inflight_commits_per_user = share;
    })
    .await;
    let mut greedy = d.ready_all(["greedy"; 4]).await;
    let mut carol = d.ready("carol").await;

    // Pause the core: every admitted commit holds its permits until it resumes.
    d.pause_core(2000).await;
    let paused = Instant::now();
    for (i, ws) in greedy.iter_mut().enumerate() {
        for j in 0..4 {
            ws.send_only(&format!("g{i}-{j}"), &["bob"], "x").await;
        }
    }
    // Each connection answers its sends in order: admitted ones later, refused ones now.
    let mut overloaded = 0;
    for ws in &mut greedy {
        ws.barrier().await;
        while let Some(e) = ws.try_pending(|v| v["type"] == "error") {
            assert_eq!(e["code"], "overloaded", "{e}");
            overloaded += 1;
        }
    }
    assert_eq!(
        overloaded,
        16 - share,
        "greedy holds exactly its share of 2"
    );
    // carol still gets in: her send waits for the core, then is acked.
    let r = carol.send_msg("c-1", &["bob"], "hello").await;
    assert_eq!(r["type"], "send_ack", "{r}");
    assert!(
        paused.elapsed() >= Duration::from_millis(1500),
        "acked during the pause?"
    );
    d.shutdown().await;
}

/// ADR-0096: a send waiting for permits of the user's share does not hold up its own
/// connection's commits in flight, whose answers free those permits. With a share of 2, a send
/// to two shards takes both and waits about 40 ms for its round (the commit linger); the next
/// send of the connection waits for a permit. Before, the reader awaited that permit without
/// polling the first send's commit, so the first could not let its permits go and the second
/// was refused `overloaded` after 100 ms, with nothing else of the user in flight.
#[tokio::test]
async fn a_send_waiting_for_its_users_share_lets_its_connections_commit_finish() {
    let d = start_with(|o| {
        o.max_inflight_commits_per_user = 2;
        o.commit_linger = Duration::from_millis(40);
    })
    .await;
    let to = gateway_support::users_in_distinct_shards("w", 2);
    let to: Vec<&str> = to.iter().map(String::as_str).collect();
    let mut alice = d.ready("alice").await;
    for round in 0..3 {
        // the round before this one just went: the next waits out the linger, so the send
        // to two shards is still in flight when the next send is read
        alice
            .send_ok(&format!("warm-{round}"), &["bob"], "warm")
            .await;
        let t0 = std::time::Instant::now();
        alice
            .send_only(&format!("two-{round}"), &to, "to two shards")
            .await;
        alice
            .send_only(&format!("one-{round}"), &to[..1], "to one")
            .await;
        for id in [format!("two-{round}"), format!("one-{round}")] {
            let a = alice
                .recv_where(|v| v["type"] == "send_ack" || v["type"] == "error")
                .await;
            assert_eq!(
                (&a["type"], &a["id"]),
                (&"send_ack".into(), &id.as_str().into()),
                "round {round}: {a} after {:?}",
                t0.elapsed()
            );
        }
    }
    d.shutdown().await;
}

#[tokio::test]
async fn sends_above_the_per_user_rate_get_rate_limited() {
    let d = start_with(|o| {
        o.send_rate_per_user = 10.0;
        o.send_burst_per_user = 5;
    })
    .await;
    let mut alice = d.ready("alice").await;
    for i in 0..5 {
        alice.send_ok(&format!("a{i}"), &["bob"], "x").await;
    }
    alice
        .send_refused("a5", &["bob"], "x", "rate_limited")
        .await;
    // HTTP sends draw from the same bucket: 429.
    let r = d
        .post_message("alice", br#"{"id":"a5","to":["bob"],"body":"x"}"#)
        .await;
    assert_error(&r, 429, "rate_limited");
    // Other users have their own bucket.
    let mut carol = d.ready("carol").await;
    carol.send_ok("c0", &["bob"], "x").await;
    // The bucket refills at 10/s: the retry (same id) goes through.
    tokio::time::sleep(Duration::from_millis(150)).await;
    alice.send_ok("a5", &["bob"], "x").await;
    d.shutdown().await;
}

/// A connection whose sends wait at their bound (64 behind the one in flight, ADR-0054) reads
/// no frames meanwhile, pongs included; its client is not idle for that. With core Redis
/// paused for three idle timeouts, every send is answered in order after the pause and the
/// connection stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_waiting_on_its_own_sends_is_not_closed_as_idle() {
    const N: usize = 100;
    let d = start_with(|o| {
        o.ping_interval = Duration::from_millis(100);
        o.idle_timeout = Duration::from_millis(500);
    })
    .await;
    let mut alice = d.ready("alice").await;
    d.pause_core(1500).await;
    for i in 0..N {
        alice.send_only(&format!("w-{i}"), &["bob"], "x").await;
    }
    for i in 0..N {
        let a = alice.recv_where(|v| v["type"] == "send_ack").await;
        assert_eq!(a["id"], format!("w-{i}"), "answered in order: {a}");
    }
    // still open: the barrier is answered
    alice.barrier().await;
    d.shutdown().await;
}

/// ADR-0101: a frame the WebSocket layer refuses is the client's bug: it gets a `bad_request`
/// error frame and the close code that names it (1007 for a text frame that is not UTF-8,
/// 1002 for a protocol violation, here an unmasked frame), not 1011 `internal_error`, which
/// tells a client to reconnect and send the same again. Before, the connection was closed
/// with 1011 and no error frame.
#[tokio::test]
async fn a_frame_the_websocket_layer_refuses_gets_a_typed_error_and_its_close_code() {
    let d = start().await;
    let payload: &[u8] = b"{\"type\":\"ack\",\"seq\":1}\xff";
    let mask = [0x11u8, 0x22, 0x33, 0x44];
    let mut not_utf8 = vec![0x81, 0x80 | payload.len() as u8];
    not_utf8.extend_from_slice(&mask);
    not_utf8.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    let text: &[u8] = b"{\"type\":\"ack\",\"seq\":1}";
    let mut unmasked = vec![0x81, text.len() as u8];
    unmasked.extend_from_slice(text);
    for (frame, code, name) in [
        (not_utf8, 1007u16, "invalid_payload"),
        (unmasked, 1002, "protocol_error"),
    ] {
        let mut s = raw_ws(d.addr, "alice").await;
        s.write_all(&frame).await.unwrap();
        let (bytes, closed) = read_until_closed(&mut s, WAIT).await;
        assert!(closed, "{name}: not closed");
        let text = String::from_utf8_lossy(&bytes);
        assert!(
            text.contains("\"code\":\"bad_request\""),
            "{name}: no bad_request error frame: {text:?}"
        );
        let close = bytes
            .windows(2)
            .rposition(|w| w[0] == 0x88)
            .expect("a close frame");
        assert_eq!(&bytes[close + 2..close + 4], &code.to_be_bytes(), "{name}");
        metric_reaches(
            &d,
            &format!("tidemark_ws_closes_total{{code=\"{name}\"}}"),
            1.0,
        )
        .await;
    }
    d.shutdown().await;
}

/// ADR-0104: with dev auth, a web page of another site cannot act as a user. A browser sends
/// `Origin` with every WebSocket handshake and every cross-origin request, and a WebSocket is
/// not held back by CORS: before, a page on any site could open `ws://127.0.0.1:…?user=alice`
/// and read alice's deliveries, or post her acks. The gateway's own pages (same origin) and
/// clients that send no `Origin` are unaffected.
#[tokio::test]
async fn dev_auth_refuses_a_page_of_another_site() {
    let d = start().await;
    let own = format!("http://{}", d.addr);
    let (status, body) = d
        .refused("user=alice", &[("Origin", "http://evil.example")])
        .await;
    assert_eq!(status, 403, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "forbidden", "{v}");
    let (status, body) = d
        .http(
            "POST",
            "/v1/mailbox/ack?user=alice",
            &[("Origin", "http://evil.example")],
            Some(br#"{"seq":1}"#),
        )
        .await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = d
        .http(
            "GET",
            "/v1/admin/status",
            &[("Origin", "https://evil.example")],
            None,
        )
        .await;
    assert_eq!(status, 403, "{body}");
    // the gateway's own pages, and clients without an Origin
    let mut ws = d
        .try_ws("user=alice", &[("Origin", own.as_str())])
        .await
        .expect("same origin");
    assert_eq!(ws.recv().await["type"], "ready");
    let mut ws = d.try_ws("user=alice", &[]).await.expect("no Origin");
    assert_eq!(ws.recv().await["type"], "ready");
    let (status, body) = d
        .http(
            "GET",
            "/v1/mailbox?user=alice",
            &[("Origin", own.as_str())],
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    d.shutdown().await;
}

/// ADR-0115: DNS rebinding. A page of `evil.example` whose name is re-pointed at 127.0.0.1
/// after it loaded is same-origin with the `Host` it sends, so ADR-0104's `Origin` check let
/// it act as any user (read a mailbox, send, read the admin status). Without
/// `--dev-auth-public`, dev auth now answers only for a loopback `Host`; with it, as before.
#[tokio::test]
async fn dev_auth_answers_only_for_a_loopback_host() {
    use gateway_support::request_on;
    let d = start().await;
    let port = d.addr.port();
    let evil = format!("evil.example:{port}");
    let evil_origin = format!("http://{evil}");
    for (method, path, body) in [
        ("GET", "/v1/mailbox?user=alice", None),
        (
            "POST",
            "/v1/mailbox/ack?user=alice",
            Some(&br#"{"seq":1}"#[..]),
        ),
        ("GET", "/v1/admin/status", None),
    ] {
        let tcp = TcpStream::connect(d.addr).await.unwrap();
        let (status, text) = request_on(
            tcp,
            &evil,
            method,
            path,
            &[("Origin", evil_origin.as_str())],
            body,
        )
        .await;
        assert_eq!(status, 403, "{method} {path} for Host {evil}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "forbidden", "{v}");
    }
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}")] {
        let tcp = TcpStream::connect(d.addr).await.unwrap();
        let (status, head, text) = gateway_support::request_on_full(
            tcp,
            &host,
            "GET",
            "/v1/mailbox?user=alice",
            &[],
            None,
        )
        .await;
        assert_eq!(status, 200, "Host {host}: {text}");
        // and a data answer is neither cached nor sniffed
        assert_eq!(
            gateway_support::header_value(&head, "cache-control"),
            Some("no-store"),
            "{head}"
        );
        assert_eq!(
            gateway_support::header_value(&head, "x-content-type-options"),
            Some("nosniff"),
            "{head}"
        );
    }
    d.shutdown().await;
    // --dev-auth-public: reached from other machines by any name
    let d = start_with(|o| o.dev_auth_public = true).await;
    let tcp = TcpStream::connect(d.addr).await.unwrap();
    let (status, text) = request_on(
        tcp,
        &format!("gateway.lan:{}", d.addr.port()),
        "GET",
        "/v1/mailbox?user=alice",
        &[],
        None,
    )
    .await;
    assert_eq!(status, 200, "{text}");
    d.shutdown().await;
}

/// Sends `head` (raw bytes) on a new connection and returns the status and body of the answer.
async fn raw_request(addr: SocketAddr, head: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    // the server may answer and close before it has read everything
    let _ = s.write_all(head).await;
    let (resp, closed) = read_until_closed(&mut s, WAIT).await;
    assert!(closed, "not closed: {:?}", String::from_utf8_lossy(&resp));
    status_and_body(&resp)
}

/// ADR-0125: a connection buffers at most 32 KiB, for a request head above all. Before,
/// hyper's default of about 400 KiB applied: any socket, before any login, could hold that
/// much with one long header line (4 GiB at the default cap of 10 000 connections). A head
/// over the bound is answered 431; a head with too many lines too; a usual one is served.
#[tokio::test]
async fn a_request_head_above_32_kib_gets_431() {
    let d = start().await;
    let pad = "p".repeat(64 * 1024);
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {pad}\r\nConnection: close\r\n\r\n"
    );
    let (status, body) = raw_request(d.addr, head.as_bytes()).await;
    assert_eq!(status, 431, "a 64 KiB header: {body}");
    let many: String = (0..150).map(|i| format!("X-H{i}: v\r\n")).collect();
    let head =
        format!("GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n{many}Connection: close\r\n\r\n");
    let (status, body) = raw_request(d.addr, head.as_bytes()).await;
    assert_eq!(status, 431, "150 header lines: {body}");
    // a head of a usual size with a token-sized header is served
    let pad = "p".repeat(2 * 1024);
    let head = format!(
        "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {pad}\r\nConnection: close\r\n\r\n"
    );
    let (status, body) = raw_request(d.addr, head.as_bytes()).await;
    assert_eq!((status, body.as_str()), (200, "ok"));
    d.shutdown().await;
}

/// ADR-0125: every failure has the JSON body with a stable code, a path segment that does
/// not decode included. Before, `GET /console/%FF` (not UTF-8) got axum's plain-text 400.
#[tokio::test]
async fn a_console_file_name_that_does_not_decode_is_not_found_with_the_json_body() {
    let d = start().await;
    for path in ["/console/%FF", "/console/%C3%28.js", "/console/nope.js"] {
        let (status, body) = d.get_text(path).await;
        assert_eq!(status, 404, "{path}: {body}");
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("{path}: not the JSON error body ({e}): {body:?}"));
        assert_eq!(v["error"]["code"], "not_found", "{path}: {v}");
    }
    assert_eq!(d.get_text("/console/console.js").await.0, 200);
    d.shutdown().await;
}

/// ADR-0125: under dev auth, a `Host` (or an `Origin`) that is there but not visible ASCII,
/// or given twice, is refused 403 `forbidden`. Before, an unreadable `Host` counted as
/// absent: both the loopback check (ADR-0115) and the `Origin` check (ADR-0104) were
/// skipped, and the request was served.
#[tokio::test]
async fn dev_auth_refuses_an_unreadable_or_repeated_host() {
    let d = start().await;
    let port = d.addr.port();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "a Host with a byte above 0x7f",
            [
                b"Host: evil.ex\xe4mple:".as_slice(),
                port.to_string().as_bytes(),
            ]
            .concat(),
        ),
        (
            "the same, with another site's Origin",
            [
                b"Host: 127.0.0.1\xff:".as_slice(),
                port.to_string().as_bytes(),
                b"\r\nOrigin: http://evil.example",
            ]
            .concat(),
        ),
        (
            "two Hosts",
            format!("Host: 127.0.0.1:{port}\r\nHost: evil.example:{port}").into_bytes(),
        ),
        (
            "an Origin with a byte above 0x7f",
            format!("Host: 127.0.0.1:{port}\r\nOrigin: http://127.0.0.1:{port}\u{e9}").into_bytes(),
        ),
    ];
    for (what, host) in cases {
        let mut head = b"GET /v1/mailbox?user=alice HTTP/1.1\r\n".to_vec();
        head.extend_from_slice(&host);
        head.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        let (status, body) = raw_request(d.addr, &head).await;
        assert_eq!(status, 403, "{what}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "forbidden", "{what}: {v}");
    }
    // a readable loopback Host is served
    let head = format!(
        "GET /v1/mailbox?user=alice HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    );
    let (status, body) = raw_request(d.addr, head.as_bytes()).await;
    assert_eq!(status, 200, "{body}");
    d.shutdown().await;
}

/// ADR-0126: a wake subscriber that cannot subscribe is a `/healthz` problem after 10 s. Here
/// the mailbox Redis's user may still publish hints (`&wake:{*`) but no longer subscribe to
/// the pattern `wake:*` (Redis 7 gives a new ACL user no channel at all, and checks a
/// pattern literally): Redis closes the subscription, and every attempt after it is refused
/// `NOPERM`. Before, the subscriber retried every 500 ms for ever, its sweep never ran, no
/// hint woke a connection, and `/healthz` stayed 200.
#[tokio::test]
async fn healthz_reports_a_wake_subscriber_that_cannot_subscribe() {
    let d = start().await;
    until("healthy at the start", || async {
        d.get_text("/healthz").await.0 == 200
    })
    .await;
    let mut mailbox = gateway_support::redis_at(&d.mailbox_url).await;
    let acl = |rules: &'static [&'static str]| {
        let mut cmd = redis::cmd("ACL");
        cmd.arg("SETUSER").arg("default").arg(rules);
        cmd
    };
    let _: () = acl(&["resetchannels", "&wake:{*"])
        .query_async(&mut mailbox)
        .await
        .unwrap();
    let t0 = Instant::now();
    let body = gateway_support::poll_within(
        "/healthz never reported the wake subscriber",
        Duration::from_secs(16),
        || async {
            let (status, body) = d.get_text("/healthz").await;
            (status == 503 && body.contains("wake subscriber of ")).then_some(body)
        },
    )
    .await;
    eprintln!("reported {:?} after the ACL change:\n{body}", t0.elapsed());
    assert!(body.contains("no permissions"), "{body}");
    // allowed again: it subscribes, and /healthz is 200 again
    let _: () = acl(&["allchannels"])
        .query_async(&mut mailbox)
        .await
        .unwrap();
    until("healthy again", || async {
        d.get_text("/healthz").await.0 == 200
    })
    .await;
    d.shutdown().await;
}

/// ADR-0127: a send to more shards than its user's share of commit permits takes the whole
/// share, so it goes only when the user has nothing else in flight, and one gateway permit per
/// shard, so the gateway's bound on commits in flight holds. Here, with a share of 2 and 8
/// permits in all, alice's send to 4 shards is admitted alone: her next send, from another
/// connection, is refused `overloaded` while it is in flight, and bob still gets his share.
#[tokio::test]
async fn a_send_wider_than_the_users_share_goes_alone() {
    let d = start_with(|o| {
        o.max_inflight_commits = 8;
        o.max_inflight_commits_per_user = 2;
    })
    .await;
    let wide = gateway_support::users_in_distinct_shards("wide", 4);
    let wide: Vec<&str> = wide.iter().map(String::as_str).collect();
    let mut alice = d.ready_all(["alice"; 2]).await;
    let mut bob = d.ready("bob").await;
    // the core paused: every admitted send holds its permits until it resumes
    d.pause_core(1500).await;
    alice[0].send_only("wide", &wide, "to four shards").await;
    alice[0].barrier().await; // read, and admitted or queued for permits
    alice[1]
        .send_refused("next", &["carol"], "x", "overloaded")
        .await;
    bob.send_only("b-1", &["carol"], "x").await;
    bob.send_only("b-2", &["dave"], "x").await;
    bob.barrier().await;
    assert!(bob.try_pending(|v| v["type"] == "error").is_none());
    let a = alice[0]
        .recv_where(|v| v["type"] == "send_ack" || v["type"] == "error")
        .await;
    assert_eq!(
        (&a["type"], &a["id"]),
        (&"send_ack".into(), &"wide".into()),
        "{a}"
    );
    assert_eq!(a["offsets"].as_object().unwrap().len(), 4, "{a}");
    for id in ["b-1", "b-2"] {
        let b = bob
            .recv_where(|v| v["type"] == "send_ack" || v["type"] == "error")
            .await;
        assert_eq!(
            (&b["type"], &b["id"]),
            (&"send_ack".into(), &id.into()),
            "{b}"
        );
    }
    d.shutdown().await;
}
