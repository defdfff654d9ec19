//! The waiters of one connection: who waits for the answer to which send id.
//!
//! A send id has at most one waiter at a time ([`Waiters::register`] refuses a second with
//! [`Error::IdInFlight`]). The reader task takes the waiter of an incoming `send_ack` or
//! `error` ([`Waiters::take`]); a dropped [`PendingAck`] removes its own registration (and
//! only its own: the id may have been answered and registered again). When the connection
//! ends the registry is closed ([`Waiters::close`]): every pending waiter fails with
//! [`Error::Closed`] and new ones are refused.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use super::Offsets;
use crate::error::Error;

/// What a waiter receives: the offsets of its `send_ack`, or the `(code, message)` of its
/// `error` frame.
pub(super) type WaitResult = Result<Offsets, (String, String)>;
/// id → (registration token, waiter). `None` once the connection has ended.
type WaiterMap = HashMap<String, (u64, oneshot::Sender<WaitResult>)>;

static NEXT_WAITER: AtomicU64 = AtomicU64::new(1);

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

    /// Registers a waiter for `id`: [`Error::IdInFlight`] if one exists, [`Error::Closed`]
    /// once the connection has ended.
    pub(super) fn register(&self, id: &str) -> Result<PendingAck, Error> {
        let token = NEXT_WAITER.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let mut guard = self.lock();
        let map = guard.as_mut().ok_or(Error::Closed)?;
        if map.contains_key(id) {
            return Err(Error::IdInFlight(id.to_owned()));
        }
        map.insert(id.to_owned(), (token, tx));
        Ok(PendingAck {
            id: id.to_owned(),
            token,
            rx,
            waiters: self.clone(),
        })
    }

    /// Removes and returns the waiter for `id`, if any.
    pub(super) fn take(&self, id: &str) -> Option<oneshot::Sender<WaitResult>> {
        self.lock().as_mut()?.remove(id).map(|(_, tx)| tx)
    }

    /// Closes the registry: every pending waiter fails (its sender drops), new ones are
    /// refused.
    pub(super) fn close(&self) {
        self.lock().take();
    }

    /// Removes the registration `token` of `id`, if it is still the current one.
    fn unregister(&self, id: &str, token: u64) {
        let mut guard = self.lock();
        if let Some(map) = guard.as_mut() {
            // Only our own registration: the id may have been answered and registered again.
            if map.get(id).is_some_and(|(t, _)| *t == token) {
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
