//! The waiters of one connection: who waits for the answer to which send id.
//!
//! A send id has at most one waiter at a time ([`Waiters::register`] refuses a second with
//! [`Error::IdInFlight`]). The server answers a connection's sends in the order they were
//! sent, so for each id the registry counts the `send` frames queued
//! ([`Waiters::queue_send`]) and the answers read ([`Waiters::answer`]): a waiter gets the
//! answer whose number is that of its own frame, and an answer owed to an earlier attempt of
//! the same id (one whose waiter timed out or was dropped, or a plain
//! [`send`](super::ClientHandle::send)) goes to the event stream instead of completing a
//! retry with an answer that is not its own. A dropped [`PendingAck`] removes its own
//! registration (and only its own: the id may have been answered and registered again); an
//! id is forgotten once every frame counted for it is answered and nobody waits. When the
//! connection ends the registry is closed ([`Waiters::close`]): every pending waiter fails
//! with [`Error::Closed`] and new ones are refused.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

use super::Offsets;
use crate::error::Error;

/// What a waiter receives: the offsets of its `send_ack`, or the `(code, message)` of its
/// `error` frame.
pub(super) type WaitResult = Result<Offsets, (String, String)>;
/// id → what is counted and awaited for it. `None` once the connection has ended.
type WaiterMap = HashMap<String, IdState>;

/// The `send` frames of one id on this connection and their answers.
struct IdState {
    /// `send` frames with this id queued to the writer (those the server answers with the id).
    sent: u64,
    /// Answers (`send_ack` or `error` carrying the id) read.
    answered: u64,
    waiter: Option<Waiter>,
}

struct Waiter {
    /// The registration token (see [`Waiters::unregister`]).
    token: u64,
    /// The number of the answer that is this waiter's own: the count of `sent` once its
    /// frame was queued; [`NOT_YET`] before, [`NONE_OWED`] for a frame the server answers
    /// without the id.
    own: u64,
    tx: oneshot::Sender<WaitResult>,
}

/// [`Waiter::own`] before the waiter's frame is queued.
const NOT_YET: u64 = 0;
/// [`Waiter::own`] of a frame whose answer will not carry the id.
const NONE_OWED: u64 = u64::MAX;

impl fmt::Debug for IdState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdState")
            .field("sent", &self.sent)
            .field("answered", &self.answered)
            .field("waiter", &self.waiter.as_ref().map(|w| (w.token, w.own)))
            .finish()
    }
}

impl IdState {
    /// Nothing left to count or hand over: the id can be forgotten.
    fn settled(&self) -> bool {
        self.waiter.is_none() && self.answered >= self.sent
    }
}

static NEXT_WAITER: AtomicU64 = AtomicU64::new(1);

/// The longest `send` frame the server reads and answers with its id: the protocol's frame
/// limit (`frame_too_large` refusals carry no id).
fn answered_with_its_id(frame: &Message) -> bool {
    frame.len() <= tidemark_protocol::Limits::default().max_frame_bytes
}

/// The registry of one connection, shared by its reader task, its handles and every
/// [`PendingAck`].
#[derive(Clone)]
pub(super) struct Waiters(Arc<Mutex<Option<WaiterMap>>>);

impl fmt::Debug for Waiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl Waiters {
    /// An open registry with no waiter.
    pub(super) fn new() -> Self {
        Waiters(Arc::new(Mutex::new(Some(HashMap::new()))))
    }

    fn lock(&self) -> MutexGuard<'_, Option<WaiterMap>> {
        // A panic while holding this lock cannot leave the map inconsistent (single inserts and
        // removes), so a poisoned lock is still usable.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a waiter for `id`, whose frame is queued next with [`queue_send`]
    /// (`Some(token)` of the returned [`PendingAck`]): [`Error::IdInFlight`] if one exists,
    /// [`Error::Closed`] once the connection has ended.
    ///
    /// [`queue_send`]: Waiters::queue_send
    pub(super) fn register(&self, id: &str) -> Result<PendingAck, Error> {
        let token = NEXT_WAITER.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let mut guard = self.lock();
        let map = guard.as_mut().ok_or(Error::Closed)?;
        let state = map.entry(id.to_owned()).or_insert(IdState {
            sent: 0,
            answered: 0,
            waiter: None,
        });
        if state.waiter.is_some() {
            return Err(Error::IdInFlight(id.to_owned()));
        }
        state.waiter = Some(Waiter {
            token,
            own: NOT_YET,
            tx,
        });
        Ok(PendingAck {
            id: id.to_owned(),
            token,
            rx,
            waiters: self.clone(),
        })
    }

    /// Queues the `send` frame `frame` with `id` through `permit` and counts it, under the
    /// registry's lock so that the count follows the order of the writer's queue; with
    /// `waiter`, that registration's own answer is the one to this frame. [`Error::Closed`]
    /// (nothing queued) once the connection has ended.
    pub(super) fn queue_send(
        &self,
        id: &str,
        waiter: Option<u64>,
        permit: mpsc::Permit<'_, Message>,
        frame: Message,
    ) -> Result<(), Error> {
        let mut guard = self.lock();
        let map = guard.as_mut().ok_or(Error::Closed)?;
        let counted = answered_with_its_id(&frame);
        let state = match map.get_mut(id) {
            Some(state) => state,
            // Nothing to count: no waiter, and the answer will not carry the id.
            None if !counted => {
                permit.send(frame);
                return Ok(());
            }
            None => map.entry(id.to_owned()).or_insert(IdState {
                sent: 0,
                answered: 0,
                waiter: None,
            }),
        };
        if counted {
            state.sent += 1;
        }
        if let Some(w) = state.waiter.as_mut().filter(|w| Some(w.token) == waiter) {
            w.own = if counted { state.sent } else { NONE_OWED };
        }
        permit.send(frame);
        Ok(())
    }

    /// Counts an answer (`send_ack` or `error`) carrying `id` and returns the waiter it
    /// belongs to, if any: `None` for an id never sent here (or sent only raw), for an answer
    /// owed to an earlier attempt, and when nobody waits.
    pub(super) fn answer(&self, id: &str) -> Option<oneshot::Sender<WaitResult>> {
        let mut guard = self.lock();
        let map = guard.as_mut()?;
        let state = map.get_mut(id)?;
        state.answered += 1;
        let tx = match &state.waiter {
            Some(w) if w.own == state.answered => state.waiter.take().map(|w| w.tx),
            _ => None,
        };
        if state.settled() {
            map.remove(id);
        }
        tx
    }

    /// Closes the registry: every pending waiter fails (its sender drops), new ones are
    /// refused.
    pub(super) fn close(&self) {
        self.lock().take();
    }

    /// Removes the registration `token` of `id`, if it is still the current one. What was
    /// sent for the id stays counted until answered.
    fn unregister(&self, id: &str, token: u64) {
        let mut guard = self.lock();
        let Some(map) = guard.as_mut() else { return };
        let Some(state) = map.get_mut(id) else { return };
        // Only our own registration: the id may have been answered and registered again.
        if state.waiter.as_ref().is_some_and(|w| w.token == token) {
            state.waiter = None;
            if state.settled() {
                map.remove(id);
            }
        }
    }
}

/// A send whose answer has not been awaited yet; see
/// [`ClientHandle::start_send`](super::ClientHandle::start_send).
///
/// Dropping it unregisters the waiter.
#[derive(Debug)]
pub struct PendingAck {
    id: String,
    pub(super) token: u64,
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

    pub(super) async fn wait_inner(
        mut self,
        left: Duration,
        reported: Duration,
    ) -> Result<Offsets, Error> {
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
        self.waiters.unregister(&self.id, self.token);
    }
}
