//! The WebSocket connection: [`Client`], its cloneable [`ClientHandle`], and [`Event`]s.
//!
//! # Tasks and channels
//!
//! After the handshake and the server's `ready` frame, the socket is split in two:
//!
//! - **one writer task** owns the sink. Every outgoing frame goes through a bounded mpsc
//!   channel ([`WRITE_QUEUE`] frames) to it; it writes whatever is queued and flushes once per
//!   batch. A full queue makes senders wait (backpressure), so "sent" in [`ClientHandle::send`]
//!   means "queued to the writer", not "on the wire".
//! - **one reader task** owns the stream and routes every server frame:
//!   - `send_ack` / `error` carrying an `id` for which a waiter is registered (by
//!     [`ClientHandle::start_send`] or [`ClientHandle::send_and_wait`]) complete that waiter;
//!   - everything else (`deliver`, acks and errors nobody waits for, errors without an id,
//!     acks that arrive after their waiter gave up) becomes an [`Event`] on an unbounded
//!     channel read by [`Client::next_event`].
//!
//! When the connection ends, every pending waiter fails with [`Error::Closed`], new waiters
//! are refused, and the event stream yields [`Event::Closed`] once and then `None`.
//!
//! The event channel is unbounded so that a caller that only waits for acks can never
//! deadlock the reader; a caller that receives deliveries must keep calling
//! [`Client::next_event`] or they accumulate in memory.
//!
//! # Many sends in flight
//!
//! [`Client::handle`] returns a [`ClientHandle`] (cheap to clone, `Send + Sync`) that sends
//! and waits without borrowing the [`Client`], so a load generator can run many
//! `send_and_wait`s concurrently (tasks, or `FuturesUnordered` of [`PendingAck::wait`]) while
//! another task owns the `Client` and drains [`Client::next_event`]. Acks are matched by id,
//! in whatever order the server sends them. Ids must be unique per sender (the server dedupes
//! on them); a second waiter for an id already waiting on the same connection is refused with
//! [`Error::IdInFlight`].

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

use futures::stream::{SplitSink, SplitStream};
use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tidemark_protocol::{ClientFrame, Entry, SendRequest, ServerFrame};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::client::Request;
use tokio_tungstenite::tungstenite::http::header::AUTHORIZATION;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use url::Url;

use crate::error::Error;

/// Shard number → dispatch-log offset, as in a `send_ack` frame.
pub type Offsets = BTreeMap<u32, u64>;

/// Capacity of the writer's queue, in frames.
pub const WRITE_QUEUE: usize = 1024;

/// Default limit for [`Client::connect`]: TCP connect, upgrade and the `ready` frame.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long [`Client::close`] waits for the server to answer the close handshake.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// The `code` of an [`Event::Error`] the client makes itself for a server frame it cannot
/// read (not JSON, a known `type` with bad fields, a binary frame, a second `ready`). Server
/// frames with an unknown `type` are ignored (forward compatibility), not reported.
pub const BAD_SERVER_FRAME: &str = "bad_server_frame";

/// How to authenticate the WebSocket upgrade.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    /// A bearer token (`v1.…`), sent as `Authorization: Bearer <token>`.
    Token(String),
    /// A development user name, sent as `?user=NAME` (only gateways started with
    /// `--dev-auth` accept it).
    DevUser(String),
}

impl fmt::Debug for Auth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Never print a credential.
            Auth::Token(_) => f.write_str("Token(<redacted>)"),
            Auth::DevUser(u) => f.debug_tuple("DevUser").field(u).finish(),
        }
    }
}

/// Something the server sent that no waiter consumed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A `deliver` frame: one mailbox entry. May repeat (at least once on the wire); see
    /// [`SeqDedup`](crate::SeqDedup).
    Deliver(Entry),
    /// A `send_ack` for a send nobody is waiting for (sent with [`ClientHandle::send`], or
    /// whose waiter timed out or was dropped).
    SendAck {
        /// The send's client id.
        id: String,
        /// Shard → offset.
        offsets: Offsets,
    },
    /// An `error` frame nobody waits for, or a server frame the client could not read
    /// (`code` [`BAD_SERVER_FRAME`]).
    Error {
        /// The server's stable code (any string: codes unknown to this client are kept).
        code: String,
        /// Human-readable detail.
        message: String,
        /// The client id the error refers to, when the server knew it.
        id: Option<String>,
    },
    /// The connection ended (either side closed it, or it failed). Sent once; afterwards
    /// [`Client::next_event`] returns `None`.
    Closed,
}

type WaitResult = Result<Offsets, (String, String)>;
/// id → (registration token, waiter). `None` once the connection has ended.
type WaiterMap = HashMap<String, (u64, oneshot::Sender<WaitResult>)>;
type Waiters = Arc<Mutex<Option<WaiterMap>>>;
type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn lock(w: &Waiters) -> MutexGuard<'_, Option<WaiterMap>> {
    // A panic while holding this lock cannot leave the map inconsistent (single inserts and
    // removes), so a poisoned lock is still usable.
    w.lock().unwrap_or_else(|e| e.into_inner())
}

static NEXT_WAITER: AtomicU64 = AtomicU64::new(1);

/// A connected client: the owner of the connection and of its event stream.
///
/// Dropping it aborts both tasks and drops the TCP connection without a close handshake;
/// call [`close`](Client::close) for a clean close. [`ClientHandle`]s outliving it then get
/// [`Error::Closed`].
pub struct Client {
    user: String,
    ready_after: u64,
    handle: ClientHandle,
    events: mpsc::UnboundedReceiver<Event>,
    reader: Option<JoinHandle<()>>,
    writer: Option<JoinHandle<()>>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("user", &self.user)
            .field("ready_after", &self.ready_after)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Connects to `ws_url` (`ws://host:port/v1/ws`), authenticates with `auth` and waits for
    /// the server's `ready` frame, all within [`CONNECT_TIMEOUT`].
    ///
    /// Errors: [`Error::InvalidUrl`], [`Error::Connect`], [`Error::Rejected`] (HTTP error on
    /// the upgrade, e.g. 401 `unauthorized`), [`Error::Server`] (an `error` frame instead of
    /// `ready`), [`Error::Protocol`], [`Error::Closed`], [`Error::Timeout`].
    pub async fn connect(ws_url: &str, auth: &Auth) -> Result<Client, Error> {
        Self::connect_with_timeout(ws_url, auth, CONNECT_TIMEOUT).await
    }

    /// [`connect`](Client::connect) with a custom limit for the whole handshake.
    pub async fn connect_with_timeout(
        ws_url: &str,
        auth: &Auth,
        timeout: Duration,
    ) -> Result<Client, Error> {
        let (request, shown_url) = build_request(ws_url, auth)?;
        let handshake = async {
            let (ws, _response) = tokio_tungstenite::connect_async_with_config(
                request,
                // tungstenite zeroes its read buffer on every read (128 KiB by default)
                Some(WebSocketConfig::default().read_buffer_size(8 * 1024)),
                true,
            )
            .await
            .map_err(|e| connect_error(&shown_url, e))?;
            let (sink, mut stream) = ws.split();
            let (user, after) = wait_ready(&mut stream).await?;
            Ok::<_, Error>((sink, stream, user, after))
        };
        let (sink, stream, user, ready_after) =
            tokio::time::timeout(timeout, handshake)
                .await
                .map_err(|_| Error::Timeout(timeout, "the ready frame"))??;

        let (out_tx, out_rx) = mpsc::channel(WRITE_QUEUE);
        let (ev_tx, ev_rx) = mpsc::unbounded_channel();
        let waiters: Waiters = Arc::new(Mutex::new(Some(HashMap::new())));
        let (done_tx, done_rx) = oneshot::channel();
        let writer = tokio::spawn(write_loop(sink, out_rx, done_rx));
        let reader = tokio::spawn(read_loop(stream, ev_tx, waiters.clone(), done_tx));
        Ok(Client {
            user,
            ready_after,
            handle: ClientHandle {
                out: out_tx,
                waiters,
            },
            events: ev_rx,
            reader: Some(reader),
            writer: Some(writer),
        })
    }

    /// The authenticated user, from `ready.user`.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The seq delivery resumes after, from `ready.after` (the mailbox's acked cursor).
    pub fn ready_after(&self) -> u64 {
        self.ready_after
    }

    /// A cloneable handle for sending from other tasks while this `Client` reads events.
    pub fn handle(&self) -> ClientHandle {
        self.handle.clone()
    }

    /// See [`ClientHandle::send`].
    pub async fn send(&self, id: &str, to: &[String], body: &str) -> Result<(), Error> {
        self.handle.send(id, to, body).await
    }

    /// See [`ClientHandle::start_send`].
    pub async fn start_send(
        &self,
        id: &str,
        to: &[String],
        body: &str,
    ) -> Result<PendingAck, Error> {
        self.handle.start_send(id, to, body).await
    }

    /// See [`ClientHandle::send_and_wait`].
    pub async fn send_and_wait(
        &self,
        id: &str,
        to: &[String],
        body: &str,
        timeout: Duration,
    ) -> Result<Offsets, Error> {
        self.handle.send_and_wait(id, to, body, timeout).await
    }

    /// See [`ClientHandle::ack`].
    pub async fn ack(&self, seq: u64) -> Result<(), Error> {
        self.handle.ack(seq).await
    }

    /// See [`ClientHandle::sync`].
    pub async fn sync(&self, after: u64) -> Result<(), Error> {
        self.handle.sync(after).await
    }

    /// See [`ClientHandle::send_raw_text`].
    pub async fn send_raw_text(&self, text: impl Into<String>) -> Result<(), Error> {
        self.handle.send_raw_text(text).await
    }

    /// See [`ClientHandle::send_raw_binary`].
    pub async fn send_raw_binary(&self, bytes: Vec<u8>) -> Result<(), Error> {
        self.handle.send_raw_binary(bytes).await
    }

    /// The next event no waiter consumed, in arrival order. After the connection ends this
    /// yields [`Event::Closed`] once, then `None`. Cancel-safe.
    pub async fn next_event(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// Closes the connection cleanly: queues a close frame behind everything already queued,
    /// waits (at most [`CLOSE_TIMEOUT`]) for the server to finish the close handshake, then
    /// stops both tasks. Pending waiters fail with [`Error::Closed`].
    pub async fn close(mut self) {
        let deadline = tokio::time::Instant::now() + CLOSE_TIMEOUT;
        let queued = tokio::time::timeout_at(deadline, self.handle.out.send(Message::Close(None)));
        if matches!(queued.await, Ok(Ok(()))) {
            if let Some(reader) = self.reader.as_mut() {
                let _ = tokio::time::timeout_at(deadline, reader).await;
            }
        }
        // Drop aborts whatever is still running and fails the remaining waiters.
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        for task in [self.reader.take(), self.writer.take()]
            .into_iter()
            .flatten()
        {
            task.abort();
        }
        // The reader may have been aborted before its own cleanup: fail the waiters here.
        lock(&self.handle.waiters).take();
    }
}

/// A cloneable sender for one connection: everything but reading events.
///
/// All methods return once the frame is queued to the writer task (waiting while its queue
/// is full), or [`Error::Closed`] when the connection has ended.
#[derive(Clone)]
pub struct ClientHandle {
    out: mpsc::Sender<Message>,
    waiters: Waiters,
}

impl fmt::Debug for ClientHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientHandle")
            .field("closed", &self.out.is_closed())
            .finish_non_exhaustive()
    }
}

impl ClientHandle {
    async fn queue(&self, msg: Message) -> Result<(), Error> {
        self.out.send(msg).await.map_err(|_| Error::Closed)
    }

    /// Queues `{"type":"send","id":…,"to":…,"body":…}` without waiting for the answer: the
    /// `send_ack` (or `error`) arrives as an [`Event`]. Nothing is validated client-side.
    pub async fn send(&self, id: &str, to: &[String], body: &str) -> Result<(), Error> {
        self.queue(Message::text(send_json(id, to, body))).await
    }

    /// Registers a waiter for `id`, then queues the send. Await the answer with
    /// [`PendingAck::wait`]; dropping the `PendingAck` unregisters it (a late answer then
    /// becomes an [`Event`]).
    ///
    /// Errors: [`Error::IdInFlight`] if a waiter for `id` already exists on this connection,
    /// [`Error::Closed`].
    pub async fn start_send(
        &self,
        id: &str,
        to: &[String],
        body: &str,
    ) -> Result<PendingAck, Error> {
        let pending = self.register(id)?;
        self.queue(Message::text(send_json(id, to, body))).await?;
        Ok(pending)
    }

    /// Sends and waits for the `send_ack` with this `id` (its shard offsets), or fails with
    /// [`Error::Server`] for an `error` frame with this `id`. `timeout` covers queueing and
    /// waiting; after [`Error::Timeout`] or [`Error::Closed`] the message may or may not be
    /// committed: retry with the same id. Other frames meanwhile go to [`Client::next_event`].
    pub async fn send_and_wait(
        &self,
        id: &str,
        to: &[String],
        body: &str,
        timeout: Duration,
    ) -> Result<Offsets, Error> {
        let start = Instant::now();
        let pending = tokio::time::timeout(timeout, self.start_send(id, to, body))
            .await
            .map_err(|_| Error::Timeout(timeout, "the writer queue"))??;
        pending
            .wait_inner(timeout.saturating_sub(start.elapsed()), timeout)
            .await
    }

    /// Queues `{"type":"ack","seq":…}`: every entry at or below `seq` is processed.
    pub async fn ack(&self, seq: u64) -> Result<(), Error> {
        self.queue(Message::text(ClientFrame::Ack { seq }.to_json()))
            .await
    }

    /// Queues `{"type":"sync","after":…}`: restart the delivery stream after `after`.
    pub async fn sync(&self, after: u64) -> Result<(), Error> {
        self.queue(Message::text(ClientFrame::Sync { after }.to_json()))
            .await
    }

    /// Queues an arbitrary text frame as is (for testing the server with hostile input).
    pub async fn send_raw_text(&self, text: impl Into<String>) -> Result<(), Error> {
        self.queue(Message::text(text.into())).await
    }

    /// Queues a binary frame (not part of the protocol; the server answers `bad_request`).
    pub async fn send_raw_binary(&self, bytes: Vec<u8>) -> Result<(), Error> {
        self.queue(Message::binary(bytes)).await
    }

    /// Whether the writer has stopped: true shortly after the connection closed or failed
    /// (then every send fails with [`Error::Closed`]).
    pub fn is_closed(&self) -> bool {
        self.out.is_closed()
    }

    fn register(&self, id: &str) -> Result<PendingAck, Error> {
        let token = NEXT_WAITER.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let mut guard = lock(&self.waiters);
        let map = guard.as_mut().ok_or(Error::Closed)?;
        if map.contains_key(id) {
            return Err(Error::IdInFlight(id.to_owned()));
        }
        map.insert(id.to_owned(), (token, tx));
        Ok(PendingAck {
            id: id.to_owned(),
            token,
            rx,
            waiters: self.waiters.clone(),
        })
    }
}

/// A send whose answer has not been awaited yet; see [`ClientHandle::start_send`].
///
/// Dropping it unregisters the waiter.
#[derive(Debug)]
pub struct PendingAck {
    id: String,
    token: u64,
    rx: oneshot::Receiver<WaitResult>,
    waiters: Waiters,
}

impl PendingAck {
    /// The send's client id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Waits up to `timeout` for the `send_ack` (its offsets) or the `error` frame
    /// ([`Error::Server`]) with this id. [`Error::Closed`] if the connection ends first.
    pub async fn wait(self, timeout: Duration) -> Result<Offsets, Error> {
        self.wait_inner(timeout, timeout).await
    }

    async fn wait_inner(mut self, left: Duration, reported: Duration) -> Result<Offsets, Error> {
        match tokio::time::timeout(left, &mut self.rx).await {
            Err(_) => Err(Error::Timeout(reported, "the send_ack")),
            Ok(Err(_)) => Err(Error::Closed),
            Ok(Ok(Ok(offsets))) => Ok(offsets),
            Ok(Ok(Err((code, message)))) => Err(Error::Server { code, message }),
        }
    }
}

impl Drop for PendingAck {
    fn drop(&mut self) {
        let mut guard = lock(&self.waiters);
        if let Some(map) = guard.as_mut() {
            // Only our own registration: the id may have been answered and registered again.
            if map.get(&self.id).is_some_and(|(t, _)| *t == self.token) {
                map.remove(&self.id);
            }
        }
    }
}

fn send_json(id: &str, to: &[String], body: &str) -> String {
    ClientFrame::Send(SendRequest {
        id: id.to_owned(),
        to: to.to_vec(),
        body: body.to_owned(),
    })
    .to_json()
}

/// The upgrade request, and the URL to show in errors (without its query, which may carry a
/// credential).
fn build_request(ws_url: &str, auth: &Auth) -> Result<(Request, String), Error> {
    let invalid = |reason: String| Error::InvalidUrl {
        url: ws_url.to_owned(),
        reason,
    };
    let mut url = Url::parse(ws_url).map_err(|e| invalid(e.to_string()))?;
    if !matches!(url.scheme(), "ws" | "wss") {
        return Err(invalid(format!(
            "scheme must be ws or wss, not {}",
            url.scheme()
        )));
    }
    let mut shown = url.clone();
    shown.set_query(None);
    if let Auth::DevUser(name) = auth {
        url.query_pairs_mut().append_pair("user", name);
    }
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|e| invalid(e.to_string()))?;
    if let Auth::Token(token) = auth {
        let value = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| invalid("the token contains characters not allowed in a header".into()))?;
        request.headers_mut().insert(AUTHORIZATION, value);
    }
    Ok((request, shown.to_string()))
}

fn connect_error(url: &str, e: tungstenite::Error) -> Error {
    match e {
        tungstenite::Error::Http(response) => {
            let status = response.status().as_u16();
            let body = response.body().as_deref().unwrap_or_default();
            let detail = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
                let err = v.get("error")?;
                Some((
                    err.get("code")?.as_str()?.to_owned(),
                    err.get("message")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                ))
            });
            let (code, message) = detail.unwrap_or_else(|| {
                (
                    "upgrade_rejected".to_owned(),
                    String::from_utf8_lossy(body).into_owned(),
                )
            });
            Error::Rejected {
                status,
                code,
                message,
            }
        }
        source => Error::Connect {
            url: url.to_owned(),
            source,
        },
    }
}

/// A server frame as the client reads it. `error.code` stays a string so codes newer than
/// this client are passed on rather than failing the frame.
#[derive(Debug, PartialEq)]
enum Incoming {
    Ready { user: String, after: u64 },
    SendAck { id: String, offsets: Offsets },
    Deliver(Entry),
    Error(ErrorFrame),
    Unknown,
}

#[derive(Debug, PartialEq, serde::Deserialize)]
struct ErrorFrame {
    code: String,
    #[serde(default)]
    message: String,
    #[serde(default)]
    id: Option<String>,
}

fn parse_incoming(text: &str) -> Result<Incoming, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let Some(ty) = value.get("type") else {
        return Err("not a JSON object with a `type`".into());
    };
    let Some(ty) = ty.as_str() else {
        return Err("`type` is not a string".into());
    };
    match ty {
        "error" => serde_json::from_value::<ErrorFrame>(value)
            .map(Incoming::Error)
            .map_err(|e| format!("bad error frame: {e}")),
        "ready" | "send_ack" | "deliver" => {
            let ty = ty.to_owned();
            match serde_json::from_value::<ServerFrame>(value) {
                Ok(ServerFrame::Ready { user, after }) => Ok(Incoming::Ready { user, after }),
                Ok(ServerFrame::SendAck { id, offsets }) => Ok(Incoming::SendAck { id, offsets }),
                Ok(ServerFrame::Deliver(e)) => Ok(Incoming::Deliver(e)),
                Ok(ServerFrame::Error { .. }) => unreachable!("type is {ty}"),
                Err(e) => Err(format!("bad {ty} frame: {e}")),
            }
        }
        _ => Ok(Incoming::Unknown),
    }
}

async fn wait_ready(stream: &mut SplitStream<Ws>) -> Result<(String, u64), Error> {
    loop {
        let text = match stream.next().await {
            None | Some(Err(_)) | Some(Ok(Message::Close(_))) => return Err(Error::Closed),
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Binary(_))) => {
                return Err(Error::Protocol("binary frame before ready".into()))
            }
            Some(Ok(_)) => continue, // ping / pong
        };
        match parse_incoming(text.as_str()) {
            Ok(Incoming::Ready { user, after }) => return Ok((user, after)),
            Ok(Incoming::Error(e)) => {
                return Err(Error::Server {
                    code: e.code,
                    message: e.message,
                })
            }
            Ok(Incoming::Unknown) => continue,
            Ok(other) => {
                return Err(Error::Protocol(format!(
                    "first frame was not ready: {other:?}"
                )))
            }
            Err(e) => return Err(Error::Protocol(e)),
        }
    }
}

/// Writes queued frames until a close frame is written, a write fails, the reader reports
/// the end of the connection (`reader_done`), or every sender is gone.
async fn write_loop(
    mut sink: SplitSink<Ws, Message>,
    mut rx: mpsc::Receiver<Message>,
    mut reader_done: oneshot::Receiver<()>,
) {
    /// Most frames written before a flush.
    const BATCH: usize = 256;
    loop {
        let first = tokio::select! {
            first = rx.recv() => first,
            // The connection is gone: stop, so senders see Error::Closed.
            _ = &mut reader_done => return,
        };
        let Some(first) = first else { break };
        let mut closing = matches!(first, Message::Close(_));
        if sink.feed(first).await.is_err() {
            return;
        }
        let mut n = 1;
        while !closing && n < BATCH {
            let Ok(msg) = rx.try_recv() else { break };
            closing = matches!(msg, Message::Close(_));
            if sink.feed(msg).await.is_err() {
                return;
            }
            n += 1;
        }
        if sink.flush().await.is_err() || closing {
            return;
        }
    }
    // Every sender is gone: close politely.
    let _ = sink.close().await;
}

async fn read_loop(
    mut stream: SplitStream<Ws>,
    events: mpsc::UnboundedSender<Event>,
    waiters: Waiters,
    done: oneshot::Sender<()>,
) {
    // Reading on after a Close frame lets tungstenite finish the close handshake; the stream
    // then ends.
    while let Some(Ok(msg)) = stream.next().await {
        match msg {
            Message::Text(text) => route(parse_incoming(text.as_str()), &events, &waiters),
            Message::Binary(_) => {
                let _ = events.send(Event::Error {
                    code: BAD_SERVER_FRAME.into(),
                    message: "binary frame from the server".into(),
                    id: None,
                });
            }
            _ => {}
        }
    }
    // Fail every pending waiter (their senders drop) and refuse new ones.
    lock(&waiters).take();
    let _ = done.send(());
    let _ = events.send(Event::Closed);
}

fn take_waiter(waiters: &Waiters, id: &str) -> Option<oneshot::Sender<WaitResult>> {
    lock(waiters).as_mut()?.remove(id).map(|(_, tx)| tx)
}

fn route(frame: Result<Incoming, String>, events: &mpsc::UnboundedSender<Event>, w: &Waiters) {
    let event = match frame {
        Ok(Incoming::SendAck { id, offsets }) => match take_waiter(w, &id) {
            None => Event::SendAck { id, offsets },
            Some(tx) => match tx.send(Ok(offsets)) {
                Ok(()) => return,
                // The waiter gave up between the lookup and now: keep the ack as an event.
                Err(Ok(offsets)) => Event::SendAck { id, offsets },
                Err(Err(_)) => return, // not what was sent
            },
        },
        Ok(Incoming::Error(ErrorFrame {
            code,
            message,
            id: Some(id),
        })) => match take_waiter(w, &id) {
            None => Event::Error {
                code,
                message,
                id: Some(id),
            },
            Some(tx) => match tx.send(Err((code, message))) {
                Ok(()) => return,
                Err(Err((code, message))) => Event::Error {
                    code,
                    message,
                    id: Some(id),
                },
                Err(Ok(_)) => return, // not what was sent
            },
        },
        Ok(Incoming::Error(ErrorFrame { code, message, id })) => Event::Error { code, message, id },
        Ok(Incoming::Deliver(entry)) => Event::Deliver(entry),
        Ok(Incoming::Ready { .. }) => Event::Error {
            code: BAD_SERVER_FRAME.into(),
            message: "a second ready frame".into(),
            id: None,
        },
        Ok(Incoming::Unknown) => return,
        Err(message) => Event::Error {
            code: BAD_SERVER_FRAME.into(),
            message,
            id: None,
        },
    };
    let _ = events.send(event);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_server_frames() {
        assert_eq!(
            parse_incoming(r#"{"type":"ready","user":"alice","after":3400}"#),
            Ok(Incoming::Ready {
                user: "alice".into(),
                after: 3400
            })
        );
        assert_eq!(
            parse_incoming(r#"{"type":"send_ack","id":"c-1","offsets":{"12":3471,"3":9}}"#),
            Ok(Incoming::SendAck {
                id: "c-1".into(),
                offsets: BTreeMap::from([(3, 9), (12, 3471)])
            })
        );
        assert_eq!(
            parse_incoming(
                r#"{"type":"deliver","seq":3471,"from":"alice","body":"hi","sent_at_us":1,"new":true}"#
            ),
            Ok(Incoming::Deliver(Entry {
                seq: 3471,
                from: "alice".into(),
                body: "hi".into(),
                sent_at_us: 1
            }))
        );
        // Error codes newer than this client are kept, not refused.
        assert_eq!(
            parse_incoming(r#"{"type":"error","code":"brand_new","message":"m","id":"c-1"}"#),
            Ok(Incoming::Error(ErrorFrame {
                code: "brand_new".into(),
                message: "m".into(),
                id: Some("c-1".into())
            }))
        );
        assert_eq!(
            parse_incoming(r#"{"type":"error","code":"bad_json","message":"m"}"#),
            Ok(Incoming::Error(ErrorFrame {
                code: "bad_json".into(),
                message: "m".into(),
                id: None
            }))
        );
        assert_eq!(
            parse_incoming(r#"{"type":"from_the_future"}"#),
            Ok(Incoming::Unknown)
        );
        for bad in [
            "nope",
            "[]",
            r#"{"no":"type"}"#,
            r#"{"type":7}"#,
            r#"{"type":"ready","user":"a"}"#,
            r#"{"type":"send_ack","id":"c","offsets":{"x":1}}"#,
            r#"{"type":"deliver","seq":-1,"from":"a","body":"","sent_at_us":0}"#,
            r#"{"type":"error","message":"no code"}"#,
        ] {
            assert!(parse_incoming(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn builds_upgrade_requests() {
        let (req, shown) =
            build_request("ws://127.0.0.1:1/v1/ws", &Auth::Token("v1.abc.def".into())).unwrap();
        assert_eq!(req.headers()[AUTHORIZATION], "Bearer v1.abc.def");
        assert_eq!(req.uri().query(), None);
        assert_eq!(shown, "ws://127.0.0.1:1/v1/ws");

        let (req, shown) =
            build_request("ws://h:1/v1/ws?x=1", &Auth::DevUser("bob smith&co".into())).unwrap();
        assert!(req.headers().get(AUTHORIZATION).is_none());
        assert_eq!(req.uri().query(), Some("x=1&user=bob+smith%26co"));
        assert_eq!(shown, "ws://h:1/v1/ws");

        for (url, auth) in [
            ("http://h/v1/ws", Auth::DevUser("a".into())),
            ("not a url", Auth::DevUser("a".into())),
            ("ws://h/v1/ws", Auth::Token("bad\ntoken".into())),
        ] {
            assert_eq!(build_request(url, &auth).unwrap_err().code(), "invalid_url");
        }
    }

    #[test]
    fn auth_debug_hides_tokens() {
        let s = format!("{:?}", Auth::Token("v1.secret.mac".into()));
        assert!(!s.contains("secret"), "{s}");
        assert_eq!(format!("{:?}", Auth::DevUser("a".into())), "DevUser(\"a\")");
    }
}
