//! The reader side of a connection: parses client frames ([`Reader`]) — sends go to the send
//! loop in order, syncs to the delivery loop, acks are capped and coalesced — and the send
//! loop that commits a connection's sends one after another.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::extract::ws::{Message, WebSocket};
use futures::stream::SplitStream;
use futures::StreamExt;
use tidemark_protocol::{
    parse_client_frame, ClientFrame, CloseCode, ErrorCode, SendRequest, ServerFrame,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::delivery::{READ_RETRY_FIRST, READ_RETRY_MAX};
use super::outbox::{Out, Outbox};
use super::{close_on_panic, error_frame, text, until_cancelled, EXPIRY_RECHECK, SEND_QUEUE};
use crate::gateway::acks::AckAnswer;
use crate::gateway::mailbox::Mailbox;
use crate::gateway::send::{self, CommitPermit};
use crate::gateway::state::Shared;

/// A send queued for the send loop, with its commit permit and when it arrived.
type QueuedSend = (SendRequest, CommitPermit, Instant);

pub(super) struct Reader<'a> {
    pub(super) shared: &'a Arc<Shared>,
    pub(super) mailbox: Mailbox,
    pub(super) tx: &'a Outbox,
    pub(super) sync_tx: mpsc::Sender<u64>,
    /// The send loop's queue and task, started by the connection's first send: a connection
    /// that only receives (most of them) never holds either.
    pub(super) sender: Option<(mpsc::Sender<QueuedSend>, JoinHandle<()>)>,
    pub(super) written: Arc<AtomicU64>,
    pub(super) last_ack: u64,
    /// Highest ack received but not yet written to Redis (acks are coalesced).
    pub(super) pending_ack: u64,
    /// The ack being written (grouped with other connections' acks, ADR-0038): at most one
    /// per connection; acks that arrive meanwhile are coalesced into `pending_ack`.
    pub(super) ack_in_flight: Option<AckAnswer>,
    /// After a failed ack write: when the pending ack is handed over again by itself (no
    /// client frame may follow: the quiet path).
    pub(super) ack_retry_at: Option<tokio::time::Instant>,
    /// The wait before the next retry: 200 ms after a success, doubling to 5 s.
    pub(super) ack_backoff: Duration,
    pub(super) conn: CancellationToken,
    /// Cancelled when the delivery or send loop panicked: the connection is closed.
    pub(super) died: CancellationToken,
    /// When the connection's token expires (`None`: dev auth, no token).
    pub(super) expires_at: Option<SystemTime>,
}

impl Reader<'_> {
    /// The send loop's queue, starting the loop on first use.
    fn send_queue(&mut self) -> &mpsc::Sender<QueuedSend> {
        let (shared, tx, conn, died) = (self.shared, self.tx, &self.conn, &self.died);
        let user = &self.mailbox.user;
        &self
            .sender
            .get_or_insert_with(|| {
                let (send_tx, send_rx) = mpsc::channel(SEND_QUEUE);
                let task = shared.tracker.spawn(close_on_panic(
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
                (send_tx, task)
            })
            .0
    }

    /// Hands the pending ack to the ack queue, unless one is in flight or nothing is pending.
    fn submit_ack(&mut self) {
        if self.ack_in_flight.is_some() || self.pending_ack <= self.last_ack {
            return;
        }
        let m = &self.mailbox;
        self.ack_in_flight = Some(self.shared.acks.submit(
            m.route.mailbox,
            m.route.shard,
            &m.user,
            self.pending_ack,
        ));
    }

    /// Takes the answer to the ack in flight; then hands over what was coalesced meanwhile.
    /// False when the connection is gone.
    async fn on_ack_answer(
        &mut self,
        answer: Result<Result<u64, tidemark_store::Error>, oneshot::error::RecvError>,
    ) -> bool {
        self.ack_in_flight = None;
        match answer {
            Ok(Ok(cursor)) => {
                self.last_ack = self.last_ack.max(cursor);
                self.ack_backoff = READ_RETRY_FIRST;
                metrics::counter!("tidemark_acks_total").increment(1);
                self.submit_ack();
                true
            }
            failed => {
                let e = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "the ack queue stopped before answering".to_string(),
                };
                tracing::warn!(user = %self.mailbox.user, error = %e, "ack failed");
                // what was pending stays pending: handed over again by itself after a backoff
                // (200 ms doubling to 5 s), with the client's next ack, or on close
                self.ack_retry_at = Some(tokio::time::Instant::now() + self.ack_backoff);
                self.ack_backoff = (self.ack_backoff * 2).min(READ_RETRY_MAX);
                self.reply(error_frame(
                    ErrorCode::Internal,
                    "ack failed; send it again",
                    None,
                ))
                .await
            }
        }
    }

    /// Writes the pending ack, if any, for a closing connection: straight to Redis, not
    /// through the ack queue's linger, so that a client that acks, closes and reconnects
    /// right away finds its cursor moved (an ack is a max: the one still in flight, if any,
    /// cannot move it back).
    pub(super) async fn flush_ack(&mut self) -> bool {
        if self.pending_ack <= self.last_ack {
            return true;
        }
        match self.mailbox.ack(self.pending_ack).await {
            Ok(cursor) => {
                self.last_ack = self.last_ack.max(cursor);
                metrics::counter!("tidemark_acks_total").increment(1);
                true
            }
            Err(e) => {
                tracing::warn!(user = %self.mailbox.user, error = %e, "ack on close failed");
                false
            }
        }
    }

    /// Reads frames until the client leaves, the token expires or the connection is
    /// cancelled; returns the close code to send.
    pub(super) async fn run(
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
        // The three ends of the connection, each waited for by one future registered once
        // (a `cancelled()` made anew per frame took four locks). The frame comes first
        // (`biased`): a reader woken by a frame takes it without polling the others; they
        // are polled whenever the socket has nothing (tokio's cooperative budget makes a
        // socket that always has data answer "pending" every 128 reads).
        let tx = self.tx;
        let died = self.died.clone();
        let stalled = tx.stalled.cancelled();
        let going_away = conn.cancelled();
        let panicked = died.cancelled();
        tokio::pin!(stalled, going_away, panicked);
        loop {
            let msg = tokio::select! {
                biased;
                m = stream.next() => m,
                _ = &mut stalled => return CloseCode::SlowConsumer,
                _ = &mut going_away => return CloseCode::GoingAway,
                _ = &mut panicked => return CloseCode::InternalError,
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
                _ = tokio::time::sleep_until(self.ack_retry_at.unwrap_or(last_seen)),
                    if self.ack_retry_at.is_some() => {
                    self.ack_retry_at = None;
                    self.submit_ack();
                    continue;
                }
                answer = async { self.ack_in_flight.as_mut().expect("only polled when set").await },
                    if self.ack_in_flight.is_some() => {
                    if !Box::pin(self.on_ack_answer(answer)).await {
                        return CloseCode::InternalError;
                    }
                    continue;
                }
            };
            last_seen = tokio::time::Instant::now();
            let ok = match msg {
                None | Some(Ok(Message::Close(_))) => return CloseCode::Normal,
                Some(Err(e)) => {
                    let e = e.to_string();
                    if e.contains("Space limit exceeded") {
                        let max = self.shared.opts.limits.max_frame_bytes;
                        Box::pin(self.reply(error_frame(
                            ErrorCode::FrameTooLarge,
                            format!("frame exceeds {max} bytes by far; closing"),
                            None,
                        )))
                        .await;
                        return CloseCode::MessageTooBig;
                    }
                    tracing::debug!(error = %e, "websocket read failed");
                    return CloseCode::InternalError;
                }
                Some(Ok(Message::Text(t))) => Box::pin(self.on_text(t.as_str(), conn)).await,
                Some(Ok(Message::Binary(_))) => {
                    Box::pin(self.reply(error_frame(
                        ErrorCode::BadRequest,
                        "binary frames are not part of the protocol; send JSON text frames",
                        None,
                    )))
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
                        until_cancelled(conn, self.send_queue().send((req, permit, received))).await
                    }
                    Err((code, message)) => {
                        self.reply(error_frame(code, message, Some(req.id))).await
                    }
                }
            }
            Ok(ClientFrame::Ack { seq }) => {
                // Never trim what this connection has not written to the socket.
                let capped = seq.min(self.written.load(Ordering::Relaxed));
                self.pending_ack = self.pending_ack.max(capped);
                // coalesced into the one in flight, if any: handed over when it is answered
                // (an ack at or below what is written changes nothing; one repeated after a
                // failed write hands the pending one over again)
                self.submit_ack();
                true
            }
            Ok(ClientFrame::Sync { after }) => {
                until_cancelled(conn, self.sync_tx.send(after)).await
            }
        }
    }
}

/// Commits the connection's sends one after another (a client's sends to one mailbox keep
/// their order) and answers each with `send_ack` or `error`.
pub(super) async fn send_loop(
    shared: Arc<Shared>,
    user: String,
    mut rx: mpsc::Receiver<(SendRequest, CommitPermit, Instant)>,
    tx: Outbox,
    conn: CancellationToken,
) {
    // registered once, not per send (see `until_cancelled`)
    let going_away = conn.cancelled();
    tokio::pin!(going_away);
    loop {
        let next = tokio::select! {
            _ = &mut going_away => return,
            n = rx.recv() => n,
        };
        let Some((req, permit, received)) = next else {
            return;
        };
        let res = tokio::select! {
            // Dropped mid-commit: the client resends the same id; dedupe makes that safe.
            _ = &mut going_away => return,
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
