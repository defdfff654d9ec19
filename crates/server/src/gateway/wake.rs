//! The gateway's side of wake-up hints: which connections a hint wakes. Materializers
//! publish `wake:{s}` (the shard's lowest present W and the recipients that got entries,
//! length-prefixed) on the mailbox Redis after W moves; one subscriber task per mailbox
//! instance ([`tidemark_store::wake::WakeSubscriber`], which owns the channel, the encoding,
//! the connection and its pings) hands each hint to the [`WakeHub`], which wakes the
//! connections of the users named and keeps the shard's hinted lowest W.
//!
//! A hint is only a hint: the data path is always the mailbox read (never above the lane's
//! W), and every connection also re-checks periodically, so a lost hint (a Pub/Sub reconnect)
//! only delays delivery. Waking uses `Notify::notify_one`, which stores a permit when the
//! connection is busy reading, so a hint is never lost between reads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_store::wake::{WakeHint, WakeSubscriber};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Wait before a failed or ended subscription is made again.
const RECONNECT_AFTER: Duration = Duration::from_millis(500);

/// The registered connections of one user: (registration id, its notifier).
type Waiters = Vec<(u64, Arc<Notify>)>;

/// Connections waiting for hints, by user.
#[derive(Default)]
pub(crate) struct WakeHub {
    users: Mutex<HashMap<String, Waiters>>,
    next_id: AtomicU64,
    /// Highest "lowest present W" hinted per shard: every entry at or below it is visible in
    /// every present lane, so a hinted reader may read up to it without reading `wm:{s}`.
    hinted: Mutex<HashMap<u32, u64>>,
}

/// A connection's registration; unregisters when dropped.
pub(crate) struct Registration {
    hub: Arc<WakeHub>,
    user: String,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut users = self.hub.users.lock().expect("wake hub lock");
        if let Some(list) = users.get_mut(&self.user) {
            list.retain(|(id, _)| *id != self.id);
            if list.is_empty() {
                users.remove(&self.user);
            }
        }
    }
}

impl WakeHub {
    /// Registers `notify` to be woken by hints naming `user`.
    pub(crate) fn register(self: &Arc<Self>, user: &str, notify: Arc<Notify>) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.users
            .lock()
            .expect("wake hub lock")
            .entry(user.to_string())
            .or_default()
            .push((id, notify));
        Registration {
            hub: Arc::clone(self),
            user: user.to_string(),
            id,
        }
    }

    /// Wakes the connections of every user named in a hint payload. Returns how many.
    #[cfg(test)]
    fn wake_payload(&self, shard: Option<u32>, payload: &[u8]) -> usize {
        match WakeHint::decode(payload) {
            Some(hint) => self.wake(shard, &hint),
            None => 0,
        }
    }

    /// Wakes the connections of every user a hint names (and records its lowest W for
    /// `shard`). Returns how many.
    pub(crate) fn wake(&self, shard: Option<u32>, hint: &WakeHint) -> usize {
        // The shard's lowest W bounds what a hinted reader may read without the watermark.
        if let Some(shard) = shard {
            let mut h = self.hinted.lock().expect("wake hub lock");
            let e = h.entry(shard).or_insert(0);
            *e = (*e).max(hint.min_w);
        }
        let users = self.users.lock().expect("wake hub lock");
        let mut woken = 0;
        for user in &hint.recipients {
            if let Some(list) = users.get(user.as_str()) {
                for (_, n) in list {
                    n.notify_one();
                    woken += 1;
                }
            }
        }
        woken
    }

    /// The highest lowest-present-W hinted for `shard` (0 before any hint).
    pub(crate) fn hinted_w(&self, shard: u32) -> u64 {
        let h = self.hinted.lock().expect("wake hub lock");
        h.get(&shard).copied().unwrap_or(0)
    }

    /// Wakes every connection (after a subscriber (re)connects: hints may have been missed).
    pub(crate) fn wake_all(&self) {
        let users = self.users.lock().expect("wake hub lock");
        for list in users.values() {
            for (_, n) in list {
                n.notify_one();
            }
        }
    }
}

/// Subscribes to `wake:*` on the mailbox instance `url` until `cancel`, reconnecting on
/// failure.
pub(crate) async fn run_subscriber(
    hub: Arc<WakeHub>,
    url: String,
    shards: std::ops::Range<u32>,
    cancel: CancellationToken,
) {
    let shown = tidemark_store::redact_url(&url);
    loop {
        let res = tokio::select! {
            _ = cancel.cancelled() => return,
            r = subscribe_once(&hub, &url, shards.clone(), &cancel) => r,
        };
        if cancel.is_cancelled() {
            return;
        }
        match res {
            Ok(()) => tracing::warn!(url = %shown, "wake subscription ended; reconnecting"),
            Err(e) => {
                tracing::warn!(url = %shown, error = %e, "wake subscription failed; reconnecting")
            }
        }
        metrics::counter!("tidemark_wake_reconnects_total").increment(1);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(RECONNECT_AFTER) => {}
        }
    }
}

async fn subscribe_once(
    hub: &WakeHub,
    url: &str,
    shards: std::ops::Range<u32>,
    cancel: &CancellationToken,
) -> Result<(), tidemark_store::Error> {
    let mut sub = WakeSubscriber::connect(url, shards).await?;
    tracing::debug!(url = %tidemark_store::redact_url(url), "wake subscription up");
    // Anything published while we were away is lost: let every connection re-read once.
    hub.wake_all();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            msg = sub.next() => {
                let Some(msg) = msg? else { return Ok(()) };
                metrics::counter!("tidemark_wake_hints_total").increment(1);
                if let Some(hint) = &msg.hint {
                    hub.wake(msg.shard, hint);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn hints_wake_named_users_only() {
        let hub = Arc::new(WakeHub::default());
        let a = Arc::new(Notify::new());
        let b = Arc::new(Notify::new());
        let ra = hub.register("alice", a.clone());
        let _rb = hub.register("bob", b.clone());
        let hint = tidemark_store::wake::encode(17, &["alice", "carol"]);
        assert_eq!(hub.wake_payload(None, &hint), 1);
        // The permit was stored: a later wait returns at once.
        tokio::time::timeout(Duration::from_millis(100), a.notified())
            .await
            .expect("alice woken");
        assert!(
            tokio::time::timeout(Duration::from_millis(20), b.notified())
                .await
                .is_err(),
            "bob not woken"
        );
        // The min_w line is not a user.
        assert_eq!(hub.wake_payload(None, b"alice"), 0);
        drop(ra);
        assert_eq!(
            hub.wake_payload(None, &tidemark_store::wake::encode(1, &["alice"])),
            0
        );
        assert!(hub.users.lock().unwrap().get("alice").is_none());
    }
}
