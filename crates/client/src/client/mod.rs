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
//!     [`ClientHandle::start_send`] or [`ClientHandle::send_and_wait`]) complete that waiter
//!     when they answer its own frame (see "Many sends in flight");
//!   - everything else (`deliver`, acks and errors nobody waits for, errors without an id,
//!     acks that arrive after their waiter gave up or answer an earlier frame of the id)
//!     becomes an [`Event`] on an unbounded channel read by [`Client::next_event`].
//!
//! When the connection ends, every pending waiter fails with [`Error::Closed`], new waiters
//! are refused, and the event stream yields [`Event::Closed`] once and then `None`.
//!
//! # A peer that goes silent
//!
//! A peer that dies without a FIN or RST (power loss, a NAT or firewall that forgot the flow)
//! leaves a socket that never reads anything again. The reader therefore ends the connection
//! as lost when nothing at all (no frame, no ping, no pong) has arrived for
//! [`ClientOptions::read_timeout`] (default [`READ_TIMEOUT`], 60 s), and the writer sends a
//! WebSocket ping every [`ClientOptions::ping_interval`] (default [`PING_INTERVAL`], 20 s) so
//! that a live but quiet server still sends something (its pong): the gateway pings only a
//! client that has been silent for 20 s, so a client that keeps sending acks would otherwise
//! hear nothing from an idle mailbox.
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
//! [`Error::IdInFlight`]. A send retried with the same id on the same connection (after
//! [`Error::Timeout`]) gets the answer to its own frame: the server answers a connection's
//! sends in the order sent (`docs/protocol.md`; only a send refused before its commit may be
//! answered ahead of earlier ones), so the client counts the `send` frames it queued per
//! id ([`send`](ClientHandle::send), [`start_send`](ClientHandle::start_send),
//! [`send_and_wait`](ClientHandle::send_and_wait)) and hands a waiter only the answer owed to
//! its own frame; a late answer to an earlier, abandoned attempt becomes an [`Event`]. Frames
//! queued by [`send_raw_text`](ClientHandle::send_raw_text) are not counted (do not mix them
//! with a waiter for the same id), nor is a `send` frame over the protocol's 65536-byte frame
//! limit, which the server answers without its id.
//!
//! A `Client` dereferences to its own [`ClientHandle`], so every sending method
//! ([`send`](ClientHandle::send), [`start_send`](ClientHandle::start_send),
//! [`send_and_wait`](ClientHandle::send_and_wait), [`ack`](ClientHandle::ack), …) can be
//! called on the `Client` directly.
//!
//! # Layout
//!
//! This file holds the public types and [`Client`] (connect, events, close). Apart:
//! `connect.rs` (the upgrade request and the wait for `ready`), `handle.rs`
//! ([`ClientHandle`]), `waiters.rs` (the per-connection waiter registry and [`PendingAck`]),
//! `incoming.rs` (reading server frames and routing them to waiters or events) and `io.rs`
//! (the reader and writer tasks).

mod connect;
mod handle;
mod incoming;
mod io;
#[cfg(test)]
mod tests;
mod waiters;

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Deref;
use std::time::Duration;

use futures::StreamExt;
use tidemark_protocol::Entry;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::error::Error;
use connect::{build_request, connect_error, wait_ready};
use io::{read_loop, write_loop};
use waiters::Waiters;

pub use connect::{handshake_on, Handshaken};
pub use handle::ClientHandle;
pub use waiters::PendingAck;

/// Shard number → dispatch-log offset, as in a `send_ack` frame.
pub type Offsets = BTreeMap<u32, u64>;

/// Capacity of the writer's queue, in frames.
pub const WRITE_QUEUE: usize = 1024;

/// Default limit for [`Client::connect`]: TCP connect, upgrade and the `ready` frame.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long [`Client::close`] waits for the server to answer the close handshake.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Default [`ClientOptions::read_timeout`]: the gateway's own idle timeout (it closes a
/// WebSocket it has heard nothing from for 60 s), three of [`PING_INTERVAL`].
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Default [`ClientOptions::ping_interval`]: the interval after which the gateway pings a
/// silent client.
pub const PING_INTERVAL: Duration = Duration::from_secs(20);

/// How a connection is made and kept; [`Default`] gives what [`Client::connect`] uses.
///
/// Built with the `with_*` methods: `ClientOptions::default().with_read_timeout(d)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientOptions {
    /// Limit for the TCP connect, the upgrade and the `ready` frame together. Default
    /// [`CONNECT_TIMEOUT`].
    pub connect_timeout: Duration,
    /// The connection is lost (waiters fail with [`Error::Closed`], [`Event::Closed`] is
    /// sent) when nothing at all, not even a pong, has arrived from the server for this long.
    /// Default [`READ_TIMEOUT`]; [`Duration::MAX`] waits forever.
    pub read_timeout: Duration,
    /// The writer sends a WebSocket ping this often, whatever else it sends, so a server
    /// with nothing to say still answers within [`read_timeout`](Self::read_timeout) (keep
    /// it well below that). Default [`PING_INTERVAL`]; [`Duration::MAX`] sends none. At
    /// least 10 ms.
    pub ping_interval: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: CONNECT_TIMEOUT,
            read_timeout: READ_TIMEOUT,
            ping_interval: PING_INTERVAL,
        }
    }
}

impl ClientOptions {
    /// With [`connect_timeout`](Self::connect_timeout) set to `d`.
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// With [`read_timeout`](Self::read_timeout) set to `d`.
    pub fn with_read_timeout(mut self, d: Duration) -> Self {
        self.read_timeout = d;
        self
    }

    /// With [`ping_interval`](Self::ping_interval) set to `d`.
    pub fn with_ping_interval(mut self, d: Duration) -> Self {
        self.ping_interval = d;
        self
    }
}

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

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

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
    /// the server's `ready` frame, all within [`CONNECT_TIMEOUT`]; the connection then keeps
    /// the default [`ClientOptions`] (read timeout and pings; [`Client::connect_with`]
    /// chooses others).
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
        let options = ClientOptions::default().with_connect_timeout(timeout);
        Self::connect_with(ws_url, auth, &options).await
    }

    /// [`connect`](Client::connect) with `options`: the handshake's limit, the read deadline
    /// and the ping interval.
    pub async fn connect_with(
        ws_url: &str,
        auth: &Auth,
        options: &ClientOptions,
    ) -> Result<Client, Error> {
        let timeout = options.connect_timeout;
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
        let waiters = Waiters::new();
        let (done_tx, done_rx) = oneshot::channel();
        let writer = tokio::spawn(write_loop(sink, out_rx, done_rx, options.ping_interval));
        let reader = tokio::spawn(read_loop(
            stream,
            ev_tx,
            waiters.clone(),
            done_tx,
            options.read_timeout,
        ));
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
        self.handle.waiters.close();
    }
}

impl Deref for Client {
    type Target = ClientHandle;

    /// The client's own handle: every sending method of [`ClientHandle`] works on a `Client`.
    fn deref(&self) -> &ClientHandle {
        &self.handle
    }
}

/// For `examples/incoming_cost.rs` only (not part of the API): reads `text` as the
/// connection's read loop does (`full`: by the full parse alone, as before the one-pass read)
/// and tells whether it was a valid frame.
#[doc(hidden)]
pub fn __read_server_frame(text: &str, full: bool) -> bool {
    if full {
        incoming::parse_in_full(text).is_ok()
    } else {
        incoming::parse_incoming(text).is_ok()
    }
}
