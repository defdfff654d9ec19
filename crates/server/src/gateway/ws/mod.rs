//! `GET /v1/ws`: one WebSocket connection = one authenticated user.
//!
//! Tasks of a connection (all on the gateway's `TaskTracker`):
//!
//! ```text
//!   reader (this task) ── parse ──┬─ send: committed in order by the reader itself
//!                                 │        (ADR-0054; one-shard sends share rounds,
//!                                 │        ADR-0089) ────────────────────── send_ack ─┐
//!                                 ├─ sync ──▶ delivery task ◀── wake hub,             │
//!                                 └─ ack: capped, ack_mailbox    re-check tick         │
//!   every task ── Out (bounded channel) ──▶ writer task (owns the sink) ◀─────────────┘
//! ```
//!
//! The writer is the only owner of the sink. Its queue ([`Outbox`]) is bounded in frames and
//! in bytes (`max_queued_bytes`); the delivery task waits for room (backpressure: a slow
//! client slows its own delivery, nothing else). A frame that waits longer than
//! `slow_client_grace` marks the client as not reading: queued frames are dropped and the
//! connection is closed with 4003 (nothing is lost: the mailbox still holds the entries). An `ack` is capped at
//! the highest seq this connection has written to the socket, so nothing undelivered is ever
//! trimmed.
//!
//! A connection opened with a token ends when the token's `exp` passes: an `error` frame
//! `token_expired`, then close code 4001 (every close code is a [`CloseCode`]). The reader
//! pings a client it has heard nothing from for `ping_interval`, and closes one it has heard
//! nothing from (not even a pong) for `idle_timeout` (4002).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::Response;
use axum::Extension;
use futures::StreamExt;
use tidemark_protocol::{CloseCode, ErrorCode, ServerFrame};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use super::auth::{authenticate, Caller, Endpoint};
use super::http::error_response;
use super::listener::ConnSlot;
use super::state::Shared;
use super::users::UserRef;

mod delivery;
mod going_away;
mod outbox;
mod reader;

use delivery::{delivery_loop, now_us};
use outbox::{writer, Out, Outbox};
use reader::Reader;

/// Frames queued for the writer per connection.
const OUT_CAPACITY: usize = 1024;
/// Sends of a connection awaiting their answers (queued, begun, and the one awaited now; each
/// holding its permit): when this many wait, the reader reads no more frames until one is
/// answered (docs/protocol.md: "While 64 sends of a connection wait for their answers").
const SEND_QUEUE: usize = 64;

/// The next connection's id (from 1; 0 names no connection in the group commit, ADR-0089).
static NEXT_CONN_ID: AtomicU64 = AtomicU64::new(1);
/// Most entries in a mailbox page of the delivery loop (pages are also bounded in bytes).
const PAGE: usize = 256;
/// Most frames written before a flush.
const WRITE_BATCH: usize = 64;
/// How long a closing connection may take to flush its last frames.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A token's expiry is re-checked at least this often (a far `exp` is not one long timer).
const EXPIRY_RECHECK: Duration = Duration::from_secs(3600);

/// WebSocket read buffer of each connection. tungstenite zero-fills all of it on the first
/// read and keeps it for the connection's lifetime, so it is resident memory of every idle
/// connection; client frames are small (a larger frame grows it to the frame's length).
const WS_READ_BUFFER: usize = 4 * 1024;
/// WebSocket write buffer of each connection (tungstenite's default is 128 KiB): it holds
/// frames taken from the queue, so it adds to what a client that does not read costs. The
/// writer flushes every batch anyway.
const WS_WRITE_BUFFER: usize = 32 * 1024;

fn text(frame: &ServerFrame) -> Out {
    Out::Text(frame.to_json())
}

fn error_frame(code: ErrorCode, message: impl Into<String>, id: Option<String>) -> Out {
    crate::telemetry::count_error(code);
    text(&ServerFrame::Error {
        code,
        message: message.into(),
        id,
    })
}

/// The upgrade handler: authenticate first (401 and no WebSocket on failure), then upgrade.
pub(crate) async fn handler(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    slot: Option<Extension<ConnSlot>>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let caller = match authenticate(&shared.opts, &headers, uri.query(), Endpoint::WebSocket) {
        Ok(c) => c,
        Err((code, message)) => return error_response(code, message),
    };
    let ws = match ws {
        Ok(ws) => ws,
        // the JSON error body like every other refusal (axum's own is text/plain)
        Err(rejection) => {
            return error_response(
                ErrorCode::BadRequest,
                format!("not a WebSocket upgrade: {}", rejection.body_text()),
            )
        }
    };
    let Some(user_conn) = shared.users.connect(&caller.user) else {
        return error_response(
            ErrorCode::TooManyConnections,
            format!(
                "this user has {} open connections already; close one, then retry",
                shared.opts.max_connections_per_user
            ),
        );
    };
    // Above the protocol's frame limit, so a moderately oversized frame reaches the parser
    // and gets its `frame_too_large` error frame; only a huge one is cut by the socket.
    let max = shared
        .opts
        .limits
        .max_frame_bytes
        .saturating_mul(2)
        .max(shared.opts.limits.max_frame_bytes.saturating_add(64 * 1024));
    // Counts as a task of the tracker until the connection ends (or the upgrade fails).
    let token = shared.tracker.token();
    // tungstenite zeroes its whole read buffer on every read (128 KiB by default): perf put
    // that memset at 18% of the gateway's CPU. Frames are small; 4 KiB is plenty.
    ws.read_buffer_size(WS_READ_BUFFER)
        .write_buffer_size(WS_WRITE_BUFFER)
        .max_message_size(max)
        .max_frame_size(max)
        .on_upgrade(move |socket| async move {
            let _token = token;
            // The socket counts as an open connection until it closes. Its writes may stall
            // longer than an HTTP response's: the connection itself closes a client that
            // stops reading (4003) and needs the socket until then.
            if let Some(Extension(slot)) = &slot {
                slot.set_write_stall(shared.opts.slow_client_grace * 2 + CLOSE_GRACE);
            }
            let _slot = slot;
            if shared.stop.is_cancelled() {
                return;
            }
            let user = user_conn.user().clone_ref();
            run(shared, caller, socket, user).await;
        })
}

struct ConnectedGauge;

impl ConnectedGauge {
    fn new() -> Self {
        metrics::gauge!("tidemark_connected_clients").increment(1.0);
        ConnectedGauge
    }
}

impl Drop for ConnectedGauge {
    fn drop(&mut self) {
        metrics::gauge!("tidemark_connected_clients").decrement(1.0);
    }
}

/// One connection, from upgrade to close. `user` is the connection's reference to its user's
/// entry (the user's limits).
async fn run(shared: Arc<Shared>, caller: Caller, socket: WebSocket, user_ref: UserRef) {
    let Caller {
        user,
        expires_at_unix,
        ..
    } = caller;
    let _gauge = ConnectedGauge::new();
    // before `ready` is sent: whatever the client sends after it commits later than this
    let connected_at_us = now_us();
    let conn = shared.stop.child_token();
    let kill = CancellationToken::new();
    let (sink, stream) = socket.split();
    let (tx, rx) = Outbox::new(
        shared.opts.max_queued_bytes,
        shared.opts.slow_client_grace,
        conn.clone(),
    );
    // Highest seq handed to the socket: the cap of this connection's acks.
    let written = Arc::new(AtomicU64::new(0));
    // A panic of a connection's task (writer, delivery loop, reader, a send's commit) must
    // never leave the connection open and doing nothing: it cancels `conn`, and `died` says
    // why (the reader closes with 1011); the client reconnects.
    let died = CancellationToken::new();
    let fault = shared
        .opts
        .send_fault
        .clone()
        .map(|f| (f, Arc::<str>::from(user.as_str())));
    // The writer owns the sink: if it dies the close frame cannot be written, and the
    // socket closes when the reader lets go of the stream.
    let mut writer = shared.tracker.spawn(close_on_panic(
        "writer",
        died.clone(),
        conn.clone(),
        writer(
            sink,
            rx,
            written.clone(),
            conn.clone(),
            kill.clone(),
            tx.stalled_flag(),
            fault,
        ),
    ));

    // Register before the first read, so no hint falls between the read and the wait.
    let notify = Arc::new(Notify::new());
    let mut mailbox = shared.mailbox(&user);
    let (_registration, local) = shared.hub.register_local(
        &user,
        mailbox.route.shard,
        notify.clone(),
        shared.opts.max_queued_bytes,
    );
    tracing::debug!(%user, shard = mailbox.route.shard, "client connected");

    let acked = tokio::select! {
        _ = conn.cancelled() => None,
        r = Box::pin(mailbox.acked()) => match r {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::warn!(%user, error = %e, "reading the acked cursor failed");
                let _ = Box::pin(tx
                    .send(error_frame(ErrorCode::Internal, "mailbox unavailable; reconnect later", None)))
                    .await;
                None
            }
        }
    };
    let Some(acked) = acked else {
        let code = if conn.is_cancelled() {
            CloseCode::GoingAway
        } else {
            CloseCode::InternalError
        };
        Box::pin(close(tx, code, &mut writer, &kill)).await;
        return;
    };
    written.fetch_max(acked, Ordering::Relaxed);
    let _ = Box::pin(tx.send(text(&ServerFrame::Ready {
        user: user.clone(),
        after: acked,
    })))
    .await;

    let (sync_tx, sync_rx) = mpsc::channel::<u64>(16);
    // A panic of the delivery loop must not leave a connection that reads frames but never
    // delivers: it closes the connection (1011), the client reconnects. (A panic of a send's
    // commit, which runs in the reader, closes it the same way: `Reader::on_committed`.)
    let delivery = shared.tracker.spawn(close_on_panic(
        "delivery_loop",
        died.clone(),
        conn.clone(),
        delivery_loop(
            shared.clone(),
            shared.mailbox(&user),
            acked,
            notify,
            local,
            sync_rx,
            tx.clone(),
            conn.clone(),
            connected_at_us,
        ),
    ));
    let mut reader = Reader {
        shared: &shared,
        mailbox,
        tx: &tx,
        sync_tx,
        sender_id: Arc::from(user.as_str()),
        user: user_ref,
        sends: Default::default(),
        begun: Default::default(),
        commit_in_flight: None,
        slow_in_flight: false,
        in_flight_id: None,
        admitting: None,
        open_round: None,
        conn_id: NEXT_CONN_ID.fetch_add(1, Ordering::Relaxed),
        front_checked: false,
        written,
        last_ack: acked,
        pending_ack: acked,
        ack_in_flight: None,
        ack_retry_at: None,
        ack_backoff: delivery::READ_RETRY_FIRST,
        conn: conn.clone(),
        died,
        // an `exp` past what the clock can hold (a signed `--ttl` of centuries) never comes:
        // before, the addition panicked the connection's task after its `ready` (ADR-0107)
        expires_at: expires_at_unix.and_then(|s| UNIX_EPOCH.checked_add(Duration::from_secs(s))),
    };
    let code = match crate::supervise::catch_panic(reader.run(stream, &conn)).await {
        Ok(code) => {
            // best effort: a coalesced ack is not left behind by a clean close
            let _ = tokio::time::timeout(CLOSE_GRACE, Box::pin(reader.flush_ack())).await;
            code
        }
        // Before, a panic here unwound the connection's task: the delivery loop and the
        // writer ended after it and the client got a normal close (1000), with nothing logged
        // or counted.
        Err(msg) => {
            panicked("reader", &msg);
            CloseCode::InternalError
        }
    };
    // a commit in flight is dropped: its client resends the same id (dedupe makes that safe)
    drop(reader);

    conn.cancel();
    let _ = delivery.await;
    Box::pin(close(tx, code, &mut writer, &kill)).await;
    tracing::debug!(%user, %code, "client disconnected");
}

/// Runs a connection task; a panic is logged, counted and ends the connection: `died` says
/// why (read by the reader once `conn` is cancelled, for the close code).
async fn close_on_panic(
    task: &'static str,
    died: CancellationToken,
    conn: CancellationToken,
    fut: impl std::future::Future<Output = ()>,
) {
    if let Err(msg) = crate::supervise::catch_panic(fut).await {
        panicked(task, &msg);
        died.cancel();
        conn.cancel();
    }
}

/// Logs and counts the panic of a connection's task `task` (`tidemark_task_restarts_total`,
/// reason `panic`); the caller ends the connection.
fn panicked(task: &'static str, msg: &str) {
    tracing::error!(task, panic = %msg, "connection task panicked; closing the connection");
    metrics::counter!("tidemark_task_restarts_total", "task" => task, "reason" => "panic")
        .increment(1);
}

/// Queues the close frame behind what is queued (a stalled connection's queue is dropped
/// instead) and lets the writer finish, all within [`CLOSE_GRACE`]; then aborts the writer
/// (a client that does not read).
async fn close(
    tx: Outbox,
    code: CloseCode,
    writer: &mut tokio::task::JoinHandle<()>,
    kill: &CancellationToken,
) {
    metrics::counter!("tidemark_ws_closes_total", "code" => code.as_str()).increment(1);
    let deadline = tokio::time::Instant::now() + CLOSE_GRACE;
    tx.close(code, deadline).await;
    drop(tx);
    if tokio::time::timeout_at(deadline, &mut *writer)
        .await
        .is_err()
    {
        kill.cancel();
        let _ = writer.await;
    }
}

/// Runs a channel send unless the connection is cancelled while it waits; true when it was
/// sent. The send is polled first (`biased`): one that finds room at once (nearly every
/// one) never polls the cancellation, which would register a waiter on the token and remove
/// it again, each under a lock. A connection cancelled meanwhile is seen at its task's
/// next wait.
async fn until_cancelled<E>(
    conn: &CancellationToken,
    send: impl std::future::Future<Output = Result<(), E>>,
) -> bool {
    tokio::select! {
        biased;
        r = send => r.is_ok(),
        _ = conn.cancelled() => false,
    }
}
