//! The reader side of a connection: parses client frames ([`Reader`]) — sends are committed
//! in the order received, by the reader itself (ADR-0054: no task of their own), syncs go to
//! the delivery loop, acks are capped and coalesced.
//!
//! A send to one shard whose commit call claims its id too (nearly every send) is begun as
//! soon as it is admitted and nothing slower is ahead of it: it joins its core instance's
//! queue at once, so several sends of one connection share a round (ADR-0089); their answers
//! are written in order. Any other send (several shards, or an id claimed first) waits until
//! everything before it is answered, and what comes after it waits for it.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
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
use tokio_util::sync::CancellationToken;

use super::delivery::{READ_RETRY_FIRST, READ_RETRY_MAX};
use super::going_away::GoingAway;
use super::outbox::{Out, Outbox};
use super::{error_frame, text, until_cancelled, EXPIRY_RECHECK, SEND_QUEUE};
use crate::gateway::acks::AckAnswer;
use crate::gateway::commit::{Begin, Begun};
use crate::gateway::group_commit::RoundTicket;
use crate::gateway::mailbox::Mailbox;
use crate::gateway::send::{self, CommitPermit, SendFailure};
use crate::gateway::state::Shared;
use crate::gateway::users::UserRef;

/// A send waiting for the one in flight, with its commit permit and when it arrived.
type QueuedSend = (SendRequest, CommitPermit, Instant);

/// A send begun on the quick path (ADR-0089), waiting for its answer: its id, when it
/// arrived, its permit (`None`: its queued message holds it until answered, ADR-0095), and
/// its commit (`None`: a test's send fault fired for it; the connection's commit panics when
/// it comes to the front).
type BegunSend = (String, Instant, Option<CommitPermit>, Option<Begun>);

/// What a commit in flight ends with: the send's id, when it arrived, and shard → offset or
/// why it failed; `Err`: the commit panicked (with the panic's message).
type Committed = Result<(String, Instant, Result<BTreeMap<u32, u64>, SendFailure>), String>;

/// The commit of a connection's send in flight (ADR-0054): polled by the reader's own
/// `select!`, like the ack in flight.
pub(super) type CommitInFlight<'a> = Pin<Box<dyn Future<Output = Committed> + Send + 'a>>;

/// A send admitted by its rate whose commit permits were not all free (ADR-0096): the wait
/// for them ([`PERMIT_WAIT`](crate::gateway::send::PERMIT_WAIT) at most), polled by the
/// reader's own `select!` so that the connection's commits in flight go on meanwhile (their
/// answers free permits). Ends with the send, its permit or why it has none, and when it
/// arrived.
pub(super) type Admitting =
    Pin<Box<dyn Future<Output = (SendRequest, Result<CommitPermit, SendFailure>, Instant)> + Send>>;

pub(super) struct Reader<'a> {
    pub(super) shared: &'a Arc<Shared>,
    pub(super) mailbox: Mailbox,
    pub(super) tx: &'a Outbox,
    pub(super) sync_tx: mpsc::Sender<u64>,
    /// The sender's id, shared by its commits (one `Arc` clone per send, not a `String`).
    pub(super) sender_id: Arc<str>,
    /// The connection's reference to its user's entry: the user's limits, reached without
    /// the user table (ADR-0072).
    pub(super) user: UserRef,
    /// Sends received and not yet begun, in order (with [`Reader::begun`] and the send
    /// awaited now, at most [`SEND_QUEUE`]: when full, the reader reads no more frames until a
    /// commit ends; backpressure).
    pub(super) sends: VecDeque<QueuedSend>,
    /// Sends begun on the quick path (ADR-0089), already queued for their rounds in the order
    /// received, their answers not yet written.
    pub(super) begun: VecDeque<BegunSend>,
    /// The answer awaited now: the front of [`Reader::begun`], or a send of the slow path
    /// (then `slow_in_flight`). Answers are written in the order the sends came.
    pub(super) commit_in_flight: Option<CommitInFlight<'a>>,
    /// The commit in flight is a send of the slow path (several shards, or an id claimed
    /// first), whose parts join their queues only after an await: nothing after it is begun
    /// until it is answered, so that a client's sends to one mailbox keep their order.
    pub(super) slow_in_flight: bool,
    /// The id of the send whose answer is awaited now, hashed ([`id_key`]): with
    /// [`Reader::begun`], the ids a send must not share to be begun (ADR-0093).
    pub(super) in_flight_id: Option<u64>,
    /// The send waiting for commit permits (ADR-0096): while it waits, the reader reads no
    /// more frames (what comes after it stays after it) but answers its commits in flight.
    pub(super) admitting: Option<Admitting>,
    /// The round that the begun sends awaiting answers are in (`None`: none awaits one).
    pub(super) open_round: Option<RoundTicket>,
    /// This connection, among the gateway's (group commit takes all of a connection's
    /// messages into a round that takes one, ADR-0089).
    pub(super) conn_id: u64,
    /// The front of [`Reader::sends`] had its send fault (tests) checked already: it was put
    /// back when its round was taken.
    pub(super) front_checked: bool,
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
    /// Cancelled when the delivery loop panicked (which also cancels `conn`): the connection
    /// is closed with 1011.
    pub(super) died: CancellationToken,
    /// When the connection's token expires (`None`: dev auth, no token).
    pub(super) expires_at: Option<SystemTime>,
}

impl<'a> Reader<'a> {
    /// Begins the queued sends of the quick path that nothing slower precedes (ADR-0089),
    /// then, unless an answer is awaited, awaits the next: the oldest begun send, else the
    /// next send of the slow path.
    ///
    /// The begun sends awaiting answers are all in one round of one core instance
    /// ([`Reader::open_round`]): a send joins it while it is open, else waits until they are
    /// answered. So no send of a connection can reach Redis before an earlier one, whatever
    /// happens to the rounds in flight (two flush tasks, a reconnect, a reloaded script).
    fn start_commit(&mut self) {
        let shared: &'a Arc<Shared> = self.shared;
        if self.commit_in_flight.is_none() && self.begun.is_empty() {
            self.open_round = None;
        }
        // a send's fault (tests) is decided once, when it first reaches the front
        let fault = |id: &str, checked: bool| {
            !checked
                && shared
                    .opts
                    .send_fault
                    .as_ref()
                    .is_some_and(|f| f.panic_commit(&self.sender_id, id))
        };
        if !self.slow_in_flight {
            while let Some((req, _, _)) = self.sends.front() {
                let Some(quick) = shared.commit.quick_shard(&self.sender_id, &req.to) else {
                    break;
                };
                // ADR-0093: a send that reuses the id of one still awaiting its answer waits
                // for that answer. In one round the two could be decided in shard order (the
                // parts of a call), not in the order sent: the later one would take the id.
                if self.in_flight_id.is_some_and(|k| k == id_key(&req.id))
                    || self.begun.iter().any(|(id, ..)| *id == req.id)
                {
                    break;
                }
                let (req, permit, received) = self.sends.pop_front().expect("the front");
                let SendRequest { id, to, body } = req;
                if fault(&id, std::mem::take(&mut self.front_checked)) {
                    self.begun.push_back((id, received, Some(permit), None));
                    continue;
                }
                let begin = shared.commit.begin_quick(
                    quick,
                    &self.sender_id,
                    &id,
                    (to, body),
                    (self.conn_id, self.open_round),
                    Some(permit),
                );
                match begin {
                    Begin::Begun(begun, ticket) => {
                        self.open_round = self.open_round.or(ticket);
                        self.begun.push_back((id, received, None, Some(begun)));
                    }
                    Begin::NotNow(to, body, permit) => {
                        // its round was taken: it waits for the answers of that round
                        let permit = permit.expect("handed back");
                        let req = SendRequest { id, to, body };
                        self.sends.push_front((req, permit, received));
                        self.front_checked = true;
                        break;
                    }
                }
            }
        }
        if self.commit_in_flight.is_some() {
            return;
        }
        let user = self.sender_id.clone();
        if let Some((id, received, permit, begun)) = self.begun.pop_front() {
            self.in_flight_id = Some(id_key(&id));
            self.commit_in_flight = Some(Box::pin(crate::supervise::catch_panic(async move {
                let Some(begun) = begun else {
                    panic!("send fault: {id}");
                };
                let res = begun.finish(&user, &id).await;
                drop(permit);
                (id, received, res)
            })));
            return;
        }
        // nothing begun awaits an answer: the front, if any, is a send of the slow path
        let Some((req, permit, received)) = self.sends.pop_front() else {
            return;
        };
        let fault = fault(&req.id, std::mem::take(&mut self.front_checked));
        self.slow_in_flight = true;
        self.in_flight_id = Some(id_key(&req.id));
        self.commit_in_flight = Some(Box::pin(crate::supervise::catch_panic(async move {
            assert!(!fault, "send fault: {}", req.id);
            let (id, res) = send::commit(shared, &user, req).await;
            drop(permit);
            (id, received, res)
        })));
    }

    /// Queues the send whose permits came (ADR-0096), or answers it `overloaded`; false when
    /// the connection is gone.
    async fn on_admitted(
        &mut self,
        (req, permit, received): (SendRequest, Result<CommitPermit, SendFailure>, Instant),
    ) -> bool {
        match permit {
            Ok(permit) => {
                self.sends.push_back((req, permit, received));
                self.start_commit();
                true
            }
            Err((code, message)) => self.reply(error_frame(code, message, Some(req.id))).await,
        }
    }

    /// Answers the commit that ended with `send_ack` or `error`, and starts the next one;
    /// false when the connection is gone or the commit panicked (the connection is closed
    /// with 1011, like a panicked delivery loop: the client reconnects and resends).
    async fn on_committed(&mut self, done: Committed) -> bool {
        self.commit_in_flight = None;
        self.slow_in_flight = false;
        self.in_flight_id = None;
        let (id, received, res) = match done {
            Ok(d) => d,
            Err(msg) => {
                super::panicked("send_loop", &msg);
                return false;
            }
        };
        let out = match res {
            Ok(offsets) => {
                crate::telemetry::hot()
                    .send_ack_seconds
                    .record(received.elapsed().as_secs_f64());
                text(&ServerFrame::SendAck { id, offsets })
            }
            Err((code, message)) => error_frame(code, message, Some(id)),
        };
        if !self.reply(out).await {
            return false;
        }
        self.start_commit();
        true
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
                crate::telemetry::hot().acks.increment(1);
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
                crate::telemetry::hot().acks.increment(1);
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
        // Every end of the connection (the server stops, the client stalls, the delivery loop
        // panicked) cancels `conn`, waited for by one future registered once (ADR-0061: each
        // poll of a token's wait takes two locks, and three waits were polled on every
        // wake), which takes no lock when polled (ADR-0073). The frame comes first (`biased`): a reader woken by a frame takes it without
        // polling the others; they are polled whenever the socket has nothing (tokio's
        // cooperative budget makes a socket that always has data answer "pending" every 128
        // reads).
        let going_away = GoingAway::new(conn.clone());
        tokio::pin!(going_away);
        // The retry of a failed ack write: one timer, set when a retry is due (ADR-0077; a
        // timer built in the `select!` was built and dropped on every frame, 0.4 % of the
        // server's CPU samples at 5,000 msg/s). Only polled while a retry is due.
        let ack_retry = tokio::time::sleep_until(last_seen);
        tokio::pin!(ack_retry);
        let mut ack_retry_set: Option<tokio::time::Instant> = None;
        loop {
            // The fields the branches below use, read (or borrowed apart) before the futures
            // borrow the two in flight.
            // the sends awaiting answers: queued, begun, and the one awaited now (popped from
            // one of the two)
            let waiting =
                self.sends.len() + self.begun.len() + usize::from(self.commit_in_flight.is_some());
            // no frame is read past a send waiting for permits: it keeps its place
            let reading = waiting < SEND_QUEUE && self.admitting.is_none();
            let has_expiry = self.expires_at.is_some();
            let ack_retry_at = self.ack_retry_at;
            if let Some(at) = ack_retry_at.filter(|&at| ack_retry_set != Some(at)) {
                ack_retry.as_mut().reset(at);
            }
            ack_retry_set = ack_retry_at;
            let acking = self.ack_in_flight.is_some();
            let committing = self.commit_in_flight.is_some();
            let waiting_permits = self.admitting.is_some();
            let ack_in_flight = &mut self.ack_in_flight;
            let commit_in_flight = &mut self.commit_in_flight;
            let admitting = &mut self.admitting;
            let msg = tokio::select! {
                biased;
                // no more frames while the sends queued are at their bound (backpressure)
                m = stream.next(), if reading => m,
                _ = &mut going_away => return self.ended(),
                _ = &mut expiry, if has_expiry => {
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
                    if !reading {
                        // the reader is not reading (its sends are at their bound), so the
                        // client's silence says nothing: it is not idle
                        last_seen = now;
                    }
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
                _ = &mut ack_retry, if ack_retry_at.is_some() => {
                    self.ack_retry_at = None;
                    self.submit_ack();
                    continue;
                }
                answer = async { ack_in_flight.as_mut().expect("only polled when set").await },
                    if acking => {
                    if !Box::pin(self.on_ack_answer(answer)).await {
                        return CloseCode::InternalError;
                    }
                    continue;
                }
                done = async { commit_in_flight.as_mut().expect("only polled when set").await },
                    if committing => {
                    if !Box::pin(self.on_committed(done)).await {
                        return self.gone(conn);
                    }
                    continue;
                }
                admitted = async { admitting.as_mut().expect("only polled when set").await },
                    if waiting_permits => {
                    self.admitting = None;
                    if !Box::pin(self.on_admitted(admitted)).await {
                        return self.gone(conn);
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
                    // A client's bad frame is its bug, not a server failure (ADR-0101): it gets
                    // a typed error frame and the close code that says which, not 1011 (which
                    // tells it to reconnect and send the same again). The stream has ended
                    // (tungstenite reads no more after an error), so the connection closes.
                    let bad = if e.starts_with("UTF-8 encoding error") {
                        Some((CloseCode::InvalidPayload, "a text frame is not valid UTF-8"))
                    } else if e.starts_with("WebSocket protocol error") {
                        Some((
                            CloseCode::ProtocolError,
                            "the frame breaks the WebSocket protocol",
                        ))
                    } else {
                        None
                    };
                    if let Some((code, what)) = bad {
                        tracing::debug!(error = %e, "bad frame from the client");
                        metrics::counter!("tidemark_client_errors_total", "code" => "bad_request")
                            .increment(1);
                        Box::pin(self.reply(error_frame(
                            ErrorCode::BadRequest,
                            format!("{what} ({e}); closing"),
                            None,
                        )))
                        .await;
                        return code;
                    }
                    tracing::debug!(error = %e, "websocket read failed");
                    return CloseCode::InternalError;
                }
                Some(Ok(Message::Text(t))) => match self.on_text(t.as_str()) {
                    Then::Done(ok) => ok,
                    then => Box::pin(self.finish_frame(then, conn)).await,
                },
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
                return if self.tx.is_stalled() {
                    CloseCode::SlowConsumer
                } else {
                    CloseCode::InternalError
                };
            }
        }
    }

    /// The close code once a reply could not be written (the outbox is gone): why `conn`
    /// was cancelled, or an internal error if it was not (a commit that panicked).
    fn gone(&self, conn: &CancellationToken) -> CloseCode {
        if conn.is_cancelled() {
            self.ended()
        } else {
            CloseCode::InternalError
        }
    }

    /// Why `conn` was cancelled: the client stalled, the delivery loop panicked, or the
    /// server stops (or the writer lost the socket).
    fn ended(&self) -> CloseCode {
        if self.tx.is_stalled() {
            CloseCode::SlowConsumer
        } else if self.died.is_cancelled() {
            CloseCode::InternalError
        } else {
            CloseCode::GoingAway
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
    /// (`&mut`: the commit in flight is `Send` but not `Sync`, so a shared borrow of the
    /// reader may not be held across an `await`.)
    async fn reply(&mut self, out: Out) -> bool {
        until_cancelled(&self.conn, self.tx.send(out)).await
    }

    /// Handles one text frame as far as it can without waiting: an ack, or a send whose
    /// permits are free, is done here; what must wait (a reply, permits, a sync) is left to
    /// [`Reader::finish_frame`]. (ADR-0061: the common frames take no boxed future.)
    fn on_text(&mut self, frame: &str) -> Then {
        let received = Instant::now();
        match parse_client_frame(frame, &self.shared.opts.limits) {
            Err(e) => {
                metrics::counter!("tidemark_client_errors_total", "code" => e.code()).increment(1);
                Then::Reply(text(&e.to_server_frame()))
            }
            Ok(ClientFrame::Send(req)) => {
                match send::try_reserve(self.shared, &self.user, &req) {
                    Ok(Ok(permit)) => {
                        // committed after the sends before it, in order
                        self.sends.push_back((req, permit, received));
                        self.start_commit();
                        Then::Done(true)
                    }
                    Ok(Err(pending)) => Then::Admit(req, pending, received),
                    Err((code, message)) => Then::Reply(error_frame(code, message, Some(req.id))),
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
                Then::Done(true)
            }
            Ok(ClientFrame::Sync { after }) => {
                if let Some(f) = &self.shared.opts.send_fault {
                    assert!(
                        !f.panic_sync(&self.mailbox.user, after),
                        "sync fault: {after}"
                    );
                }
                Then::Sync(after)
            }
        }
    }

    /// Finishes a frame [`Reader::on_text`] could not finish without waiting; false when the
    /// connection is gone.
    async fn finish_frame(&mut self, then: Then, conn: &CancellationToken) -> bool {
        match then {
            Then::Done(ok) => ok,
            Then::Reply(out) => self.reply(out).await,
            Then::Admit(req, pending, received) => {
                // waited for in `run`'s `select!` (ADR-0096): awaited here, the wait held up
                // this connection's commits in flight, whose answers free the permits
                self.admitting = Some(Box::pin(async move {
                    let permit = pending.wait().await;
                    (req, permit, received)
                }));
                true
            }
            Then::Sync(after) => until_cancelled(conn, self.sync_tx.send(after)).await,
        }
    }
}

/// What a client frame still needs once [`Reader::on_text`] has done what needs no wait.
enum Then {
    /// Nothing: true while the connection goes on.
    Done(bool),
    /// A frame to queue for the client (an error).
    Reply(Out),
    /// A send admitted by its rate, waiting for commit permits; when it arrived.
    Admit(SendRequest, send::PendingPermit, Instant),
    /// A `sync` for the delivery loop.
    Sync(u64),
}

/// A client id, hashed: what [`Reader::in_flight_id`] keeps of the id of the send awaited now
/// (its `String` moved into the commit). Two ids that hash alike only make a send wait for an
/// answer it did not need to wait for.
fn id_key(id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    h.finish()
}
