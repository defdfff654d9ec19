//! `tidemark bench relay`: the floor under the gateway's CPU per message. A WebSocket server
//! that speaks the client protocol and does nothing else: no Redis, no commit, no mailbox.
//! It is **not** a Tidemark server. It is a yardstick for `bench load --target`, to tell what
//! of the gateway's CPU per message the socket work alone costs on a given machine, and what
//! the durable path costs on top of it.
//!
//! What it does per message is the least a gateway must do:
//! - the sender's `send` frame is parsed by the gateway's parser
//!   ([`tidemark_protocol::frames::parse_client_frame`]);
//! - a `send_ack` is written to the sender;
//! - a `deliver` frame is written to each connected recipient, with a per-user `seq`;
//! - the recipient's `ack` frame is read and parsed, and dropped.
//!
//! It uses the same stack as the gateway: axum's WebSocket with the gateway's buffer sizes
//! and `TCP_NODELAY`,
//! one writer task per socket fed by a bounded channel, and frames written in batches (`feed` while more are queued, then one
//! `flush`). Users come from the `?user=` of the upgrade (as with `--dev-auth`). `/metrics`
//! has `process_cpu_seconds_total`, `process_resident_memory_bytes` and
//! `tidemark_commits_total` (sends answered), so that `bench load --target` reports the
//! relay's CPU per message with the same method as a gateway's.
//!
//! A recipient that is not connected misses its deliveries, and a full queue drops them: the
//! generator then reports them as not delivered. A relay that drops nothing at the measured
//! rate is the floor this yardstick gives.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::serve::ListenerExt;
use axum::Router;
use futures::{SinkExt, StreamExt};
use tidemark_protocol::{parse_client_frame, ClientFrame, Entry, Limits, ServerFrame};
use tokio::sync::mpsc;

/// Frames a socket's writer may hold before deliveries to it are dropped.
const QUEUE: usize = 1024;

/// What the relay's connections share.
#[derive(Default)]
struct Relay {
    /// Each connected user's writer queue and its next `seq`; the last connection of a user
    /// wins.
    users: Mutex<HashMap<String, Arc<Peer>>>,
    /// Sends answered with `send_ack`.
    sends: AtomicU64,
    /// Deliveries dropped: recipient not connected, or its queue full.
    dropped: AtomicU64,
}

/// One connected user.
struct Peer {
    tx: mpsc::Sender<String>,
    /// The `seq` of the last entry handed to this user.
    seq: AtomicU64,
}

/// Serves the relay on `listen` until `shutdown` resolves. Returns the address it bound
/// (port 0 picks one) through `bound` as soon as it listens.
pub async fn run_relay(
    listen: SocketAddr,
    bound: impl FnOnce(SocketAddr),
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let relay = Arc::new(Relay::default());
    let app = Router::new()
        .route("/v1/ws", get(upgrade))
        .route("/metrics", get(metrics))
        .with_state(relay);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    bound(listener.local_addr()?);
    // TCP_NODELAY, as the gateway sets it: small frames must not wait for Nagle
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn upgrade(
    ws: WebSocketUpgrade,
    Query(q): Query<HashMap<String, String>>,
    State(relay): State<Arc<Relay>>,
) -> axum::response::Response {
    let Some(user) = q.get("user").filter(|u| !u.is_empty()).cloned() else {
        return (axum::http::StatusCode::UNAUTHORIZED, "?user= is required").into_response();
    };
    // the gateway's buffer sizes (`gateway/ws/mod.rs`): they change both memory and CPU
    ws.read_buffer_size(4 * 1024)
        .write_buffer_size(32 * 1024)
        .on_upgrade(move |socket| connection(socket, user, relay))
}

async fn connection(socket: WebSocket, user: String, relay: Arc<Relay>) {
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::channel::<String>(QUEUE);
    let peer = Arc::new(Peer {
        tx: tx.clone(),
        seq: AtomicU64::new(0),
    });
    lock(&relay.users).insert(user.clone(), peer.clone());
    let ready = ServerFrame::Ready {
        user: user.clone(),
        after: 0,
    };
    let _ = tx.try_send(ready.to_json());
    // The writer: frames in batches, one flush per batch (as the gateway's outbox writer).
    let writer = tokio::spawn(async move {
        while let Some(first) = rx.recv().await {
            let mut next = Some(first);
            while let Some(text) = next.take() {
                if sink.feed(Message::Text(text.into())).await.is_err() {
                    return;
                }
                next = rx.try_recv().ok();
            }
            if sink.flush().await.is_err() {
                return;
            }
        }
    });
    let limits = Limits::default();
    while let Some(Ok(msg)) = stream.next().await {
        let Message::Text(text) = msg else {
            continue; // pings are answered by the socket; a close ends the stream
        };
        match parse_client_frame(text.as_str(), &limits) {
            Ok(ClientFrame::Send(req)) => {
                let now_us = now_unix_us();
                let mut offsets = BTreeMap::new();
                for to in &req.to {
                    let peer = lock(&relay.users).get(to).cloned();
                    let Some(peer) = peer else {
                        relay.dropped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    let seq = peer.seq.fetch_add(1, Ordering::Relaxed) + 1;
                    offsets.insert(0, seq);
                    let entry = Entry {
                        seq,
                        from: user.clone(),
                        body: req.body.clone(),
                        sent_at_us: now_us,
                    };
                    if peer
                        .tx
                        .try_send(ServerFrame::Deliver(entry).to_json())
                        .is_err()
                    {
                        relay.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
                relay.sends.fetch_add(1, Ordering::Relaxed);
                let ack = ServerFrame::SendAck {
                    id: req.id,
                    offsets,
                };
                if tx.send(ack.to_json()).await.is_err() {
                    break;
                }
            }
            Ok(ClientFrame::Ack { .. } | ClientFrame::Sync { .. }) => {}
            Err(e) => {
                if tx.send(e.to_server_frame().to_json()).await.is_err() {
                    break;
                }
            }
        }
    }
    {
        let mut users = lock(&relay.users);
        if users.get(&user).is_some_and(|p| Arc::ptr_eq(p, &peer)) {
            users.remove(&user);
        }
    }
    drop((tx, peer));
    writer.abort();
}

async fn metrics(State(relay): State<Arc<Relay>>) -> String {
    let me = crate::load::self_sample();
    let mut out = String::new();
    if let Some(cpu) = me.cpu_s {
        out +=
            &format!("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {cpu}\n");
    }
    if let Some(rss) = me.rss_bytes {
        out += &format!(
            "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {rss}\n"
        );
    }
    out += &format!(
        "# TYPE tidemark_commits_total counter\ntidemark_commits_total {}\n\
         # TYPE tidemark_relay_dropped_total counter\ntidemark_relay_dropped_total {}\n",
        relay.sends.load(Ordering::Relaxed),
        relay.dropped.load(Ordering::Relaxed)
    );
    out
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}
