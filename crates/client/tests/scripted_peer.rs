//! The client against a scripted peer: a tiny in-test WebSocket server (tokio-tungstenite
//! `accept_hdr_async` on 127.0.0.1:0) that plays the server side of protocol v1 frame by
//! frame. It is a protocol fixture, not a stand-in for the real gateway (tested elsewhere):
//! each test scripts exactly the frames it needs and checks what the client sent.

// tungstenite's handshake `Callback` fixes the closure's error type (an HTTP response).
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::{FutureExt, SinkExt, StreamExt};
use serde_json::{json, Value};
use tidemark_client::{
    make_token, send_once, tail, tail_with, Auth, Client, ClientOptions, Entry, Error, Event,
    Reconnect, BAD_SERVER_FRAME,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{accept_hdr_async, WebSocketStream};

type PeerWs = WebSocketStream<TcpStream>;

/// What the peer saw of the upgrade request.
#[derive(Debug, Clone)]
struct Seen {
    uri: String,
    authorization: Option<String>,
}

/// Listens on 127.0.0.1:0, accepts one WebSocket connection and runs `script` on it.
/// Returns the `ws://…/v1/ws` URL and the script's task.
async fn peer<T, F, Fut>(script: F) -> (String, JoinHandle<T>)
where
    F: FnOnce(PeerWs, Seen) -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}/v1/ws", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        let mut seen = None;
        let ws = accept_hdr_async(tcp, |req: &Request, resp: Response| {
            seen = Some(Seen {
                uri: req.uri().to_string(),
                authorization: req
                    .headers()
                    .get("authorization")
                    .map(|v| v.to_str().unwrap().to_owned()),
            });
            Ok(resp)
        })
        .await
        .unwrap();
        script(ws, seen.unwrap()).await
    });
    (url, task)
}

/// Listens on 127.0.0.1:0 and runs `script` on every connection, one after the other, with
/// its number (0, 1, …): `Err(response)` refuses the upgrade with that HTTP response, `Ok`
/// accepts it. Returns the `ws://…/v1/ws` URL and the task (it runs until aborted).
async fn peers<F, Fut>(
    mut refuse: impl FnMut(usize) -> Option<ErrorResponse> + Send + 'static,
    mut script: F,
) -> (String, JoinHandle<()>)
where
    F: FnMut(PeerWs, usize) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}/v1/ws", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        for n in 0.. {
            let (tcp, _) = listener.accept().await.unwrap();
            let refusal = refuse(n);
            let refused = refusal.is_some();
            let ws = accept_hdr_async(tcp, move |_: &Request, resp: Response| match refusal {
                Some(r) => Err(r),
                None => Ok(resp),
            })
            .await;
            match ws {
                Ok(ws) => script(ws, n).await,
                Err(_) => assert!(refused, "connection {n}: the upgrade failed"),
            }
        }
    });
    (url, task)
}

/// An HTTP refusal of an upgrade, as a proxy or the gateway sends it.
fn refusal(status: u16, body: &str) -> ErrorResponse {
    let mut resp = ErrorResponse::new((!body.is_empty()).then(|| body.to_owned()));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    resp
}

/// Closes the peer's side with a close handshake and reads until the client is gone.
async fn hang_up(mut ws: PeerWs) {
    let _ = ws.close(None).await;
    while let Some(Ok(_)) = ws.next().await {}
}

/// Reconnects for longer than any test runs.
const KEEP_TRYING: Reconnect = Reconnect {
    give_up_after: Duration::from_secs(60),
};

/// The next text frame as JSON; `None` once the client closed the connection.
async fn recv(ws: &mut PeerWs) -> Option<Value> {
    recv_raw(ws)
        .await
        .map(|m| serde_json::from_str(m.to_text().unwrap()).unwrap())
}

/// The next text or binary frame as sent; `None` once the client closed the connection.
async fn recv_raw(ws: &mut PeerWs) -> Option<Message> {
    loop {
        match ws.next().await {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return None,
            Some(Ok(m @ (Message::Text(_) | Message::Binary(_)))) => return Some(m),
            Some(Ok(_)) => {}
        }
    }
}

async fn send(ws: &mut PeerWs, frame: Value) {
    ws.send(Message::text(frame.to_string())).await.unwrap();
}

fn ready(user: &str, after: u64) -> Value {
    json!({"type": "ready", "user": user, "after": after})
}

fn deliver(seq: u64, from: &str, body: &str) -> Value {
    json!({"type": "deliver", "seq": seq, "from": from, "body": body, "sent_at_us": 1_764_489_600_000_000u64 + seq})
}

fn entry(seq: u64, from: &str, body: &str) -> Entry {
    Entry {
        seq,
        from: from.into(),
        body: body.into(),
        sent_at_us: 1_764_489_600_000_000 + seq,
    }
}

fn dev(user: &str) -> Auth {
    Auth::DevUser(user.into())
}

fn to(users: &[&str]) -> Vec<String> {
    users.iter().map(|u| u.to_string()).collect()
}

/// A `send_ack` frame; `offsets` as (shard, offset) pairs.
fn send_ack(id: &str, offsets: &[(u32, u64)]) -> Value {
    let offsets: serde_json::Map<String, Value> = offsets
        .iter()
        .map(|(shard, offset)| (shard.to_string(), json!(offset)))
        .collect();
    json!({"type": "send_ack", "id": id, "offsets": offsets})
}

/// An `error` frame; the `id` field only when `id` is given.
fn error_frame(code: &str, message: &str, id: Option<&str>) -> Value {
    let mut frame = json!({"type": "error", "code": code, "message": message});
    if let Some(id) = id {
        frame["id"] = json!(id);
    }
    frame
}

/// The event of a `send_ack` no waiter took.
fn ack_event(id: &str, offsets: &[(u32, u64)]) -> Event {
    Event::SendAck {
        id: id.into(),
        offsets: offsets.iter().copied().collect(),
    }
}

/// The event of an `error` frame no waiter took.
fn error_event(code: &str, message: &str, id: Option<&str>) -> Event {
    Event::Error {
        code: code.into(),
        message: message.into(),
        id: id.map(Into::into),
    }
}

/// [`peer`] whose script starts by sending `ready` for `user` (delivery after `after`).
async fn ready_peer<T, F, Fut>(user: &'static str, after: u64, script: F) -> (String, JoinHandle<T>)
where
    F: FnOnce(PeerWs) -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    peer(move |mut ws, _| async move {
        send(&mut ws, ready(user, after)).await;
        script(ws).await
    })
    .await
}

/// Connects to the peer at `url` as the dev user alice.
async fn connect_alice(url: &str) -> Client {
    Client::connect(url, &dev("alice")).await.unwrap()
}

/// Closes the client cleanly, then waits for the peer's script and returns its result.
async fn close<T>(client: Client, peer: JoinHandle<T>) -> T {
    client.close().await;
    peer.await.unwrap()
}

/// Bounds every test: a hang is a failure, not a stuck CI job.
async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("test timed out")
}

const WAIT: Duration = Duration::from_secs(5);

#[tokio::test]
async fn token_goes_in_the_authorization_header() {
    within(async {
        let secret = b"scripted peer secret";
        let token = make_token(secret, "alice", Duration::from_secs(60)).unwrap();
        let (url, peer) = peer(|mut ws, seen| async move {
            send(&mut ws, ready("alice", 3400)).await;
            assert!(recv(&mut ws).await.is_none());
            seen
        })
        .await;
        let client = Client::connect(&url, &Auth::Token(token.clone()))
            .await
            .unwrap();
        assert_eq!(client.user(), "alice");
        assert_eq!(client.ready_after(), 3400);
        let seen = close(client, peer).await;
        assert_eq!(seen.uri, "/v1/ws");
        assert_eq!(seen.authorization, Some(format!("Bearer {token}")));
        let bearer = seen.authorization.unwrap();
        let claims =
            tidemark_protocol::token::verify(secret, bearer.strip_prefix("Bearer ").unwrap(), 1)
                .unwrap();
        assert_eq!(claims.user, "alice");
    })
    .await
}

#[tokio::test]
async fn dev_user_goes_in_the_query() {
    within(async {
        let (url, peer) = peer(|mut ws, seen| async move {
            send(&mut ws, ready("bob smith", 0)).await;
            recv(&mut ws).await;
            seen
        })
        .await;
        let client = Client::connect(&url, &dev("bob smith")).await.unwrap();
        assert_eq!(client.user(), "bob smith");
        assert_eq!(client.ready_after(), 0);
        let seen = close(client, peer).await;
        assert_eq!(seen.uri, "/v1/ws?user=bob+smith");
        assert_eq!(seen.authorization, None);
    })
    .await
}

#[tokio::test]
async fn frames_are_sent_as_the_protocol_spells_them() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            let mut got = Vec::new();
            while let Some(m) = recv_raw(&mut ws).await {
                got.push(m);
            }
            got
        })
        .await;
        let client = connect_alice(&url).await;
        client
            .send("c-1", &to(&["bob", "carol"]), "hi \"there\"\n")
            .await
            .unwrap();
        client.ack(3471).await.unwrap();
        client.sync(3400).await.unwrap();
        client.send_raw_text("{not json").await.unwrap();
        client.send_raw_binary(vec![1, 2, 3]).await.unwrap();
        let got = close(client, peer).await;
        let texts: Vec<Value> = got[..3]
            .iter()
            .map(|m| serde_json::from_str(m.to_text().unwrap()).unwrap())
            .collect();
        assert_eq!(
            texts,
            [
                json!({"type":"send","id":"c-1","to":["bob","carol"],"body":"hi \"there\"\n"}),
                json!({"type":"ack","seq":3471}),
                json!({"type":"sync","after":3400}),
            ]
        );
        assert_eq!(got[3], Message::text("{not json"));
        assert_eq!(got[4], Message::binary(vec![1, 2, 3]));
        assert_eq!(got.len(), 5);
    })
    .await
}

/// Many sends outstanding at once; the peer answers in reverse order with unrelated frames
/// in between, and every waiter gets its own offsets.
#[tokio::test]
async fn send_and_wait_matches_acks_by_id_out_of_order() {
    within(async {
        const N: u64 = 16;
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            let mut sends = Vec::new();
            for _ in 0..N {
                let f = recv(&mut ws).await.unwrap();
                assert_eq!(f["type"], "send");
                sends.push(f);
            }
            for (i, f) in sends.iter().enumerate().rev() {
                let id = f["id"].as_str().unwrap();
                let n: u64 = id.strip_prefix("m-").unwrap().parse().unwrap();
                assert_eq!(f["body"], format!("body {n}"));
                send(&mut ws, send_ack(id, &[((n % 3) as u32, 100 + n), (7, n)])).await;
                if i == 5 {
                    send(&mut ws, deliver(42, "bob", "meanwhile")).await;
                    send(&mut ws, send_ack("nobody-waits", &[(1, 1)])).await;
                }
            }
            recv(&mut ws).await;
        })
        .await;
        let mut client = connect_alice(&url).await;
        let want = |n: u64| BTreeMap::from([((n % 3) as u32, 100 + n), (7, n)]);

        // Half from spawned tasks through handles, half concurrently on the client itself.
        let handle = client.handle();
        let spawned: Vec<_> = (0..N / 2)
            .map(|n| {
                let h = handle.clone();
                tokio::spawn(async move {
                    h.send_and_wait(
                        &format!("m-{n}"),
                        &["bob".into()],
                        &format!("body {n}"),
                        WAIT,
                    )
                    .await
                })
            })
            .collect();
        let recipients = to(&["bob"]);
        let ids: Vec<(u64, String, String)> = (N / 2..N)
            .map(|n| (n, format!("m-{n}"), format!("body {n}")))
            .collect();
        let local = join_all(
            ids.iter()
                .map(|(_, id, body)| client.send_and_wait(id, &recipients, body, WAIT)),
        )
        .await;
        for (n, result) in (N / 2..N).zip(local) {
            assert_eq!(result.unwrap(), want(n), "m-{n}");
        }
        for (n, task) in spawned.into_iter().enumerate() {
            assert_eq!(task.await.unwrap().unwrap(), want(n as u64), "m-{n}");
        }

        // Only the frames no waiter took reach the event stream.
        assert_eq!(
            client.next_event().await,
            Some(Event::Deliver(entry(42, "bob", "meanwhile")))
        );
        assert_eq!(
            client.next_event().await,
            Some(ack_event("nobody-waits", &[(1, 1)]))
        );
        close(client, peer).await;
    })
    .await
}

#[tokio::test]
async fn error_frame_with_the_id_fails_that_send() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            let mut ids = [recv(&mut ws).await.unwrap(), recv(&mut ws).await.unwrap()]
                .map(|f| f["id"].as_str().unwrap().to_owned());
            ids.sort();
            assert_eq!(ids, ["a", "b"]);
            for (code, message, id) in [
                ("bad_json", "invalid JSON", None),
                ("overloaded", "later", Some("b")),
                ("bad_recipient", "recipient #1 is a duplicate", Some("a")),
                ("bad_id", "stray", Some("unknown-id")),
            ] {
                send(&mut ws, error_frame(code, message, id)).await;
            }
            recv(&mut ws).await;
        })
        .await;
        let mut client = connect_alice(&url).await;
        let dup = to(&["bob", "bob"]);
        let ok = to(&["bob"]);
        let (a, b) = tokio::join!(
            client.send_and_wait("a", &dup, "x", WAIT),
            client.send_and_wait("b", &ok, "y", WAIT)
        );
        match a.unwrap_err() {
            e @ Error::Server { .. } => {
                assert_eq!(e.code(), "bad_recipient");
                assert!(!e.retryable());
                assert!(e.to_string().contains("duplicate"), "{e}");
            }
            e => panic!("want Error::Server, got {e:?}"),
        }
        let b = b.unwrap_err();
        assert!(matches!(&b, Error::Server { code, message } if code == "overloaded" && message == "later"));
        assert!(b.retryable());

        for want in [
            error_event("bad_json", "invalid JSON", None),
            error_event("bad_id", "stray", Some("unknown-id")),
        ] {
            assert_eq!(client.next_event().await, Some(want));
        }
        close(client, peer).await;
    })
    .await
}

#[tokio::test]
async fn deliveries_and_odd_frames_become_events_then_closed() {
    within(async {
        let (url, peer) = ready_peer("alice", 5, |mut ws| async move {
            send(&mut ws, deliver(6, "bob", "one")).await;
            send(&mut ws, deliver(7, "carol", "two\nlines")).await;
            send(&mut ws, json!({"type":"from_a_newer_server","x":1})).await;
            ws.send(Message::text("not json at all")).await.unwrap();
            send(&mut ws, json!({"type":"deliver","seq":"8"})).await;
            ws.send(Message::binary(vec![0u8; 3])).await.unwrap();
            send(&mut ws, ready("alice", 5)).await;
            send(&mut ws, deliver(9, "bob", "three")).await;
            ws.close(None).await.unwrap();
            // Drain until the client's close reply.
            while ws.next().await.is_some() {}
        })
        .await;
        let mut client = connect_alice(&url).await;
        assert_eq!(client.ready_after(), 5);
        let mut events = Vec::new();
        while let Some(e) = client.next_event().await {
            events.push(e);
        }
        let bad = |events: &[Event]| {
            events
                .iter()
                .filter(|e| matches!(e, Event::Error { code, id: None, .. } if code == BAD_SERVER_FRAME))
                .count()
        };
        assert_eq!(bad(&events), 4, "{events:#?}");
        let rest: Vec<&Event> = events
            .iter()
            .filter(|e| !matches!(e, Event::Error { .. }))
            .collect();
        assert_eq!(
            rest,
            [
                &Event::Deliver(entry(6, "bob", "one")),
                &Event::Deliver(entry(7, "carol", "two\nlines")),
                &Event::Deliver(entry(9, "bob", "three")),
                &Event::Closed,
            ]
        );
        assert_eq!(client.next_event().await, None);
        peer.await.unwrap();
    })
    .await
}

#[tokio::test]
async fn server_close_fails_pending_and_later_sends() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            assert_eq!(recv(&mut ws).await.unwrap()["id"], "pending");
            ws.close(None).await.unwrap();
            while ws.next().await.is_some() {}
        })
        .await;
        let mut client = connect_alice(&url).await;
        let handle = client.handle();
        let e = client
            .send_and_wait("pending", &to(&["bob"]), "x", WAIT)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Closed), "{e:?}");
        assert!(e.retryable());
        assert_eq!(client.next_event().await, Some(Event::Closed));
        assert_eq!(client.next_event().await, None);
        let e = handle
            .send_and_wait("after", &to(&["bob"]), "x", WAIT)
            .await
            .unwrap_err();
        assert_eq!(e.code(), "closed");
        peer.await.unwrap();
        // The writer stops soon after the reader saw the end; then plain sends fail too.
        while !handle.is_closed() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(matches!(handle.ack(1).await, Err(Error::Closed)));
        drop(client);
    })
    .await
}

#[tokio::test]
async fn client_close_does_the_close_handshake() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            let first = recv(&mut ws).await;
            // A close frame, then a clean end of the stream (not an error).
            let close = ws.next().await.unwrap().unwrap();
            let end = ws.next().await;
            (first, close, end.map(|r| r.map_err(|e| e.to_string())))
        })
        .await;
        let client = connect_alice(&url).await;
        let handle = client.handle();
        client.ack(7).await.unwrap();
        let (first, close_frame, end) = close(client, peer).await;
        assert_eq!(first, Some(json!({"type":"ack","seq":7})));
        assert!(close_frame.is_close(), "{close_frame:?}");
        assert!(end.is_none(), "{end:?}");
        assert!(matches!(handle.sync(0).await, Err(Error::Closed)));
    })
    .await
}

#[tokio::test]
async fn timed_out_send_and_late_ack() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            assert_eq!(recv(&mut ws).await.unwrap()["id"], "slow");
            // Answer only after the client has given up and says so with a sync.
            assert_eq!(recv(&mut ws).await.unwrap()["type"], "sync");
            send(&mut ws, send_ack("slow", &[(0, 1)])).await;
            recv(&mut ws).await;
        })
        .await;
        let mut client = connect_alice(&url).await;
        let e = client
            .send_and_wait("slow", &to(&["bob"]), "x", Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout(..)), "{e:?}");
        assert_eq!(e.code(), "timeout");
        client.sync(0).await.unwrap();
        assert_eq!(
            client.next_event().await,
            Some(ack_event("slow", &[(0, 1)]))
        );
        close(client, peer).await;
    })
    .await
}

#[tokio::test]
async fn one_waiter_per_id() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            for n in 1..=2 {
                let f = recv(&mut ws).await.unwrap();
                assert_eq!(f["id"], "dup");
                send(&mut ws, send_ack("dup", &[(0, n)])).await;
            }
            recv(&mut ws).await;
        })
        .await;
        let client = connect_alice(&url).await;
        let bob = to(&["bob"]);
        let first = client.start_send("dup", &bob, "x").await.unwrap();
        assert_eq!(first.id(), "dup");
        let e = client.start_send("dup", &bob, "x").await.unwrap_err();
        assert!(matches!(&e, Error::IdInFlight(id) if id == "dup"), "{e:?}");
        assert_eq!(first.wait(WAIT).await.unwrap(), BTreeMap::from([(0, 1)]));
        // Answered: the id may wait again (a retry with the same id).
        let again = client.send_and_wait("dup", &bob, "x", WAIT).await.unwrap();
        assert_eq!(again, BTreeMap::from([(0, 2)]));
        close(client, peer).await;
    })
    .await
}

#[tokio::test]
async fn upgrade_refused_with_http_error() {
    within(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}/v1/ws", listener.local_addr().unwrap());
        let peer = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            let refused = accept_hdr_async(tcp, |_: &Request, _: Response| {
                let mut resp = ErrorResponse::new(Some(
                    r#"{"error":{"code":"token_expired","message":"token expired"}}"#.into(),
                ));
                *resp.status_mut() = StatusCode::UNAUTHORIZED;
                Err(resp)
            })
            .await;
            assert!(refused.is_err());
        });
        let e = Client::connect(&url, &Auth::Token("v1.x.y".into()))
            .await
            .unwrap_err();
        match &e {
            Error::Rejected {
                status,
                code,
                message,
            } => {
                assert_eq!((*status, code.as_str()), (401, "token_expired"));
                assert_eq!(message, "token expired");
            }
            e => panic!("want Rejected, got {e:?}"),
        }
        assert_eq!(e.code(), "token_expired");
        assert!(!e.retryable());
        peer.await.unwrap();
    })
    .await
}

#[tokio::test]
async fn connect_failures() {
    within(async {
        // An error frame instead of ready.
        let (url, peer1) = peer(|mut ws, _| async move {
            send(&mut ws, error_frame("forbidden", "no", None)).await;
            let _ = ws.close(None).await;
        })
        .await;
        let e = Client::connect(&url, &dev("alice")).await.unwrap_err();
        assert!(
            matches!(&e, Error::Server { code, .. } if code == "forbidden"),
            "{e:?}"
        );
        peer1.await.unwrap();

        // A deliver before ready.
        let (url, peer2) = peer(|mut ws, _| async move {
            send(&mut ws, deliver(1, "a", "b")).await;
            let _ = recv(&mut ws).await;
        })
        .await;
        let e = Client::connect(&url, &dev("alice")).await.unwrap_err();
        assert_eq!(e.code(), "protocol");
        peer2.await.unwrap();

        // Closed before ready.
        let (url, peer3) = peer(|mut ws, _| async move {
            let _ = ws.close(None).await;
        })
        .await;
        let e = Client::connect(&url, &dev("alice")).await.unwrap_err();
        assert_eq!(e.code(), "closed");
        peer3.await.unwrap();

        // No ready at all.
        let (url, peer4) = peer(|mut ws, _| async move {
            let _ = recv(&mut ws).await;
        })
        .await;
        let e = Client::connect_with_timeout(&url, &dev("alice"), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout(..)), "{e:?}");
        peer4.await.unwrap();

        // Nobody listening.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}/v1/ws", listener.local_addr().unwrap());
        drop(listener);
        let e = Client::connect(&url, &dev("alice")).await.unwrap_err();
        assert_eq!(e.code(), "connect_failed", "{e:?}");
        assert!(e.retryable());

        let e = Client::connect("http://127.0.0.1:1/v1/ws", &dev("a"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "invalid_url");
    })
    .await
}

#[tokio::test]
async fn send_once_returns_the_offsets() {
    within(async {
        let ids = Arc::new(Mutex::new(Vec::new()));
        for explicit in [None, Some("my-id".to_string())] {
            let ids2 = ids.clone();
            let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
                let f = recv(&mut ws).await.unwrap();
                assert_eq!(f["to"], json!(["bob", "carol"]));
                assert_eq!(f["body"], "hello");
                ids2.lock()
                    .unwrap()
                    .push(f["id"].as_str().unwrap().to_owned());
                let id = f["id"].as_str().unwrap();
                send(&mut ws, send_ack(id, &[(3, 17), (12, 3471)])).await;
                assert!(recv(&mut ws).await.is_none());
            })
            .await;
            let offsets = send_once(
                &url,
                &dev("alice"),
                to(&["bob", "carol"]),
                "hello".into(),
                explicit,
            )
            .await
            .unwrap();
            assert_eq!(offsets, BTreeMap::from([(3, 17), (12, 3471)]));
            peer.await.unwrap();
        }
        let ids = ids.lock().unwrap();
        assert!(ids[0].starts_with("cli-"), "{}", ids[0]);
        assert_eq!(ids[1], "my-id");
    })
    .await
}

#[tokio::test]
async fn send_once_reports_a_server_error() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            let f = recv(&mut ws).await.unwrap();
            let id = f["id"].as_str();
            send(&mut ws, error_frame("body_too_large", "too big", id)).await;
            recv(&mut ws).await;
        })
        .await;
        let e = send_once(
            &url,
            &dev("alice"),
            to(&["bob"]),
            "x".into(),
            Some("c-9".into()),
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), "body_too_large");
        peer.await.unwrap();
    })
    .await
}

/// `tail --after 2 --ack`: sync first; entries of the old stream still in flight arrive
/// before the restarted stream, repeats are dropped, every new entry is printed and acked.
#[tokio::test]
async fn tail_syncs_dedupes_and_acks() {
    within(async {
        let (url, peer) = ready_peer("alice", 5, |mut ws| async move {
            // In flight before the sync arrives: the stream after ready.after.
            send(&mut ws, deliver(8, "bob", "eight")).await;
            assert_eq!(recv(&mut ws).await, Some(json!({"type":"sync","after":2})));
            for seq in [3, 4, 4, 8, 9] {
                send(&mut ws, deliver(seq, "bob", "x")).await;
            }
            let mut acks = Vec::new();
            for _ in 0..4 {
                let f = recv(&mut ws).await.unwrap();
                assert_eq!(f["type"], "ack");
                acks.push(f["seq"].as_u64().unwrap());
            }
            ws.close(None).await.unwrap();
            while ws.next().await.is_some() {}
            acks
        })
        .await;
        let mut printed = Vec::new();
        tail(&url, &dev("alice"), Some(2), true, |e| {
            printed.push((e.seq, tidemark_client::format_entry(e)))
        })
        .await
        .unwrap();
        let seqs: Vec<u64> = printed.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [8, 3, 4, 9]);
        assert_eq!(printed[0].1, "#8 2025-11-30T08:00:00.000008Z bob: eight");
        assert_eq!(peer.await.unwrap(), [8, 3, 4, 9]);
    })
    .await
}

#[tokio::test]
async fn tail_without_after_starts_at_ready_and_does_not_ack() {
    within(async {
        let (url, peer) = ready_peer("alice", 5, |mut ws| async move {
            for seq in [5, 6, 6, 7] {
                send(&mut ws, deliver(seq, "bob", "x")).await;
            }
            ws.close(None).await.unwrap();
            let mut got = Vec::new();
            while let Some(Ok(m)) = ws.next().await {
                if m.is_text() {
                    got.push(m);
                }
            }
            got
        })
        .await;
        let mut seqs = Vec::new();
        tail(&url, &dev("alice"), None, false, |e| seqs.push(e.seq))
            .await
            .unwrap();
        assert_eq!(seqs, [6, 7]);
        assert!(peer.await.unwrap().is_empty(), "no sync, no acks");
    })
    .await
}

#[tokio::test]
async fn tail_stops_on_a_server_error() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            send(&mut ws, deliver(1, "bob", "x")).await;
            send(&mut ws, error_frame("seq_out_of_range", "no", None)).await;
            recv(&mut ws).await;
        })
        .await;
        let mut seqs = Vec::new();
        let e = tail(&url, &dev("alice"), None, false, |e| seqs.push(e.seq))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "seq_out_of_range");
        assert_eq!(seqs, [1]);
        peer.await.unwrap();
    })
    .await
}

/// A peer that stops answering without closing (power loss, a NAT that forgot the flow):
/// nothing arrives, not even a pong. After the read timeout the connection is lost: the
/// pending send fails with Closed and the event stream ends. Before, the read loop waited
/// on the socket forever (here: until `within` gave up).
#[tokio::test]
async fn a_silent_peer_is_a_lost_connection() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            assert_eq!(recv(&mut ws).await.unwrap()["id"], "lost");
            // Alive at the TCP level, never reading or writing again.
            tokio::time::sleep(Duration::from_secs(3600)).await;
            drop(ws);
        })
        .await;
        let options = ClientOptions::default()
            .with_read_timeout(Duration::from_millis(500))
            .with_ping_interval(Duration::from_millis(100));
        let mut client = Client::connect_with(&url, &dev("alice"), &options)
            .await
            .unwrap();
        let e = client
            .send_and_wait("lost", &to(&["bob"]), "x", Duration::from_secs(3600))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Closed), "{e:?}");
        assert_eq!(client.next_event().await, Some(Event::Closed));
        assert_eq!(client.next_event().await, None);
        peer.abort();
    })
    .await
}

/// A server with nothing to send (and that, like the gateway, pings only a silent client)
/// still answers the client's pings, so a chatty client on a quiet mailbox keeps its
/// connection past the read timeout. Before, the client sent no pings.
#[tokio::test]
async fn pings_keep_a_quiet_connection() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            let (mut pings, mut acks) = (0, 0);
            // Reading answers each ping with a pong (tungstenite does it).
            while let Some(Ok(m)) = ws.next().await {
                match m {
                    Message::Ping(_) => pings += 1,
                    Message::Text(_) => acks += 1,
                    Message::Close(_) => break,
                    _ => {}
                }
            }
            (pings, acks)
        })
        .await;
        let read_timeout = Duration::from_millis(1500);
        let options = ClientOptions::default()
            .with_read_timeout(read_timeout)
            .with_ping_interval(Duration::from_millis(150));
        let mut client = Client::connect_with(&url, &dev("alice"), &options)
            .await
            .unwrap();
        let start = Instant::now();
        let mut seq = 0;
        while start.elapsed() < 2 * read_timeout {
            seq += 1;
            client.ack(seq).await.unwrap();
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!client.is_closed());
        assert_eq!(
            client.next_event().now_or_never(),
            None,
            "no event, no Closed"
        );
        let (pings, acks) = close(client, peer).await;
        assert_eq!(acks, seq);
        assert!(pings >= 5, "{pings} pings");
    })
    .await
}

/// `tail --after 100` while the acked cursor is 500: the stream from the cursor (501…) is in
/// flight before the server reads the sync, then the restarted stream brings 101, 102, and
/// the connection drops. The reconnect must resume after 102, not after 520 (which skipped
/// 103…300 for good).
#[tokio::test]
async fn tail_resumes_below_entries_that_arrived_first() {
    within(async {
        let mailbox: Vec<u64> = [101, 102, 103, 200, 300]
            .into_iter()
            .chain(501..=520)
            .collect();
        let syncs = Arc::new(Mutex::new(Vec::new()));
        let syncs2 = syncs.clone();
        let (url, peer) = peers(
            |_| None,
            move |mut ws, n| {
                let syncs = syncs2.clone();
                let mailbox = mailbox.clone();
                async move {
                    send(&mut ws, ready("alice", 500)).await;
                    // in flight before the sync is read: the stream from the cursor
                    let in_flight = if n == 0 { 501..=520 } else { 501..=503 };
                    for seq in in_flight {
                        send(&mut ws, deliver(seq, "bob", "x")).await;
                    }
                    let f = recv(&mut ws).await.unwrap();
                    assert_eq!(f["type"], "sync");
                    let after = f["after"].as_u64().unwrap();
                    syncs.lock().unwrap().push(after);
                    let restarted = mailbox.iter().filter(|&&s| s > after);
                    if n == 0 {
                        // two entries of the restarted stream, then the connection drops
                        for &seq in restarted.take(2) {
                            send(&mut ws, deliver(seq, "bob", "x")).await;
                        }
                        hang_up(ws).await;
                    } else {
                        for &seq in restarted {
                            send(&mut ws, deliver(seq, "bob", "x")).await;
                        }
                        send(&mut ws, error_frame("bad_request", "the end", None)).await;
                        hang_up(ws).await;
                    }
                }
            },
        )
        .await;
        let mut printed = Vec::new();
        let e = tail_with(
            &url,
            &dev("alice"),
            Some(100),
            false,
            Some(KEEP_TRYING),
            |e| printed.push(e.seq),
            |_| {},
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), "bad_request");
        peer.abort();
        assert_eq!(*syncs.lock().unwrap(), [100, 102]);
        let mut sorted = printed.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), printed.len(), "shown twice: {printed:?}");
        let mut want: Vec<u64> = [101, 102, 103, 200, 300]
            .into_iter()
            .chain(501..=520)
            .collect();
        want.sort_unstable();
        assert_eq!(sorted, want);
    })
    .await
}

/// Runs a reconnecting `tail` for 3 s against a server that accepts every connection, sends
/// `ready` and hangs up (after reading the client's `sync` when `after_sync`). Returns how
/// many connections it accepted; fails if `tail` returned.
async fn tail_against_a_server_that_hangs_up(after_sync: bool) -> usize {
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    let (url, peer) = peers(
        |_| None,
        move |mut ws, _| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move {
                send(&mut ws, ready("alice", 7)).await;
                if after_sync {
                    assert_eq!(recv(&mut ws).await.unwrap()["type"], "sync");
                }
                hang_up(ws).await;
            }
        },
    )
    .await;
    let mut lost = 0;
    let alice = dev("alice");
    let run = tail_with(
        &url,
        &alice,
        Some(5),
        false,
        Some(KEEP_TRYING),
        |_| {},
        |line| lost += usize::from(line.starts_with("connection lost")),
    );
    let ended = tokio::time::timeout(Duration::from_secs(3), run).await;
    assert!(ended.is_err(), "tail returned: {ended:?}");
    peer.abort();
    assert!(lost >= 1);
    connections.load(Ordering::SeqCst)
}

/// A server that accepts and closes at once (a restart loop, a proxy without a backend):
/// `tail` keeps reconnecting with a growing delay. Before, the delay started again at every
/// successful connect: a reconnect loop at full speed (hundreds of connections in 3 s).
#[tokio::test]
async fn tail_backs_off_from_a_server_that_closes_at_once() {
    within(async {
        let n = tail_against_a_server_that_hangs_up(true).await;
        // attempts at about 0, 0.25, 0.75 and 1.75 s (the next at 3.75 s)
        assert!((2..=6).contains(&n), "{n} connections in 3 s");
    })
    .await
}

/// The server's close is read before `tail` queues its `sync`: one more lost connection,
/// and `tail` reconnects. Before, the sync's `closed` ended `tail` although it reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tail_reconnects_when_the_close_comes_before_its_sync() {
    within(async {
        let n = tail_against_a_server_that_hangs_up(false).await;
        assert!((2..=6).contains(&n), "{n} connections in 3 s");
    })
    .await
}

/// A connection that delivered something new resets the backoff: each of a run of
/// connections that deliver one entry and close is followed by a reconnect at once.
#[tokio::test]
async fn tail_reconnects_at_once_after_a_connection_that_delivered() {
    within(async {
        const N: u64 = 8;
        let (url, peer) = peers(
            |_| None,
            |mut ws, n| async move {
                let n = n as u64;
                send(&mut ws, ready("alice", n)).await;
                if n < N {
                    send(&mut ws, deliver(n + 1, "bob", "x")).await;
                } else {
                    send(&mut ws, error_frame("bad_request", "the end", None)).await;
                }
                hang_up(ws).await;
            },
        )
        .await;
        let start = Instant::now();
        let mut printed = Vec::new();
        let e = tail_with(
            &url,
            &dev("alice"),
            None,
            false,
            Some(KEEP_TRYING),
            |e| printed.push(e.seq),
            |_| {},
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), "bad_request");
        assert_eq!(printed, (1..=N).collect::<Vec<_>>());
        // with the backoff kept it would be 0.25 + 0.5 + 1 + 2 + 4 + 5 + 5 s
        assert!(
            start.elapsed() < Duration::from_secs(8),
            "{:?}",
            start.elapsed()
        );
        peer.abort();
    })
    .await
}

/// An upgrade refused by a proxy during a rolling deploy (502, 503, 504 without the
/// gateway's JSON body) is retryable, as are 5xx, 429 and 408 in general, unless the body
/// carries a known code that is not; and a reconnecting `tail` gets past one. Before, every
/// refusal without a known code was `upgrade_rejected` and not retryable.
#[tokio::test]
async fn an_upgrade_refused_by_a_proxy_is_retryable() {
    within(async {
        let html = "<html><body><h1>502 Bad Gateway</h1></body></html>";
        let cases = [
            (502, html, "upgrade_rejected", true),
            (503, "", "upgrade_rejected", true),
            (504, "Gateway Timeout", "upgrade_rejected", true),
            (500, "", "upgrade_rejected", true),
            (429, "", "upgrade_rejected", true),
            (408, "", "upgrade_rejected", true),
            (
                503,
                r#"{"error":{"code":"overloaded","message":"m"}}"#,
                "overloaded",
                true,
            ),
            (
                503,
                r#"{"error":{"code":"proxy_says_no","message":"m"}}"#,
                "proxy_says_no",
                true,
            ),
            (
                503,
                r#"{"error":{"code":"unauthorized","message":"m"}}"#,
                "unauthorized",
                false,
            ),
            (401, "", "upgrade_rejected", false),
            (403, "", "upgrade_rejected", false),
            (404, "not found", "upgrade_rejected", false),
            (400, "", "upgrade_rejected", false),
        ];
        for (status, body, code, retryable) in cases {
            let (url, peer) = peers(move |_| Some(refusal(status, body)), |_, _| async {}).await;
            let e = Client::connect(&url, &dev("alice")).await.unwrap_err();
            peer.abort();
            assert!(
                matches!(&e, Error::Rejected { status: s, .. } if *s == status),
                "{status}: {e:?}"
            );
            assert_eq!(e.code(), code, "{status} {body}");
            assert_eq!(e.retryable(), retryable, "{status} {body}");
        }

        // A reconnecting tail: a 502 from the proxy, then the gateway is back.
        let (url, peer) = peers(
            move |n| (n == 0).then(|| refusal(502, html)),
            |mut ws, _| async move {
                send(&mut ws, ready("alice", 0)).await;
                send(&mut ws, deliver(1, "bob", "x")).await;
                send(&mut ws, error_frame("bad_request", "the end", None)).await;
                hang_up(ws).await;
            },
        )
        .await;
        let mut printed = Vec::new();
        let e = tail_with(
            &url,
            &dev("alice"),
            None,
            false,
            Some(KEEP_TRYING),
            |e| printed.push(e.seq),
            |_| {},
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), "bad_request");
        assert_eq!(printed, [1]);
        peer.abort();
    })
    .await
}

/// A retry of a send id on the same connection (after its first attempt timed out) gets the
/// answer to its own frame; the late answer to the first attempt becomes an event. The same
/// for a plain `send` followed by a `send_and_wait` of its id. Before, the answer to the
/// earlier frame (here an error) completed the retry's waiter.
#[tokio::test]
async fn a_retry_gets_the_answer_to_its_own_frame() {
    within(async {
        let (url, peer) = ready_peer("alice", 0, |mut ws| async move {
            for (id, first_answer, second) in [
                (
                    "x",
                    error_frame("internal", "commit timed out", Some("x")),
                    7,
                ),
                ("y", error_frame("overloaded", "later", Some("y")), 8),
            ] {
                for _ in 0..2 {
                    assert_eq!(recv(&mut ws).await.unwrap()["id"], id);
                }
                // answered in the order sent: the first frame's answer comes first
                send(&mut ws, first_answer).await;
                send(&mut ws, send_ack(id, &[(0, second)])).await;
            }
            recv(&mut ws).await;
        })
        .await;
        let mut client = connect_alice(&url).await;
        let bob = to(&["bob"]);
        let e = client
            .send_and_wait("x", &bob, "m", Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout(..)), "{e:?}");
        let retry = client.send_and_wait("x", &bob, "m", WAIT).await;
        assert_eq!(retry.unwrap(), BTreeMap::from([(0, 7)]));
        assert_eq!(
            client.next_event().await,
            Some(error_event("internal", "commit timed out", Some("x")))
        );

        client.send("y", &bob, "m").await.unwrap();
        let waited = client.send_and_wait("y", &bob, "m", WAIT).await;
        assert_eq!(waited.unwrap(), BTreeMap::from([(0, 8)]));
        assert_eq!(
            client.next_event().await,
            Some(error_event("overloaded", "later", Some("y")))
        );
        close(client, peer).await;
    })
    .await
}

/// `wss://` cannot work (no TLS in this crate): refused at once as an invalid URL, not
/// retried by a reconnecting `tail` for its whole give-up period as before.
#[tokio::test]
async fn wss_is_refused_at_once() {
    within(async {
        let e = Client::connect("wss://127.0.0.1:1/v1/ws", &dev("alice"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), "invalid_url");
        assert!(!e.retryable());
        assert!(e.to_string().contains("TLS"), "{e}");
        let e = tail_with(
            "wss://127.0.0.1:1/v1/ws",
            &dev("alice"),
            None,
            false,
            Some(KEEP_TRYING),
            |_| {},
            |_| {},
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), "invalid_url");
    })
    .await
}
