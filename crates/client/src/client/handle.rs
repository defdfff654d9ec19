//! [`ClientHandle`]: the cloneable sending side of one connection. Every method queues one
//! frame to the writer task (waiting while its queue is full); the waiting variants register
//! a waiter for the send id first (see `waiters.rs`), so the reader can hand them the answer.

use std::fmt;
use std::time::{Duration, Instant};

use tidemark_protocol::{ClientFrame, SendRequest};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use super::waiters::{PendingAck, Waiters};
use super::Offsets;
use crate::error::Error;

/// A cloneable sender for one connection: everything but reading events.
///
/// All methods return once the frame is queued to the writer task (waiting while its queue
/// is full), or [`Error::Closed`] when the connection has ended.
#[derive(Clone)]
pub struct ClientHandle {
    pub(super) out: mpsc::Sender<Message>,
    pub(super) waiters: Waiters,
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

    /// Queues a `send` frame with `id`, counted for `id` (see `waiters.rs`): its answer is
    /// the waiter `waiter`'s own, or, without one, not the answer of a later waiter for `id`.
    async fn queue_send(&self, id: &str, waiter: Option<u64>, frame: Message) -> Result<(), Error> {
        let permit = self.out.reserve().await.map_err(|_| Error::Closed)?;
        self.waiters.queue_send(id, waiter, permit, frame)
    }

    /// Queues `{"type":"send","id":…,"to":…,"body":…}` without waiting for the answer: the
    /// `send_ack` (or `error`) arrives as an [`Event`](super::Event). Nothing is validated client-side.
    pub async fn send(&self, id: &str, to: &[String], body: &str) -> Result<(), Error> {
        self.queue_send(id, None, Message::text(send_json(id, to, body)))
            .await
    }

    /// Registers a waiter for `id`, then queues the send. Await the answer with
    /// [`PendingAck::wait`]; dropping the `PendingAck` unregisters it (a late answer then
    /// becomes an [`Event`](super::Event), even when a retry of `id` waits by then: a waiter
    /// gets the answer to its own frame).
    ///
    /// Errors: [`Error::IdInFlight`] if a waiter for `id` already exists on this connection,
    /// [`Error::Closed`].
    pub async fn start_send(
        &self,
        id: &str,
        to: &[String],
        body: &str,
    ) -> Result<PendingAck, Error> {
        let pending = self.waiters.register(id)?;
        let frame = Message::text(send_json(id, to, body));
        self.queue_send(id, Some(pending.token), frame).await?;
        Ok(pending)
    }

    /// Sends and waits for the `send_ack` with this `id` (its shard offsets), or fails with
    /// [`Error::Server`] for an `error` frame with this `id`. `timeout` covers queueing and
    /// waiting; after [`Error::Timeout`] or [`Error::Closed`] the message may or may not be
    /// committed: retry with the same id. Other frames meanwhile go to
    /// [`Client::next_event`](super::Client::next_event).
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

    /// Queues an arbitrary text frame as is: a frame built by the caller (the load generator
    /// writes its `send` frames itself; their answers then arrive as
    /// [`Event`](super::Event)s), or hostile input for testing the server.
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
}

fn send_json(id: &str, to: &[String], body: &str) -> String {
    ClientFrame::Send(SendRequest {
        id: id.to_owned(),
        to: to.to_vec(),
        body: body.to_owned(),
    })
    .to_json()
}
