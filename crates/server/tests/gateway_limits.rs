//! Slow, idle and greedy clients against a real deployment (issue 9; ADR-0025): token expiry
//! on an open WebSocket, header-read timeout, connection caps, ping/idle timeout, outbound
//! byte budgets, mailbox page caps, per-user connection caps, fair commit admission and the
//! per-user send rate.

mod gateway_support;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gateway_support::{now_unix, start, token_for, SECRET};
use serde_json::Value;
use tidemark_protocol::token;

#[tokio::test]
async fn a_websocket_is_closed_with_4001_when_its_token_expires() {
    let d = start().await;
    let exp = now_unix() + 2;
    let short = token::sign(SECRET, "alice", exp);
    let mut ws = d.ws(&format!("token={short}"), &[]).await;
    assert_eq!(ws.recv().await["type"], "ready");
    // Same user, a long-lived token and a dev-auth connection: both stay open.
    let mut long = d.ws(&format!("token={}", token_for("alice")), &[]).await;
    assert_eq!(long.recv().await["type"], "ready");
    let mut dev = d.ws_user("alice").await;
    assert_eq!(dev.recv().await["type"], "ready");

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
    let (status, body) = d
        .try_ws(&format!("token={short}"), &[])
        .await
        .err()
        .expect("expired token refused");
    assert_eq!(status, 401);
    assert!(body.contains("token_expired"), "{body}");
    let mut again = d.ws(&format!("token={}", token_for("alice")), &[]).await;
    assert_eq!(again.recv().await["type"], "ready");

    // The others were not touched.
    long.barrier().await;
    dev.barrier().await;
    d.shutdown().await;
}
