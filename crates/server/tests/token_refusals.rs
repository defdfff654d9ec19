//! Every token that does not verify is refused with the same answer on the wire (HTTP and
//! WebSocket upgrade, header and `?token=`): a client cannot tell a malformed token from a
//! mis-signed one (issue 9, item 5). Real gateway, real sockets.

mod gateway_support;

use std::collections::BTreeSet;

use gateway_support::{assert_error, encode, now_unix, start_with, token_for, SECRET};
use tidemark_protocol::token;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_mis_signed_tokens_get_one_answer() {
    let d = start_with(|o| o.dev_auth = false).await;
    let good = token_for("alice");
    let (head, _) = good.rsplit_once('.').unwrap();
    let invalid = [
        (
            "wrong secret",
            token::sign(b"another secret", "alice", now_unix() + 60),
        ),
        ("zero MAC", format!("{head}.{}", "A".repeat(43))),
        ("truncated MAC", format!("{head}.AAAA")),
        ("not v1", good.replacen("v1.", "v2.", 1)),
        ("garbage", "garbage".to_string()),
        ("bad base64", "v1.!!!.AAAA".to_string()),
        ("too long", format!("v1.{}.AAAA", "A".repeat(2000))),
        (
            "expired, wrong secret",
            token::sign(b"another secret", "alice", 1),
        ),
    ];
    let mut answers = BTreeSet::new();
    for (what, t) in &invalid {
        let bearer = format!("Bearer {t}");
        let http = d
            .http("GET", "/v1/mailbox", &[("Authorization", &bearer)], None)
            .await;
        answers.insert(format!("{} {}", http.0, http.1));
        for (query, headers) in [
            (format!("token={}", encode(t)), vec![]),
            (String::new(), vec![("Authorization", bearer.as_str())]),
        ] {
            let Err((status, body)) = d.try_ws(&query, &headers).await else {
                panic!("{what}: upgrade accepted");
            };
            answers.insert(format!("{status} {body}"));
        }
    }
    assert_eq!(answers.len(), 1, "{answers:#?}");
    let one = answers.into_iter().next().unwrap();
    assert!(one.starts_with("401 "), "{one}");
    let body: serde_json::Value = serde_json::from_str(&one[4..]).unwrap();
    assert_eq!(body["error"]["code"], "unauthorized");
    assert_eq!(body["error"]["message"], token::INVALID_TOKEN_MESSAGE);

    // a correctly signed, expired token is told apart (the client needs a new one)
    let expired = token::sign(SECRET, "alice", now_unix() - 1);
    let r = d.with_token("GET", "/v1/mailbox", &expired, None).await;
    assert_error(&r, 401, "token_expired");
    d.shutdown().await;
}

/// ADR-0103: the admin status stream ends when its token expires, with an `error` event
/// `token_expired`, as a WebSocket is closed with 4001. Before, a stream opened with an admin
/// token went on sending the deployment's status until the gateway stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_status_stream_ends_when_its_token_expires() {
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = start_with(|o| o.dev_auth = false).await;
    let admin = token::sign_admin(SECRET, "ops", now_unix() + 2);
    let mut io = tokio::net::TcpStream::connect(d.addr).await.unwrap();
    let req = format!(
        "GET /v1/admin/status/stream HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {admin}\r\n\r\n",
        d.addr
    );
    io.write_all(req.as_bytes()).await.unwrap();
    let opened = Instant::now();
    let mut text = String::new();
    let mut buf = [0u8; 16 * 1024];
    // the chunked body's last chunk: the stream ended
    while !text.ends_with("\r\n0\r\n\r\n") {
        assert!(
            opened.elapsed() < Duration::from_secs(10),
            "the stream went on past its token's exp: {text}"
        );
        let k = tokio::time::timeout(Duration::from_secs(10), io.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("the stream went on past its token's exp: {text}"))
            .unwrap();
        if k == 0 {
            break;
        }
        text.push_str(&String::from_utf8_lossy(&buf[..k]));
    }
    let ended = opened.elapsed();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("event: status"), "it streamed first: {text}");
    let last = text.rfind("event: ").expect("events");
    assert!(
        text[last..].starts_with("event: error") && text[last..].contains("\"token_expired\""),
        "ends with a token_expired error event: {text}"
    );
    assert!(
        ended < Duration::from_secs(4),
        "ended {ended:?} after opening"
    );
}

/// ADR-0107: a correctly signed token whose `exp` is past what the clock can hold (`tidemark
/// token --ttl` takes any `u64` of seconds) never expires; it does not panic the
/// connection. Before, the WebSocket's task panicked right after `ready` (no close frame,
/// nothing counted, and the client's reconnect met the same panic), and so did the admin
/// status stream's handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_whose_expiry_is_past_the_clocks_reach_is_served() {
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let d = start_with(|o| o.dev_auth = false).await;
    for exp in [u64::MAX, i64::MAX as u64 + 1] {
        let t = token::sign(SECRET, "alice", exp);
        let mut ws = d
            .try_ws(&format!("token={}", encode(&t)), &[])
            .await
            .unwrap_or_else(|(s, b)| panic!("exp {exp}: upgrade refused {s} {b}"));
        ws.send_ok(&format!("far-{exp}"), &["bob"], "still here")
            .await;

        let admin = token::sign_admin(SECRET, "ops", exp);
        let mut io = tokio::net::TcpStream::connect(d.addr).await.unwrap();
        let req = format!(
            "GET /v1/admin/status/stream HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {admin}\r\n\r\n",
            d.addr
        );
        io.write_all(req.as_bytes()).await.unwrap();
        let opened = Instant::now();
        let mut text = String::new();
        let mut buf = [0u8; 16 * 1024];
        while !text.contains("event: status") {
            let left = Duration::from_secs(10).saturating_sub(opened.elapsed());
            let k = tokio::time::timeout(left, io.read(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("exp {exp}: no status event: {text}"))
                .unwrap_or(0);
            assert!(
                k > 0,
                "exp {exp}: the stream ended before its first event: {text:?}"
            );
            text.push_str(&String::from_utf8_lossy(&buf[..k]));
        }
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }
    d.shutdown().await;
}
