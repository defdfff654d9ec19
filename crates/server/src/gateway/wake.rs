//! The gateway's side of wake-up hints: which connections a hint wakes. Materializers
//! publish `wake:{s}` (the shard's lowest present W, the hint's number in the shard's
//! sequence and the recipients that got entries) on the mailbox Redis after W moves; one
//! subscriber task per mailbox instance ([`tidemark_store::wake::WakeSubscriber`], which owns
//! the channel, the encoding, the connection and its pings) hands each hint to the
//! [`WakeHub`], which wakes the connections of the users named and keeps the shard's hinted
//! lowest W.
//!
//! A hint is only a hint: the data path is always the mailbox read (never above the lane's
//! W). Connections do not re-read their mailboxes periodically (ADR-0035); instead nothing
//! that could make a connection miss an entry goes unnoticed:
//!
//! - a subscriber that (re)connects wakes every connection once (hints published while it was
//!   away are lost);
//! - a hint out of its shard's sequence (another epoch: a new owner or a re-fence; number 0: a
//!   claim; a skipped number) wakes every connection of that shard once;
//! - a slow sweep ([`SWEEP_EVERY`]) reads the watermarks of the instance's shards (one
//!   pipeline) and wakes the connections of a shard whose lowest W is above the hinted one,
//!   or whose watermark changed with no sequenced hint since the last sweep (a publisher that
//!   predates sequencing, or any loss not foreseen above).
//!
//! Waking uses `Notify::notify_one`, which stores a permit when the connection is busy reading,
//! so a hint is never lost between reads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::ShardWatermark;
use tidemark_store::wake::{HintSeq, WakeHint, WakeSubscriber};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Wait before a failed or ended subscription is made again.
const RECONNECT_AFTER: Duration = Duration::from_millis(500);

/// How often the subscriber sweeps its instance's watermarks for moves no hint announced.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// The registered connections of one user: (registration id, shard, its notifier).
type Waiters = Vec<(u64, u32, Arc<Notify>)>;

/// What the hub knows of one shard's hints.
#[derive(Default, Clone, Copy)]
struct ShardHints {
    /// Highest "lowest present W" hinted (reset on a new epoch).
    min_w: u64,
    /// The last sequenced hint received.
    last: Option<HintSeq>,
    /// A sequenced hint arrived since the last sweep.
    since_sweep: bool,
}

/// Connections waiting for hints, by user.
#[derive(Default)]
pub(crate) struct WakeHub {
    users: Mutex<HashMap<String, Waiters>>,
    next_id: AtomicU64,
    /// Per shard: every entry at or below the hinted lowest W is visible in every present
    /// lane, so a hinted reader may read up to it without reading `wm:{s}`; and where the
    /// shard's hint sequence stands.
    hinted: Mutex<HashMap<u32, ShardHints>>,
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
            list.retain(|(id, _, _)| *id != self.id);
            if list.is_empty() {
                users.remove(&self.user);
            }
        }
    }
}

impl WakeHub {
    /// Registers `notify` to be woken by hints naming `user`, whose mailbox is on `shard`.
    pub(crate) fn register(
        self: &Arc<Self>,
        user: &str,
        shard: u32,
        notify: Arc<Notify>,
    ) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.users
            .lock()
            .expect("wake hub lock")
            .entry(user.to_string())
            .or_default()
            .push((id, shard, notify));
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

    /// Wakes the connections of every user a hint names (and records its lowest W and its
    /// place in the sequence for `shard`); a hint out of sequence wakes every connection of
    /// the shard. Returns how many were woken.
    pub(crate) fn wake(&self, shard: Option<u32>, hint: &WakeHint) -> usize {
        let mut whole_shard = None;
        if let Some(shard) = shard {
            let mut h = self.hinted.lock().expect("wake hub lock");
            let e = h.entry(shard).or_default();
            match hint.seq {
                Some(q) => {
                    // the first hint since the subscription needs no predecessor: the
                    // subscriber woke every connection when it subscribed
                    let in_sequence = e.last.is_none_or(|l| l.follows(q)) && q.seq != 0;
                    if !in_sequence {
                        whole_shard = Some(shard);
                        metrics::counter!("tidemark_wake_sequence_gaps_total").increment(1);
                    }
                    if e.last.is_some_and(|l| l.epoch != q.epoch) {
                        // a new owner or a re-fence (W may have gone back): start over
                        e.min_w = hint.min_w;
                    } else {
                        e.min_w = e.min_w.max(hint.min_w);
                    }
                    e.last = Some(q);
                    e.since_sweep = true;
                }
                None => e.min_w = e.min_w.max(hint.min_w),
            }
        }
        let users = self.users.lock().expect("wake hub lock");
        let mut woken = 0;
        if let Some(s) = whole_shard {
            woken += wake_where(&users, |shard| shard == s);
        }
        for user in &hint.recipients {
            if let Some(list) = users.get(user.as_str()) {
                for (_, _, n) in list {
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
        h.get(&shard).map_or(0, |e| e.min_w)
    }

    /// Wakes every connection (after a subscriber (re)connects: hints may have been missed),
    /// and forgets every shard's sequence (the next hint starts it again).
    pub(crate) fn wake_all(&self) {
        for e in self.hinted.lock().expect("wake hub lock").values_mut() {
            e.last = None;
        }
        let users = self.users.lock().expect("wake hub lock");
        wake_where(&users, |_| true);
    }

    /// A sweep read `shard`'s lowest present W (`min_w`) and whether its watermark changed
    /// since the previous sweep: wakes every connection of the shard when the hints may have
    /// missed a move. Returns how many were woken.
    fn swept(&self, shard: u32, min_w: u64, changed: bool) -> usize {
        let missed = {
            let mut h = self.hinted.lock().expect("wake hub lock");
            let e = h.entry(shard).or_default();
            let missed = min_w > e.min_w || (changed && !e.since_sweep);
            e.min_w = e.min_w.max(min_w);
            e.since_sweep = false;
            missed
        };
        if !missed {
            return 0;
        }
        metrics::counter!("tidemark_wake_sweep_wakes_total").increment(1);
        let users = self.users.lock().expect("wake hub lock");
        wake_where(&users, |s| s == shard)
    }

    /// Whether any connection waits on `shard`.
    fn watched(&self, shard: u32) -> bool {
        let users = self.users.lock().expect("wake hub lock");
        users.values().flatten().any(|(_, s, _)| *s == shard)
    }
}

/// Wakes every registered connection whose shard passes `pick`. Returns how many.
fn wake_where(users: &HashMap<String, Waiters>, pick: impl Fn(u32) -> bool) -> usize {
    let mut woken = 0;
    for list in users.values() {
        for (_, s, n) in list {
            if pick(*s) {
                n.notify_one();
                woken += 1;
            }
        }
    }
    woken
}

/// Subscribes to `wake:*` on the mailbox instance `url` until `cancel`, reconnecting on
/// failure; sweeps the watermarks of `owned` (the shards of this instance) every
/// [`SWEEP_EVERY`].
pub(crate) async fn run_subscriber(
    hub: Arc<WakeHub>,
    url: String,
    shards: std::ops::Range<u32>,
    sweep: Sweep,
    cancel: CancellationToken,
) {
    let shown = tidemark_store::redact_url(&url);
    let mut sweep = sweep;
    loop {
        let res = tokio::select! {
            _ = cancel.cancelled() => return,
            r = subscribe_once(&hub, &url, shards.clone(), &mut sweep, &cancel) => r,
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

/// The slow safety sweep of one mailbox instance: its shards and their watermarks as last
/// read.
pub(crate) struct Sweep {
    store: MailboxStore,
    shards: Vec<u32>,
    every: Duration,
    /// The watermark last read per shard (index as in `shards`).
    seen: Vec<Option<ShardWatermark>>,
}

impl Sweep {
    pub(crate) fn new(store: MailboxStore, shards: Vec<u32>, every: Duration) -> Sweep {
        let seen = vec![None; shards.len()];
        Sweep {
            store,
            shards,
            every,
            seen,
        }
    }

    /// Reads the watermarks of the watched shards (one pipeline) and hands each to the hub.
    async fn run(&mut self, hub: &WakeHub) -> Result<(), tidemark_store::Error> {
        let picked: Vec<usize> = (0..self.shards.len())
            .filter(|&i| hub.watched(self.shards[i]))
            .collect();
        if picked.is_empty() {
            return Ok(());
        }
        let shards: Vec<u32> = picked.iter().map(|&i| self.shards[i]).collect();
        let wms = self.store.read_watermarks(&shards).await?;
        for (&i, wm) in picked.iter().zip(wms) {
            let wm = wm?;
            let min_w = wm.lanes.min_present_w().unwrap_or(0);
            let changed = self.seen[i].as_ref().is_some_and(|old| *old != wm);
            self.seen[i] = Some(wm);
            hub.swept(self.shards[i], min_w, changed);
        }
        Ok(())
    }
}

async fn subscribe_once(
    hub: &WakeHub,
    url: &str,
    shards: std::ops::Range<u32>,
    sweep: &mut Sweep,
    cancel: &CancellationToken,
) -> Result<(), tidemark_store::Error> {
    let mut sub = WakeSubscriber::connect(url, shards).await?;
    tracing::debug!(url = %tidemark_store::redact_url(url), "wake subscription up");
    // Anything published while we were away is lost: let every connection re-read once.
    hub.wake_all();
    let mut tick = tokio::time::interval(sweep.every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
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
            _ = tick.tick() => {
                // a failed sweep is only a missed safety net: the next one tries again
                if let Err(e) = sweep.run(hub).await {
                    tracing::debug!(error = %e, "wake sweep failed");
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
        let ra = hub.register("alice", 0, a.clone());
        let _rb = hub.register("bob", 0, b.clone());
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

    /// Whether `n` holds a wake permit (consumes it).
    async fn woken(n: &Notify) -> bool {
        tokio::time::timeout(Duration::from_millis(20), n.notified())
            .await
            .is_ok()
    }

    fn hint(epoch: u64, seq: u64, min_w: u64, to: &[&str]) -> WakeHint {
        WakeHint {
            min_w,
            seq: Some(HintSeq { epoch, seq }),
            recipients: to.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[tokio::test]
    async fn a_hint_out_of_sequence_wakes_the_whole_shard_and_only_it() {
        let hub = Arc::new(WakeHub::default());
        let (a, b, c) = (
            Arc::new(Notify::new()),
            Arc::new(Notify::new()),
            Arc::new(Notify::new()),
        );
        let _ra = hub.register("alice", 3, a.clone());
        let _rb = hub.register("bob", 3, b.clone());
        let _rc = hub.register("carol", 4, c.clone());
        // the first hint after subscribing needs no predecessor; then in sequence
        assert_eq!(hub.wake(Some(3), &hint(7, 5, 10, &["alice"])), 1);
        assert_eq!(hub.wake(Some(3), &hint(7, 6, 11, &["alice"])), 1);
        assert!(woken(&a).await && !woken(&b).await && !woken(&c).await);
        // number 8 after 6: one was missed, every connection of shard 3 re-reads
        assert_eq!(hub.wake(Some(3), &hint(7, 8, 12, &["alice"])), 3);
        assert!(woken(&a).await && woken(&b).await && !woken(&c).await);
        // a new owner's claim (seq 0, another epoch): the same, and W starts over
        assert_eq!(hub.wake(Some(3), &hint(9, 0, 4, &[])), 2);
        assert!(woken(&a).await && woken(&b).await && !woken(&c).await);
        assert_eq!(
            hub.hinted_w(3),
            4,
            "a new epoch may have a lower W (a regression)"
        );
        // the same epoch resuming in sequence wakes only the named
        assert_eq!(hub.wake(Some(3), &hint(9, 1, 5, &["bob"])), 1);
        // after a resubscription any next number is accepted
        hub.wake_all();
        assert!(woken(&a).await && woken(&b).await && woken(&c).await);
        assert_eq!(hub.wake(Some(3), &hint(9, 40, 6, &["bob"])), 1);
        assert_eq!(hub.hinted_w(3), 6);
    }

    #[tokio::test]
    async fn the_sweep_wakes_a_shard_whose_move_no_hint_announced() {
        let hub = Arc::new(WakeHub::default());
        let (a, c) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let _ra = hub.register("alice", 3, a.clone());
        let _rc = hub.register("carol", 4, c.clone());
        assert!(hub.watched(3) && hub.watched(4) && !hub.watched(5));
        // W above everything hinted: the last hint was lost
        assert_eq!(hub.wake(Some(3), &hint(1, 1, 10, &[])), 0);
        assert_eq!(hub.swept(3, 12, false), 1);
        assert!(woken(&a).await && !woken(&c).await);
        assert_eq!(hub.hinted_w(3), 12);
        // caught up, unchanged: nothing
        assert_eq!(hub.swept(3, 12, false), 0);
        // a lane moved (the lowest W did not) with no sequenced hint since the last sweep
        assert_eq!(hub.swept(3, 12, true), 1);
        // ... and with one: the hint named whoever got entries
        hub.wake(Some(3), &hint(1, 2, 12, &[]));
        assert_eq!(hub.swept(3, 12, true), 0);
        // unsequenced hints (an older materializer) never count as covering a change
        hub.wake(
            Some(3),
            &WakeHint {
                min_w: 12,
                seq: None,
                recipients: vec![],
            },
        );
        assert_eq!(hub.swept(3, 12, true), 1);
    }
}
