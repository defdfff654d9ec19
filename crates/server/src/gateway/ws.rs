//! `GET /v1/ws`: one WebSocket connection = one authenticated user.
//!
//! Tasks of a connection (all on the gateway's `TaskTracker`):
//!
//! ```text
//!   reader (this task) ── parse ──┬─ send ──▶ sender task (commits in order) ──┐
//!                                 ├─ sync ──▶ delivery task ◀── wake hub,     │
//!                                 └─ ack: capped, ack_mailbox    re-check tick │
//!   every task ── Out (bounded channel) ──▶ writer task (owns the sink) ◀─────┘
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
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use tidemark_protocol::{
    parse_client_frame, ClientFrame, CloseCode, ErrorCode, SendRequest, ServerFrame,
};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::auth::{authenticate, Caller, Endpoint};
use super::http::error_response;
use super::http::largest_entry;
use super::listener::ConnSlot;
use super::mailbox::{Mailbox, PageSizer};
use super::send::{self, CommitPermit};
use super::state::Shared;

/// Frames queued for the writer per connection.
const OUT_CAPACITY: usize = 1024;
/// Sends queued (permit held) for the sender task per connection.
const SEND_QUEUE: usize = 64;
/// Most entries in a mailbox page of the delivery loop (pages are also bounded in bytes).
const PAGE: usize = 256;
/// Most frames written before a flush.
const WRITE_BATCH: usize = 64;
/// How long a closing connection may take to flush its last frames.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// A token's expiry is re-checked at least this often (a far `exp` is not one long timer).
const EXPIRY_RECHECK: Duration = Duration::from_secs(3600);

/// What the writer sends.
enum Out {
    /// A server frame (already JSON).
    Text(String),
    /// A `deliver` frame of `seq`.
    Deliver { seq: u64, text: String },
    /// A ping (keep-alive probe).
    Ping,
    /// Close the socket after what is queued before.
    Close(CloseCode),
}

impl Out {
    /// Bytes this frame holds while queued.
    fn bytes(&self) -> usize {
        match self {
            Out::Text(t) | Out::Deliver { text: t, .. } => t.len(),
            Out::Ping | Out::Close(_) => 0,
        }
    }
}

/// A frame in the writer's queue, with the byte permits it holds until it is written.
struct Queued {
    out: Out,
    _bytes: Option<OwnedSemaphorePermit>,
}

/// The connection is gone (or its client stopped reading): nothing more is queued.
struct Gone;

/// The writer's queue: at most [`OUT_CAPACITY`] frames and about `max_queued_bytes` bytes
/// (one permit of `bytes` per byte; a frame larger than the budget takes all of it). A frame
/// that finds no room within the grace period cancels `stalled`.
#[derive(Clone)]
struct Outbox {
    tx: mpsc::Sender<Queued>,
    bytes: Arc<Semaphore>,
    budget: usize,
    grace: Duration,
    stalled: CancellationToken,
}

impl Outbox {
    fn new(budget: usize, grace: Duration) -> (Outbox, mpsc::Receiver<Queued>) {
        let budget = budget.clamp(1, u32::MAX as usize >> 1);
        let (tx, rx) = mpsc::channel(OUT_CAPACITY);
        let outbox = Outbox {
            tx,
            bytes: Arc::new(Semaphore::new(budget)),
            budget,
            grace,
            stalled: CancellationToken::new(),
        };
        (outbox, rx)
    }

    /// Queues `out`, waiting for room at most the grace period.
    async fn send(&self, out: Out) -> Result<(), Gone> {
        if self.stalled.is_cancelled() {
            return Err(Gone);
        }
        let n = out.bytes().clamp(1, self.budget) as u32;
        let deadline = tokio::time::Instant::now() + self.grace;
        let permit =
            match tokio::time::timeout_at(deadline, self.bytes.clone().acquire_many_owned(n)).await
            {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => return Err(Gone),
                Err(_) => return Err(self.stall()),
            };
        let queued = Queued {
            out,
            _bytes: Some(permit),
        };
        match tokio::time::timeout_at(deadline, self.tx.send(queued)).await {
            Ok(r) => r.map_err(|_| Gone),
            Err(_) => Err(self.stall()),
        }
    }

    /// Queues `out` if there is room right now.
    fn try_send(&self, out: Out) -> bool {
        let n = out.bytes().clamp(1, self.budget) as u32;
        let Ok(permit) = self.bytes.clone().try_acquire_many_owned(n) else {
            return false;
        };
        self.tx
            .try_send(Queued {
                out,
                _bytes: Some(permit),
            })
            .is_ok()
    }

    /// Queues the close frame (outside the byte budget), waiting until `deadline`.
    async fn close(&self, code: CloseCode, deadline: tokio::time::Instant) {
        let queued = Queued {
            out: Out::Close(code),
            _bytes: None,
        };
        let _ = tokio::time::timeout_at(deadline, self.tx.send(queued)).await;
    }

    fn stall(&self) -> Gone {
        if !self.stalled.is_cancelled() {
            metrics::counter!("tidemark_slow_clients_total").increment(1);
            self.stalled.cancel();
        }
        Gone
    }
}

/// WebSocket read buffer of each connection.
const WS_READ_BUFFER: usize = 8 * 1024;
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
        Err(rejection) => return rejection.into_response(),
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
    // that memset at 18% of the gateway's CPU. Frames are small; 8 KiB is plenty.
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
            let _user_conn = user_conn;
            if shared.stop.is_cancelled() {
                return;
            }
            run(shared, caller, socket).await;
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

/// One connection, from upgrade to close.
async fn run(shared: Arc<Shared>, caller: Caller, socket: WebSocket) {
    let Caller {
        user,
        expires_at_unix,
    } = caller;
    let _gauge = ConnectedGauge::new();
    // before `ready` is sent: whatever the client sends after it commits later than this
    let connected_at_us = now_us();
    let conn = shared.stop.child_token();
    let kill = CancellationToken::new();
    let (sink, stream) = socket.split();
    let (tx, rx) = Outbox::new(shared.opts.max_queued_bytes, shared.opts.slow_client_grace);
    // Highest seq handed to the socket: the cap of this connection's acks.
    let written = Arc::new(AtomicU64::new(0));
    let mut writer = shared.tracker.spawn(writer(
        sink,
        rx,
        written.clone(),
        conn.clone(),
        kill.clone(),
        tx.stalled.clone(),
    ));

    // Register before the first read, so no hint falls between the read and the wait.
    let notify = Arc::new(Notify::new());
    let _registration = shared.hub.register(&user, notify.clone());
    let mut mailbox = shared.mailbox(&user);
    tracing::debug!(%user, shard = mailbox.route.shard, "client connected");

    let acked = tokio::select! {
        _ = conn.cancelled() => None,
        r = mailbox.acked() => match r {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::warn!(%user, error = %e, "reading the acked cursor failed");
                let _ = tx
                    .send(error_frame(ErrorCode::Internal, "mailbox unavailable; reconnect later", None))
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
        close(tx, code, &mut writer, &kill).await;
        return;
    };
    written.fetch_max(acked, Ordering::Relaxed);
    let _ = tx
        .send(text(&ServerFrame::Ready {
            user: user.clone(),
            after: acked,
        }))
        .await;

    let (sync_tx, sync_rx) = mpsc::channel::<u64>(16);
    // A panic of the delivery or send loop must not leave a connection that reads frames but
    // never delivers: it closes the connection (1011), the client reconnects.
    let died = CancellationToken::new();
    let delivery = shared.tracker.spawn(close_on_panic(
        "delivery_loop",
        died.clone(),
        delivery_loop(
            shared.clone(),
            shared.mailbox(&user),
            acked,
            notify,
            sync_rx,
            tx.clone(),
            conn.clone(),
            connected_at_us,
        ),
    ));
    let (send_tx, send_rx) = mpsc::channel(SEND_QUEUE);
    let sender = shared.tracker.spawn(close_on_panic(
        "send_loop",
        died.clone(),
        send_loop(
            shared.clone(),
            user.clone(),
            send_rx,
            tx.clone(),
            conn.clone(),
        ),
    ));

    let mut reader = Reader {
        shared: &shared,
        mailbox,
        tx: &tx,
        sync_tx,
        send_tx,
        written,
        last_ack: acked,
        pending_ack: acked,
        last_ack_flush: Instant::now(),
        conn: conn.clone(),
        died,
        expires_at: expires_at_unix.map(|s| UNIX_EPOCH + Duration::from_secs(s)),
    };
    let code = reader.run(stream, &conn).await;
    // best effort: a coalesced ack is not left behind by a clean close
    let _ = tokio::time::timeout(CLOSE_GRACE, reader.flush_ack()).await;
    drop(reader);

    conn.cancel();
    let _ = delivery.await;
    let _ = sender.await;
    close(tx, code, &mut writer, &kill).await;
    tracing::debug!(%user, %code, "client disconnected");
}

/// Runs a connection task; a panic is logged, counted and ends the connection via `died`.
async fn close_on_panic(
    task: &'static str,
    died: CancellationToken,
    fut: impl std::future::Future<Output = ()>,
) {
    if let Err(msg) = crate::supervise::catch_panic(fut).await {
        tracing::error!(task, panic = %msg, "connection task panicked; closing the connection");
        metrics::counter!("tidemark_task_restarts_total", "task" => task, "reason" => "panic")
            .increment(1);
        died.cancel();
    }
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

struct Reader<'a> {
    shared: &'a Shared,
    mailbox: Mailbox,
    tx: &'a Outbox,
    sync_tx: mpsc::Sender<u64>,
    send_tx: mpsc::Sender<(SendRequest, CommitPermit, Instant)>,
    written: Arc<AtomicU64>,
    last_ack: u64,
    /// Highest ack received but not yet written to Redis (acks are coalesced).
    pending_ack: u64,
    /// When acks were last written.
    last_ack_flush: Instant,
    conn: CancellationToken,
    /// Cancelled when the delivery or send loop panicked: the connection is closed.
    died: CancellationToken,
    /// When the connection's token expires (`None`: dev auth, no token).
    expires_at: Option<SystemTime>,
}

/// Acks are written to Redis at most this often per connection (the rest are coalesced into
/// the highest one); a pending ack is also written when the connection closes. An ack lost to
/// a gateway crash only means those entries are delivered again (at least once on the wire).
const ACK_FLUSH: Duration = Duration::from_millis(50);

impl Reader<'_> {
    /// Writes the pending ack, if any.
    async fn flush_ack(&mut self) -> bool {
        if self.pending_ack <= self.last_ack {
            return true;
        }
        self.last_ack_flush = Instant::now();
        match self.mailbox.ack(self.pending_ack).await {
            Ok(cursor) => {
                self.last_ack = cursor;
                metrics::counter!("tidemark_acks_total").increment(1);
                true
            }
            Err(e) => {
                tracing::warn!(user = %self.mailbox.user, error = %e, "ack failed");
                self.reply(error_frame(
                    ErrorCode::Internal,
                    "ack failed; send it again",
                    None,
                ))
                .await
            }
        }
    }

    /// Reads frames until the client leaves, the token expires or the connection is
    /// cancelled; returns the close code to send.
    async fn run(
        &mut self,
        mut stream: SplitStream<WebSocket>,
        conn: &CancellationToken,
    ) -> CloseCode {
        let expiry = tokio::time::sleep(self.until_expiry());
        tokio::pin!(expiry);
        let opts = &self.shared.opts;
        let ping_every = opts.ping_interval.max(Duration::from_millis(10));
        let mut last_seen = tokio::time::Instant::now();
        let keepalive = tokio::time::sleep_until(last_seen + ping_every);
        tokio::pin!(keepalive);
        loop {
            let flush_at = self.last_ack_flush + ACK_FLUSH;
            let ack_due = self.pending_ack > self.last_ack;
            let msg = tokio::select! {
                _ = self.tx.stalled.cancelled() => return CloseCode::SlowConsumer,
                _ = conn.cancelled() => return CloseCode::GoingAway,
                _ = self.died.cancelled() => return CloseCode::InternalError,
                _ = &mut expiry, if self.expires_at.is_some() => {
                    if self.until_expiry().is_zero() {
                        // Best effort (never waits): the close code says it anyway.
                        self.tx.try_send(error_frame(
                            ErrorCode::TokenExpired,
                            "the token expired; reconnect with a new token",
                            None,
                        ));
                        return CloseCode::TokenExpired;
                    }
                    let at = tokio::time::Instant::now() + self.until_expiry();
                    expiry.as_mut().reset(at);
                    continue;
                }
                _ = &mut keepalive => {
                    let now = tokio::time::Instant::now();
                    let idle_at = last_seen + opts.idle_timeout;
                    if now >= idle_at {
                        return CloseCode::IdleTimeout;
                    }
                    let mut next = last_seen + ping_every;
                    if now >= next {
                        // Never waits: a client whose queue is full is not reading anyway.
                        self.tx.try_send(Out::Ping);
                        next = now + ping_every;
                    }
                    keepalive.as_mut().reset(next.min(idle_at));
                    continue;
                }
                _ = tokio::time::sleep_until(flush_at.into()), if ack_due => {
                    if !self.flush_ack().await {
                        return CloseCode::InternalError;
                    }
                    continue;
                }
                m = stream.next() => m,
            };
            last_seen = tokio::time::Instant::now();
            let ok = match msg {
                None | Some(Ok(Message::Close(_))) => return CloseCode::Normal,
                Some(Err(e)) => {
                    let e = e.to_string();
                    if e.contains("Space limit exceeded") {
                        let max = self.shared.opts.limits.max_frame_bytes;
                        self.reply(error_frame(
                            ErrorCode::FrameTooLarge,
                            format!("frame exceeds {max} bytes by far; closing"),
                            None,
                        ))
                        .await;
                        return CloseCode::MessageTooBig;
                    }
                    tracing::debug!(error = %e, "websocket read failed");
                    return CloseCode::InternalError;
                }
                Some(Ok(Message::Text(t))) => self.on_text(t.as_str(), conn).await,
                Some(Ok(Message::Binary(_))) => {
                    self.reply(error_frame(
                        ErrorCode::BadRequest,
                        "binary frames are not part of the protocol; send JSON text frames",
                        None,
                    ))
                    .await
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => true,
            };
            if !ok {
                return if self.tx.stalled.is_cancelled() {
                    CloseCode::SlowConsumer
                } else {
                    CloseCode::InternalError
                };
            }
        }
    }

    /// Time left until the token's `exp` (capped at [`EXPIRY_RECHECK`]; zero once passed).
    fn until_expiry(&self) -> Duration {
        self.expires_at
            .map_or(EXPIRY_RECHECK, |at| {
                at.duration_since(SystemTime::now())
                    .unwrap_or(Duration::ZERO)
            })
            .min(EXPIRY_RECHECK)
    }

    /// Queues a frame for the writer (waiting for room); false when the connection is gone.
    async fn reply(&self, out: Out) -> bool {
        until_cancelled(&self.conn, self.tx.send(out)).await
    }

    /// Handles one text frame; false when the connection is gone.
    async fn on_text(&mut self, frame: &str, conn: &CancellationToken) -> bool {
        let received = Instant::now();
        match parse_client_frame(frame, &self.shared.opts.limits) {
            Err(e) => {
                metrics::counter!("tidemark_client_errors_total", "code" => e.code()).increment(1);
                self.reply(text(&e.to_server_frame())).await
            }
            Ok(ClientFrame::Send(req)) => {
                let permit = tokio::select! {
                    _ = conn.cancelled() => return false,
                    p = send::reserve(self.shared, &self.mailbox.user, &req) => p,
                };
                match permit {
                    Ok(permit) => {
                        until_cancelled(conn, self.send_tx.send((req, permit, received))).await
                    }
                    Err((code, message)) => {
                        self.reply(error_frame(code, message, Some(req.id))).await
                    }
                }
            }
            Ok(ClientFrame::Ack { seq }) => {
                // Never trim what this connection has not written to the socket.
                let capped = seq.min(self.written.load(Ordering::Relaxed));
                if capped <= self.pending_ack.max(self.last_ack) {
                    return true;
                }
                self.pending_ack = capped;
                if self.last_ack_flush.elapsed() < ACK_FLUSH {
                    return true; // coalesced: written by the flush timer
                }
                tokio::select! {
                    _ = conn.cancelled() => false,
                    ok = self.flush_ack() => ok,
                }
            }
            Ok(ClientFrame::Sync { after }) => {
                until_cancelled(conn, self.sync_tx.send(after)).await
            }
        }
    }
}

/// Runs a channel send unless the connection is cancelled first; true when it was sent.
async fn until_cancelled<E>(
    conn: &CancellationToken,
    send: impl std::future::Future<Output = Result<(), E>>,
) -> bool {
    tokio::select! {
        _ = conn.cancelled() => false,
        r = send => r.is_ok(),
    }
}

/// Commits the connection's sends one after another (a client's sends to one mailbox keep
/// their order) and answers each with `send_ack` or `error`.
async fn send_loop(
    shared: Arc<Shared>,
    user: String,
    mut rx: mpsc::Receiver<(SendRequest, CommitPermit, Instant)>,
    tx: Outbox,
    conn: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            _ = conn.cancelled() => return,
            n = rx.recv() => n,
        };
        let Some((req, permit, received)) = next else {
            return;
        };
        let res = tokio::select! {
            // Dropped mid-commit: the client resends the same id; dedupe makes that safe.
            _ = conn.cancelled() => return,
            r = send::commit(&shared, &user, &req) => r,
        };
        drop(permit);
        let out = match res {
            Ok(offsets) => {
                metrics::histogram!("tidemark_send_ack_seconds")
                    .record(received.elapsed().as_secs_f64());
                text(&ServerFrame::SendAck {
                    id: req.id,
                    offsets,
                })
            }
            Err((code, message)) => error_frame(code, message, Some(req.id)),
        };
        if !until_cancelled(&conn, tx.send(out)).await {
            return;
        }
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Pushes the mailbox to the client: every visible entry after the cursor, in seq order,
/// then waits for a hint, the re-check tick or a `sync`.
#[allow(clippy::too_many_arguments)]
async fn delivery_loop(
    shared: Arc<Shared>,
    mut mailbox: Mailbox,
    mut cursor: u64,
    notify: Arc<Notify>,
    mut sync_rx: mpsc::Receiver<u64>,
    tx: Outbox,
    conn: CancellationToken,
    connected_at_us: u64,
) {
    let mut tick =
        tokio::time::interval(shared.opts.recheck_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    // Highest seq pushed so far (latency is measured once per entry and connection).
    let mut highest = cursor;
    let mut failing = false;
    // Woken by a hint: read up to the hinted lowest W without reading the watermark (one
    // command instead of a pipeline of two), once a full read has shown the lane present.
    let mut hinted = false;
    let mut lane_present = false;
    let push = |out: Out| until_cancelled(&conn, tx.send(out));
    // Pages of about what the queue holds: a client that does not read holds little.
    let target = shared
        .opts
        .max_page_bytes
        .min(shared.opts.max_queued_bytes)
        .max(1);
    let mut sizer = PageSizer::new(PAGE, target, largest_entry(&shared.opts.limits));
    loop {
        // Read until caught up with what is visible.
        'read: loop {
            if let Some(after) = latest_sync(&mut sync_rx) {
                cursor = after;
            }
            let bound = shared.hub.hinted_w(mailbox.route.shard);
            let use_hint = hinted && lane_present && bound > cursor;
            let page = tokio::select! {
                _ = conn.cancelled() => return,
                p = async {
                    if use_hint {
                        mailbox.read_hinted(cursor, bound, sizer.count(), target).await
                    } else {
                        mailbox.read_visible(cursor, sizer.count(), target).await
                    }
                } => p,
            };
            let page = match page {
                Ok(p) => {
                    failing = false;
                    sizer.observe(p.entries.len(), p.bytes);
                    if !use_hint {
                        lane_present = p.lane_present;
                    }
                    p
                }
                Err(e) => {
                    tracing::warn!(user = %mailbox.user, error = %e, "mailbox read failed; retrying on the next tick");
                    if !failing {
                        failing = true;
                        if !push(error_frame(
                            ErrorCode::Internal,
                            "mailbox read failed; delivery resumes by itself",
                            None,
                        ))
                        .await
                        {
                            return;
                        }
                    }
                    break 'read;
                }
            };
            for entry in page.entries {
                let out = match entry {
                    Ok(e) => {
                        let seq = e.seq;
                        // latency of live deliveries only: an entry committed before this
                        // connection opened is a replay (a reconnect, a late reader), whose
                        // age says nothing about the delivery path
                        if seq > highest {
                            highest = seq;
                            if e.sent_at_us >= connected_at_us {
                                let lat = now_us().saturating_sub(e.sent_at_us) as f64 / 1e6;
                                metrics::histogram!("tidemark_delivery_latency_seconds")
                                    .record(lat);
                            }
                        }
                        metrics::counter!("tidemark_deliveries_total").increment(1);
                        (
                            seq,
                            Out::Deliver {
                                seq,
                                text: ServerFrame::Deliver(e).to_json(),
                            },
                        )
                    }
                    Err(seq) => (
                        seq,
                        error_frame(
                            ErrorCode::Internal,
                            format!("mailbox entry {seq} is unreadable and was skipped"),
                            None,
                        ),
                    ),
                };
                if !push(out.1).await {
                    return;
                }
                cursor = out.0;
                if !sync_rx.is_empty() {
                    continue 'read; // restart after the seq the client named
                }
            }
            if !page.more {
                break 'read;
            }
        }
        hinted = false;
        tokio::select! {
            _ = conn.cancelled() => return,
            _ = notify.notified() => hinted = true,
            _ = tick.tick() => {}
            s = sync_rx.recv() => match s {
                Some(after) => cursor = latest_sync(&mut sync_rx).unwrap_or(after),
                None => return,
            },
        }
    }
}

/// The last of the queued `sync`s, if any.
fn latest_sync(rx: &mut mpsc::Receiver<u64>) -> Option<u64> {
    let mut last = None;
    while let Ok(a) = rx.try_recv() {
        last = Some(a);
    }
    last
}

/// Owns the sink: writes queued frames (batched, one flush per batch) until the channel
/// closes or a `Close` is queued; `kill` aborts it. Once `stalled`, queued frames are dropped
/// unwritten (only the close frame goes out).
async fn writer(
    mut sink: SplitSink<WebSocket, Message>,
    mut rx: mpsc::Receiver<Queued>,
    written: Arc<AtomicU64>,
    conn: CancellationToken,
    kill: CancellationToken,
    stalled: CancellationToken,
) {
    let mut close = None;
    'outer: loop {
        let first = tokio::select! {
            biased;
            _ = kill.cancelled() => return,
            o = rx.recv() => o,
        };
        let Some(first) = first else {
            break;
        };
        let mut next = Some(first);
        let mut batch = 0;
        while let Some(Queued { out, _bytes }) = next.take() {
            let dropped = stalled.is_cancelled() && !matches!(out, Out::Close(_));
            let msg = match out {
                _ if dropped => {
                    next = rx.try_recv().ok();
                    continue;
                }
                Out::Text(t) => Message::Text(t.into()),
                Out::Deliver { seq, text } => {
                    // Handed to the socket: from now on the client may ack it.
                    written.fetch_max(seq, Ordering::Relaxed);
                    Message::Text(text.into())
                }
                Out::Ping => Message::Ping(Default::default()),
                Out::Close(code) => {
                    close = Some(code);
                    break;
                }
            };
            let fed = tokio::select! {
                biased;
                _ = kill.cancelled() => return,
                r = sink.feed(msg) => r,
            };
            if fed.is_err() {
                conn.cancel();
                return;
            }
            batch += 1;
            if batch < WRITE_BATCH {
                next = rx.try_recv().ok();
            }
        }
        let flushed = tokio::select! {
            biased;
            _ = kill.cancelled() => return,
            r = sink.flush() => r,
        };
        if flushed.is_err() {
            conn.cancel();
            return;
        }
        if close.is_some() {
            break 'outer;
        }
    }
    let code = close.unwrap_or(CloseCode::Normal);
    let frame = Message::Close(Some(CloseFrame {
        code: code.as_u16(),
        reason: code.reason().into(),
    }));
    tokio::select! {
        biased;
        _ = kill.cancelled() => {}
        _ = async {
            let _ = sink.send(frame).await;
            let _ = sink.close().await;
        } => {}
    }
}
