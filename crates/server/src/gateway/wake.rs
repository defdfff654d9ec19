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
//!   away are lost), and each reads up to its lane's W, not up to the hinted W, which is from
//!   before (ADR-0067);
//! - a hint out of its shard's sequence (another epoch: a new owner or a re-fence; number 0: a
//!   claim; a skipped number) wakes every connection of that shard once;
//! - a slow sweep ([`SWEEP_EVERY`]) reads the watermarks of the instance's shards (one
//!   pipeline) and wakes the connections of a shard whose lowest W is above the hinted one,
//!   or whose watermark changed with no sequenced hint since the last sweep (a publisher that
//!   predates sequencing, or any loss not foreseen above);
//! - the same sweep checks the last step, from the hub to each connection (ADR-0067): a
//!   connection still below the lowest W of the hints that named its user a whole sweep ago
//!   (its [`Progress`]) is woken to read in full, and the lost wake counted and logged.
//!
//! In one process (ADR-0041, ADR-0047) a hint in sequence whose moves the hub itself handed
//! out as an unbroken chain of local runs wakes only the connections that take no runs, and
//! the sweep does not count those moves as missed: such a hint may come up to the
//! materializer's `hint_linger` late, and the connections that take runs already have them.
//!
//! Waking uses `Notify::notify_one`, which stores a permit when the connection is busy reading,
//! so a hint is never lost between reads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::extract::ws::Utf8Bytes;
use tidemark_protocol::deliver_json;
use tidemark_protocol::entry::decode_entry_head;
use tidemark_store::redis::store::{MailboxStore, SingleItem};
use tidemark_store::redis::watermark::ShardWatermark;
use tidemark_store::wake::{HintSeq, WakeHint, WakeSubscriber};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;

use crate::health::HealthBoard;

/// Wait before a failed or ended subscription is made again.
const RECONNECT_AFTER: Duration = Duration::from_millis(500);

/// How long connecting and subscribing may take in all: the store's connect bound (four of
/// them on a cluster, one per node it may try) and a ping's bound for the answer to
/// `PSUBSCRIBE`, which a Pub/Sub connection of redis-rs does not bound itself (ADR-0126).
fn subscribe_within(url: &str) -> Duration {
    let connects = if tidemark_store::endpoint::is_cluster(url) {
        4
    } else {
        1
    };
    tidemark_store::wake::CONNECT_TIMEOUT * connects + tidemark_store::wake::PING_TIMEOUT
}

/// Why a subscription could not be made or ended.
#[derive(Debug, thiserror::Error)]
enum SubscribeError {
    /// Connecting, subscribing or the subscription failed.
    #[error(transparent)]
    Store(#[from] tidemark_store::Error),
    /// Connecting and subscribing took longer than [`subscribe_within`].
    #[error("connecting and subscribing took more than {0:?}")]
    TimedOut(Duration),
}

/// How often the subscriber sweeps its instance's watermarks for moves no hint announced.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// One registered connection.
struct Waiter {
    /// Registration id (to unregister).
    id: u64,
    /// The shard its mailbox is on.
    shard: u32,
    /// Wakes its delivery loop.
    notify: Arc<Notify>,
    /// Where this process's materializer hands it fresh entries (ADR-0041); `None`: hints only.
    local: Option<LocalTx>,
    /// What the connection has caught up to, and how the sweep makes it read (ADR-0067).
    progress: Progress,
    /// The highest W this hub told the connection to catch up to: the lowest W of a hint
    /// that named its user (woken or handed as local runs) or woke its whole shard.
    owed: u64,
    /// `owed` as the previous sweep left it: a connection still below it at the next sweep
    /// was told a whole sweep ago and has not caught up (ADR-0067).
    owed_swept: u64,
    /// Woken with every connection (a resubscription), at no known W: the next sweep owes it
    /// the W it reads, which is at least the W of then.
    owed_at_sweep: bool,
}

/// Shared between a connection's delivery loop and its registration in the hub (ADR-0067):
/// the end-to-end check that a wake the hub gave was acted on.
#[derive(Clone, Default)]
pub(crate) struct Progress {
    /// Every entry of the mailbox at or below it has been pushed: the loop's `seen`, stored
    /// each time the loop waits.
    pub seen: Arc<AtomicU64>,
    /// Set by the sweep for a connection behind what it was owed: the next wake reads the
    /// mailbox in full (watermark and all), never trusting a hint or a local run.
    pub recheck: Arc<AtomicBool>,
}

/// The registered connections of one user.
type Waiters = Vec<Waiter>;

/// How many local runs a connection may have queued; beyond, a run is dropped and the
/// connection reads its mailbox instead (its `lost` flag).
const LOCAL_QUEUE: usize = 64;

/// Fresh entries of one shard handed to one connection by this process's materializer
/// (ADR-0041): every entry of its user with a seq in `(chain_from, to]` that this process
/// has materialised is in this run or in an earlier run the connection was handed.
pub(crate) struct LocalRun {
    /// Where the unbroken chain of local runs of the shard, that this run ends, starts: W
    /// before the first run of the chain.
    pub chain_from: u64,
    /// The shard's W after this run (every lane: the hot path runs on uniform watermarks).
    pub to: u64,
    /// The user's entries of this run, ascending.
    pub entries: Vec<LocalEntry>,
    /// The bytes of the entries' frames: what the run counts against its connection's
    /// queue budget until the connection takes it.
    pub bytes: usize,
}

/// One entry of a local run, with its `deliver` frame serialised once for every connection
/// it goes to (a record of several recipients, or a user with several connections, shares
/// one frame: each connection takes a reference, not a copy to serialise again).
#[derive(Clone)]
pub(crate) struct LocalEntry {
    /// The entry's seq (its log offset).
    pub seq: u64,
    /// When it was sent (µs since the Unix epoch): a live delivery's latency is measured from it.
    pub sent_at_us: u64,
    /// The `deliver` frame, as the connection writes it.
    pub frame: Utf8Bytes,
}

impl LocalEntry {
    /// The entry and its `deliver` frame.
    #[cfg(test)]
    pub(crate) fn new(e: tidemark_protocol::entry::Entry) -> LocalEntry {
        let (seq, sent_at_us) = (e.seq, e.sent_at_us);
        LocalEntry {
            seq,
            sent_at_us,
            frame: tidemark_protocol::ServerFrame::Deliver(e).to_json().into(),
        }
    }

    /// The entry stored as `bytes` at `seq`, checked as
    /// [`decode_entry`](tidemark_protocol::entry::decode_entry) checks it (and that it is the
    /// entry of `seq`), its frame serialised from the borrowed bytes without the entry's own
    /// `String`s (ADR-0084); `None` when it does not decode.
    pub(crate) fn decode(bytes: &[u8], seq: u64) -> Option<LocalEntry> {
        let head = decode_entry_head(bytes).ok().filter(|h| h.seq == seq)?;
        let body = std::str::from_utf8(head.body).ok()?;
        Some(LocalEntry {
            seq,
            sent_at_us: head.sent_at_us,
            frame: deliver_json(seq, head.from, body, head.sent_at_us).into(),
        })
    }
}

/// The hub's end of a connection's local runs.
#[derive(Clone)]
struct LocalTx {
    tx: mpsc::Sender<LocalRun>,
    lost: Arc<AtomicBool>,
    /// Bytes of the runs queued and not yet taken (shared with [`LocalRuns`]).
    queued: Arc<AtomicUsize>,
    /// How many bytes of runs may wait (ADR-0111); one run always fits an empty queue.
    budget: usize,
}

/// The connection's end of its local runs (and of its registration's [`Progress`]).
pub(crate) struct LocalRuns {
    rx: mpsc::Receiver<LocalRun>,
    /// Set when a run for this connection was dropped (its queue was full): the connection
    /// must read its mailbox before it trusts a local run again.
    pub lost: Arc<AtomicBool>,
    /// What the connection reports to the hub's sweep, and hears back from it (ADR-0067).
    pub progress: Progress,
    /// Bytes of the runs queued and not yet taken: taking a run frees its bytes.
    queued: Arc<AtomicUsize>,
}

impl LocalRuns {
    /// The next run (waiting for one); `None` once the hub dropped the connection's sender.
    pub(crate) async fn recv(&mut self) -> Option<LocalRun> {
        let run = self.rx.recv().await?;
        self.queued.fetch_sub(run.bytes, Ordering::AcqRel);
        Some(run)
    }

    /// The next run if one is queued.
    pub(crate) fn try_recv(&mut self) -> Option<LocalRun> {
        let run = self.rx.try_recv().ok()?;
        self.queued.fetch_sub(run.bytes, Ordering::AcqRel);
        Some(run)
    }
}

/// This process's materializers hand freshly materialised hot-path entries to its gateway's
/// connections through this (ADR-0041), so that a connection that is caught up delivers them
/// without reading its mailbox back. Wake hints still go through Redis, for every gateway.
#[derive(Clone, Default)]
pub struct LocalDelivery {
    pub(crate) hub: Arc<WakeHub>,
}

impl std::fmt::Debug for LocalDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalDelivery")
    }
}

impl LocalDelivery {
    /// Wires one handle into a process's gateway and materializer options when the gateway
    /// serves clients and `local_delivery` is on (and nothing is wired yet).
    pub fn wire(
        gateway: &mut super::GatewayOptions,
        materializer: &mut crate::materializer::MaterializerOptions,
    ) {
        if gateway.clients && gateway.local_delivery && gateway.local.is_none() {
            let local = LocalDelivery::default();
            gateway.local = Some(local.clone());
            materializer.local = Some(local);
        }
    }

    /// Hands a run of hot-path records of `shard`, every one of them applied (W went from
    /// the first one's `prev` to the last one's offset), to the connections of their
    /// recipients.
    pub(crate) fn deliver(&self, shard: u32, items: &[SingleItem]) {
        self.hub.deliver_local(shard, items);
    }
}

/// What the hub knows of one shard's hints.
#[derive(Default, Clone, Copy)]
struct ShardHints {
    /// Highest "lowest present W" hinted (reset on a new epoch).
    min_w: u64,
    /// The last sequenced hint received.
    last: Option<HintSeq>,
    /// The epoch of the last sequenced hint, kept across resubscriptions (which forget
    /// `last`): a hint of another epoch lets `min_w` go back (ADR-0100).
    epoch: Option<u64>,
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
    /// Per shard, the unbroken chain of local runs handed out (ADR-0041): (W where it
    /// starts, W where it ends).
    chains: Mutex<HashMap<u32, (u64, u64)>>,
    /// How many times every connection was woken ([`WakeHub::resubscribed`]): a connection
    /// that sees it change reads its mailbox whatever its local runs covered.
    woke_all: AtomicU64,
    /// Where the subscribers report whether they are subscribed ([`WakeHub::report_to`]),
    /// so `/healthz` names one that has not been for a while (ADR-0126).
    health: OnceLock<Arc<HealthBoard>>,
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
            list.retain(|w| w.id != self.id);
            if list.is_empty() {
                users.remove(&self.user);
            }
        }
    }
}

impl WakeHub {
    /// Has this hub's subscribers ([`run_subscriber`]) report on `board` whether they are
    /// subscribed: one that has not been for [`crate::health::WAKE_DOWN_AFTER`] is a
    /// `/healthz` problem (ADR-0126). The first board given is kept.
    pub(crate) fn report_to(&self, board: Arc<HealthBoard>) {
        let _ = self.health.set(board);
    }

    /// Tells the board, if any, that the subscriber of `instance` is not subscribed (`why`).
    fn unsubscribed(&self, instance: &str, why: &str) {
        if let Some(b) = self.health.get() {
            b.wake_unsubscribed(instance, why);
        }
    }

    /// Tells the board, if any, that the subscriber of `instance` is subscribed.
    fn subscribed(&self, instance: &str) {
        if let Some(b) = self.health.get() {
            b.wake_subscribed(instance);
        }
    }

    /// Registers `notify` to be woken by hints naming `user`, whose mailbox is on `shard`.
    #[cfg(test)]
    pub(crate) fn register(
        self: &Arc<Self>,
        user: &str,
        shard: u32,
        notify: Arc<Notify>,
    ) -> Registration {
        // no delivery loop behind it reports progress: always caught up for the sweep
        let progress = Progress::default();
        progress.seen.store(u64::MAX, Ordering::Relaxed);
        self.add(user, shard, notify, None, progress)
    }

    /// Registers `notify` to be woken by hints naming `user`, whose mailbox is on `shard` (as
    /// the tests' `register` does), and the connection is also handed the fresh entries of its
    /// user that this process's materializer writes (ADR-0041), up to `budget` bytes of
    /// frames waiting for it (ADR-0111; beyond, a run is dropped and the connection reads).
    pub(crate) fn register_local(
        self: &Arc<Self>,
        user: &str,
        shard: u32,
        notify: Arc<Notify>,
        budget: usize,
    ) -> (Registration, LocalRuns) {
        let (tx, rx) = mpsc::channel(LOCAL_QUEUE);
        let lost = Arc::new(AtomicBool::new(false));
        let queued = Arc::new(AtomicUsize::new(0));
        let local = LocalTx {
            tx,
            lost: lost.clone(),
            queued: queued.clone(),
            budget,
        };
        let progress = Progress::default();
        (
            self.add(user, shard, notify, Some(local), progress.clone()),
            LocalRuns {
                rx,
                lost,
                progress,
                queued,
            },
        )
    }

    fn add(
        self: &Arc<Self>,
        user: &str,
        shard: u32,
        notify: Arc<Notify>,
        local: Option<LocalTx>,
        progress: Progress,
    ) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.users
            .lock()
            .expect("wake hub lock")
            .entry(user.to_string())
            .or_default()
            .push(Waiter {
                id,
                shard,
                notify,
                local,
                progress,
                owed: 0,
                owed_swept: 0,
                owed_at_sweep: false,
            });
        Registration {
            hub: Arc::clone(self),
            user: user.to_string(),
            id,
        }
    }

    /// Hands a run of applied hot-path records of `shard` (contiguous: W went from the first
    /// one's `prev` to the last one's offset) to the local connections of their recipients.
    /// A connection whose queue is full loses the run: its `lost` flag is set and it is
    /// woken, so it reads its mailbox.
    fn deliver_local(&self, shard: u32, items: &[SingleItem]) {
        let (Some(first), Some(last)) = (items.first(), items.last()) else {
            return;
        };
        let (from, to) = (first.prev, last.offset);
        let chain_from = {
            let mut chains = self.chains.lock().expect("wake hub lock");
            let c = chains.entry(shard).or_insert((from, from));
            if c.1 != from {
                *c = (from, from); // a move this hub was not handed: a new chain
            }
            c.1 = to;
            c.0
        };
        // per connection (registration id): its queue, its notifier, its entries
        let mut runs: Vec<(u64, LocalTx, Arc<Notify>, Vec<LocalEntry>)> = Vec::new();
        {
            let users = self.users.lock().expect("wake hub lock");
            for item in items {
                // decoded and serialised once per entry (not per recipient or connection), as a
                // reader would decode it; one that does not decode makes its connections read
                // (their own decoding reports it)
                let mut entry: Option<Option<LocalEntry>> = None;
                for recipient in &item.recipients {
                    let Some(list) = users.get(recipient.as_str()) else {
                        continue;
                    };
                    let mut local = list
                        .iter()
                        .filter(|w| w.shard == shard)
                        .filter_map(|w| w.local.as_ref().map(|l| (w, l)))
                        .peekable();
                    if local.peek().is_none() {
                        continue;
                    }
                    let entry =
                        entry.get_or_insert_with(|| LocalEntry::decode(&item.entry, item.offset));
                    for (w, l) in local {
                        let at = match runs.iter().position(|r| r.0 == w.id) {
                            Some(i) => i,
                            None => {
                                runs.push((w.id, l.clone(), w.notify.clone(), Vec::new()));
                                runs.len() - 1
                            }
                        };
                        match entry {
                            // a recipient named twice in a record gets its entry once
                            Some(e) if runs[at].3.last().is_some_and(|x| x.seq == e.seq) => {}
                            Some(e) => runs[at].3.push(e.clone()),
                            None => runs[at].1.lost.store(true, Ordering::Release),
                        }
                    }
                }
            }
        }
        for (_, local, notify, entries) in runs {
            if local.lost.load(Ordering::Acquire) {
                notify.notify_one();
                continue;
            }
            let bytes = entries.iter().map(|e| e.frame.len()).sum();
            let run = LocalRun {
                chain_from,
                to,
                entries,
                bytes,
            };
            // Counted before it is sent: the connection may take it (and subtract) at once.
            // A run that would take the queue past its budget is dropped as one that does
            // not fit its slots is (ADR-0111: before, 64 runs of up to 128 entries each
            // could wait for a connection that stopped reading, hundreds of MiB).
            let before = local.queued.fetch_add(bytes, Ordering::AcqRel);
            let fits = before == 0 || before + bytes <= local.budget;
            if !fits || local.tx.try_send(run).is_err() {
                local.queued.fetch_sub(bytes, Ordering::AcqRel);
                local.lost.store(true, Ordering::Release);
                metrics::counter!("tidemark_local_runs_dropped_total").increment(1);
                notify.notify_one();
            }
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
    ///
    /// A hint in sequence whose moves this hub handed out whole as local runs (an unbroken
    /// chain from at or below the W hinted before to at or past this one's) wakes only the
    /// connections that take no runs (ADR-0047): the others were handed every entry it
    /// announces before it was published, or flagged lost and woken then.
    pub(crate) fn wake(&self, shard: Option<u32>, hint: &WakeHint) -> usize {
        let mut whole_shard = None;
        let mut handed = false;
        if let Some(shard) = shard {
            let chain = self.chain(shard);
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
                    handed = in_sequence && e.last.is_some() && hands(chain, e.min_w, hint.min_w);
                    if e.epoch.is_some_and(|ep| ep != q.epoch) {
                        // a new owner or a re-fence (W may have gone back): start over, also
                        // when a resubscription forgot the last hint (ADR-0100: a mailbox
                        // failover cuts the subscription as it loses W)
                        e.min_w = hint.min_w;
                    } else {
                        e.min_w = e.min_w.max(hint.min_w);
                    }
                    e.last = Some(q);
                    e.epoch = Some(q.epoch);
                    e.since_sweep = true;
                }
                None => e.min_w = e.min_w.max(hint.min_w),
            }
        }
        let mut users = self.users.lock().expect("wake hub lock");
        let mut woken = 0;
        if let Some(s) = whole_shard {
            // a re-check of the whole shard, maybe in another epoch (W may have gone back):
            // what each connection is owed starts again from this hint
            woken += wake_where(&mut users, |shard| shard == s, Some(hint.min_w));
        }
        for user in &hint.recipients {
            if let Some(list) = users.get_mut(user.as_str()) {
                for w in list.iter_mut() {
                    // on the hinted shard only: a hint names the recipients of one shard
                    if shard.is_some_and(|s| s == w.shard) {
                        w.owed = w.owed.max(hint.min_w);
                    }
                    if !(handed && w.local.is_some()) {
                        w.notify.notify_one();
                        woken += 1;
                    }
                }
            }
        }
        woken
    }

    /// The shard's unbroken chain of local runs handed out: (W where it starts, W where it
    /// ends).
    fn chain(&self, shard: u32) -> Option<(u64, u64)> {
        self.chains
            .lock()
            .expect("wake hub lock")
            .get(&shard)
            .copied()
    }

    /// How many times every connection was woken so far.
    pub(crate) fn woke_all_times(&self) -> u64 {
        self.woke_all.load(Ordering::Acquire)
    }

    /// The highest lowest-present-W hinted for `shard` (0 before any hint).
    pub(crate) fn hinted_w(&self, shard: u32) -> u64 {
        let h = self.hinted.lock().expect("wake hub lock");
        h.get(&shard).map_or(0, |e| e.min_w)
    }

    /// After the subscriber of the mailbox instance holding `shards` (re)connects (hints
    /// published meanwhile are lost): wakes every connection of those shards, each to read
    /// past the hinted W (the count every connection looks at moves), and forgets those
    /// shards' sequences (the next hint starts each again).
    ///
    /// Only those shards': forgetting another instance's sequences too (as every one was
    /// before) let a hint of that instance that skipped a number, first after the reset, pass
    /// as in sequence, and a move whose recipients nobody knew went unannounced (ADR-0067).
    pub(crate) fn resubscribed(&self, shards: &[u32]) {
        // ascending (the instance's shards): looked up by binary search
        let shards = |s: &u32| shards.binary_search(s).is_ok();
        self.woke_all.fetch_add(1, Ordering::AcqRel);
        for (_, e) in self
            .hinted
            .lock()
            .expect("wake hub lock")
            .iter_mut()
            .filter(|(s, _)| shards(s))
        {
            e.last = None;
        }
        let mut users = self.users.lock().expect("wake hub lock");
        for w in users.values_mut().flatten() {
            if shards(&w.shard) {
                w.owed_at_sweep = true;
            }
        }
        wake_where(&mut users, |s| shards(&s), None);
    }

    /// A sweep read `shard`'s lowest present W (`min_w`) and whether its watermark changed
    /// since the previous sweep: wakes every connection of the shard when the hints may have
    /// missed a move, and (ADR-0067) every connection of the shard still below what it was
    /// owed at the previous sweep, flagged to read in full. Returns how many were woken.
    fn swept(&self, shard: u32, min_w: u64, changed: bool) -> usize {
        // Moves up to the end of an unbroken chain of local runs that starts at or below the
        // hinted W were handed to this gateway's connections (ADR-0041): their hint may still
        // be waiting for the materializer's flush (ADR-0047), which is not a missed one.
        let chain = self.chain(shard);
        let missed = {
            let mut h = self.hinted.lock().expect("wake hub lock");
            let e = h.entry(shard).or_default();
            let handed = hands(chain, e.min_w, min_w);
            let missed = (min_w > e.min_w && !handed) || (changed && !e.since_sweep);
            e.min_w = e.min_w.max(min_w);
            e.since_sweep = false;
            missed
        };
        let mut users = self.users.lock().expect("wake hub lock");
        let mut woken = 0;
        if missed {
            metrics::counter!("tidemark_wake_sweep_wakes_total").increment(1);
            woken += wake_where(&mut users, |s| s == shard, Some(min_w));
        }
        for w in users.values_mut().flatten().filter(|w| w.shard == shard) {
            if std::mem::take(&mut w.owed_at_sweep) {
                w.owed = w.owed.max(min_w);
            }
            // told to catch up to `owed_swept` a whole sweep ago and still below it: a wake
            // given but not acted on (ADR-0067), whatever lost it
            let seen = w.progress.seen.load(Ordering::Acquire);
            if w.owed_swept > seen {
                w.progress.recheck.store(true, Ordering::Release);
                metrics::counter!("tidemark_wake_sweep_rechecks_total").increment(1);
                if !missed {
                    w.notify.notify_one();
                    woken += 1;
                }
            }
            w.owed_swept = w.owed;
        }
        woken
    }

    /// Whether any connection waits on `shard`.
    fn watched(&self, shard: u32) -> bool {
        let users = self.users.lock().expect("wake hub lock");
        users.values().flatten().any(|w| w.shard == shard)
    }
}

/// Whether `chain` (a shard's unbroken chain of local runs) handed out every move from the W
/// hinted before (`hinted`) up to `w` (ADR-0047).
fn hands(chain: Option<(u64, u64)>, hinted: u64, w: u64) -> bool {
    chain.is_some_and(|(from, to)| from <= hinted && w <= to)
}

/// Wakes every registered connection whose shard passes `pick`, owed `owed` from now on when
/// given (the W the wake is for). Returns how many.
fn wake_where(
    users: &mut HashMap<String, Waiters>,
    pick: impl Fn(u32) -> bool,
    owed: Option<u64>,
) -> usize {
    let mut woken = 0;
    for w in users.values_mut().flatten() {
        if pick(w.shard) {
            if let Some(o) = owed {
                w.owed = o;
            }
            w.notify.notify_one();
            woken += 1;
        }
    }
    woken
}

/// Subscribes to `wake:*` on the mailbox instance `url` until `cancel`, reconnecting on
/// failure; sweeps the watermarks of `owned` (the shards of this instance) every
/// [`SWEEP_EVERY`]. Whether it is subscribed goes to the hub's health board, if any
/// ([`WakeHub::report_to`]): from its start until its first subscription, and from each
/// failure until the next, it is not (ADR-0126).
pub(crate) async fn run_subscriber(
    hub: Arc<WakeHub>,
    url: String,
    shards: std::ops::Range<u32>,
    sweep: Sweep,
    cancel: CancellationToken,
) {
    let shown = tidemark_store::redact_url(&url);
    let mut sweep = sweep;
    hub.unsubscribed(&shown, "not subscribed yet");
    loop {
        let res = tokio::select! {
            _ = cancel.cancelled() => break,
            r = subscribe_once(&hub, &url, &shown, shards.clone(), &mut sweep, &cancel) => r,
        };
        if cancel.is_cancelled() {
            break;
        }
        match res {
            Ok(()) => {
                hub.unsubscribed(&shown, "the subscription ended");
                tracing::warn!(url = %shown, "wake subscription ended; reconnecting")
            }
            Err(e) => {
                hub.unsubscribed(&shown, &e.to_string());
                tracing::warn!(url = %shown, error = %e, "wake subscription failed; reconnecting")
            }
        }
        metrics::counter!("tidemark_wake_reconnects_total").increment(1);
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = tokio::time::sleep(RECONNECT_AFTER) => {}
        }
    }
    // stopped on purpose: nothing to report
    hub.subscribed(&shown);
}

/// The slow safety sweep of one mailbox instance: its shards and their watermarks as last
/// read.
pub(crate) struct Sweep {
    store: MailboxStore,
    /// The instance's shards, ascending: also those whose hint sequences a resubscription
    /// forgets ([`WakeHub::resubscribed`]).
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
    /// A shard whose watermark cannot be read (corrupt, missing) is skipped and counted
    /// (`tidemark_wake_sweep_errors_total`): the shards after it are still swept. (Before,
    /// the first such shard ended the sweep, so while it stayed broken every shard after it
    /// on the instance was never swept again, and a lost last hint there was never found.)
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
            let wm = match wm {
                Ok(wm) => wm,
                Err(e) => {
                    metrics::counter!("tidemark_wake_sweep_errors_total").increment(1);
                    tracing::debug!(shard = self.shards[i], error = %e, "wake sweep skipped a shard");
                    continue;
                }
            };
            let min_w = wm.lanes.min_present_w().unwrap_or(0);
            let changed = self.seen[i].as_ref().is_some_and(|old| *old != wm);
            self.seen[i] = Some(wm);
            hub.swept(self.shards[i], min_w, changed);
        }
        Ok(())
    }
}

/// One subscription, until it fails or ends; `shown`: `url` without its password.
async fn subscribe_once(
    hub: &WakeHub,
    url: &str,
    shown: &str,
    shards: std::ops::Range<u32>,
    sweep: &mut Sweep,
    cancel: &CancellationToken,
) -> Result<(), SubscribeError> {
    let within = subscribe_within(url);
    let mut sub = tokio::time::timeout(within, WakeSubscriber::connect(url, shards.clone()))
        .await
        .map_err(|_| SubscribeError::TimedOut(within))??;
    tracing::debug!(url = %shown, "wake subscription up");
    hub.subscribed(shown);
    // Anything published while we were away is lost: let every connection of the instance's
    // shards re-read once. Only this instance's (the sweep's): before, every subscriber
    // forgot every shard's place in its hint sequence, so a number another instance's hint
    // skipped could go unseen (ADR-0098).
    hub.resubscribed(&sweep.shards);
    let mut tick = tokio::time::interval(sweep.every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            msg = sub.next() => {
                let Some(msg) = msg? else { return Ok(()) };
                crate::telemetry::hot().wake_hints.increment(1);
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
    use tidemark_protocol::entry::decode_entry;
    use tidemark_protocol::ServerFrame;

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

    fn item(prev: u64, offset: u64, to: &str) -> SingleItem {
        SingleItem {
            offset,
            prev,
            recipients: vec![to.into()],
            entry: tidemark_protocol::entry::encode_entry(offset, 7, "alice", "hi"),
        }
    }

    /// alice's connection and bob's two, all on shard 3, taking local runs; the
    /// registrations must be kept (dropping one unregisters it).
    fn alice_and_two_bobs(hub: &Arc<WakeHub>) -> ([Registration; 3], [LocalRuns; 3]) {
        let n = || Arc::new(Notify::new());
        let (ra, la) = hub.register_local("alice", 3, n(), BUDGET);
        let (rb, lb) = hub.register_local("bob", 3, n(), BUDGET);
        let (rb2, lb2) = hub.register_local("bob", 3, n(), BUDGET);
        ([ra, rb, rb2], [la, lb, lb2])
    }

    /// A connection's budget of queued local runs in these tests (a gateway's default
    /// `max_queued_bytes`).
    const BUDGET: usize = 64 * 1024;

    /// A hub and the materializer's handle on it, as one process wires them (ADR-0041).
    fn local_hub() -> (Arc<WakeHub>, LocalDelivery) {
        let hub = Arc::new(WakeHub::default());
        (hub.clone(), LocalDelivery { hub })
    }

    /// ADR-0041: a run goes to the local connections of its recipients on its shard, with
    /// the start of its shard's unbroken chain; a run whose start is not the last one's end
    /// starts a new chain; a run that does not fit in a connection's queue is dropped, flags
    /// the connection and wakes it.
    #[tokio::test]
    async fn local_runs_carry_their_chain_and_a_full_queue_flags_the_connection() {
        let (hub, local) = local_hub();
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (_ra, mut la) = hub.register_local("alice", 3, a.clone(), BUDGET);
        let (_rb, mut lb) = hub.register_local("bob", 3, b.clone(), BUDGET);
        // bob's mailbox on another shard would not be handed shard 3's entries
        let (_rc, mut lc) = hub.register_local("bob", 4, Arc::new(Notify::new()), BUDGET);
        local.deliver(3, &[item(10, 11, "alice"), item(11, 12, "bob")]);
        let r = la.rx.try_recv().unwrap();
        assert_eq!((r.chain_from, r.to), (10, 12));
        assert_eq!(r.entries.iter().map(|e| e.seq).collect::<Vec<_>>(), [11]);
        assert_eq!(lb.rx.try_recv().unwrap().entries[0].seq, 12);
        assert!(lc.rx.try_recv().is_err());
        // the chain goes on; only alice is named
        local.deliver(3, &[item(12, 13, "alice")]);
        assert_eq!(la.rx.try_recv().unwrap().chain_from, 10);
        assert!(lb.rx.try_recv().is_err());
        // W moved without a run (the chunked path): a new chain
        local.deliver(3, &[item(20, 21, "alice")]);
        assert_eq!(la.rx.try_recv().unwrap().chain_from, 20);
        // bob stops taking runs: once his queue is full, the next is dropped and flags him
        for i in 0..LOCAL_QUEUE as u64 {
            local.deliver(3, &[item(21 + i, 22 + i, "bob")]);
        }
        assert!(!lb.lost.load(Ordering::Acquire));
        assert!(!woken(&b).await);
        local.deliver(
            3,
            &[item(
                21 + LOCAL_QUEUE as u64,
                22 + LOCAL_QUEUE as u64,
                "bob",
            )],
        );
        assert!(lb.lost.load(Ordering::Acquire));
        assert!(woken(&b).await);
        assert!(!woken(&a).await);
    }

    /// ADR-0111: the runs waiting for a connection are bounded in bytes, not only in number:
    /// bob stops taking them, and once the frames queued for him reach his budget the next
    /// run is dropped, flags him and wakes him (he reads his mailbox, which pages in bytes).
    /// Taking a run frees its bytes. Before, 64 runs were queued whatever their size: with
    /// 16 KiB bodies and 128 entries a run, over 100 MiB for one connection that stopped
    /// reading.
    #[tokio::test]
    async fn the_runs_waiting_for_a_connection_are_bounded_in_bytes() {
        let (hub, local) = local_hub();
        let b = Arc::new(Notify::new());
        let (_rb, mut lb) = hub.register_local("bob", 3, b.clone(), 10_000);
        let big = |prev: u64, offset: u64| SingleItem {
            offset,
            prev,
            recipients: vec!["bob".into()],
            entry: tidemark_protocol::entry::encode_entry(offset, 7, "alice", &"x".repeat(4000)),
        };
        // a run bigger than the whole budget still goes to an empty queue
        local.deliver(3, &[big(10, 11), big(11, 12), big(12, 13)]);
        assert!(!lb.lost.load(Ordering::Acquire));
        let first = lb.try_recv().expect("one run fits an empty queue");
        assert_eq!(first.entries.len(), 3);
        assert!(first.bytes > 10_000, "{}", first.bytes);
        // two of one entry fit, the third would pass the budget
        local.deliver(3, &[big(13, 14)]);
        local.deliver(3, &[big(14, 15)]);
        assert!(!lb.lost.load(Ordering::Acquire));
        assert!(!woken(&b).await);
        local.deliver(3, &[big(15, 16)]);
        assert!(lb.lost.load(Ordering::Acquire), "the third run was dropped");
        assert!(woken(&b).await);
        assert_eq!(lb.try_recv().map(|r| r.to), Some(14));
        assert_eq!(lb.try_recv().map(|r| r.to), Some(15));
        assert!(lb.try_recv().is_none());
        // taken: the budget is free again
        lb.lost.store(false, Ordering::Release);
        local.deliver(3, &[big(16, 17)]);
        local.deliver(3, &[big(17, 18)]);
        assert!(!lb.lost.load(Ordering::Acquire));
    }

    /// ADR-0048: a record of several recipients is handed to each recipient's connections,
    /// decoded once, and to a connection once however its user is named.
    #[tokio::test]
    async fn a_run_of_many_recipients_goes_to_each_of_their_connections() {
        let (hub, local) = local_hub();
        let (_regs, [mut la, mut lb, mut lb2]) = alice_and_two_bobs(&hub);
        let (_rc, mut lc) = hub.register_local("carol", 3, Arc::new(Notify::new()), BUDGET);
        let mut to_three = item(10, 11, "alice");
        to_three.recipients = vec!["alice".into(), "bob".into(), "dave".into()];
        let mut twice = item(11, 12, "bob");
        twice.recipients = vec!["bob".into(), "bob".into()];
        local.deliver(3, &[to_three, twice, item(12, 13, "carol")]);
        let seqs = |r: LocalRun| -> (u64, u64, Vec<u64>) {
            (
                r.chain_from,
                r.to,
                r.entries.iter().map(|e| e.seq).collect(),
            )
        };
        assert_eq!(seqs(la.rx.try_recv().unwrap()), (10, 13, vec![11]));
        assert_eq!(seqs(lb.rx.try_recv().unwrap()), (10, 13, vec![11, 12]));
        assert_eq!(seqs(lb2.rx.try_recv().unwrap()), (10, 13, vec![11, 12]));
        assert_eq!(seqs(lc.rx.try_recv().unwrap()), (10, 13, vec![13]));
        for rx in [&mut la, &mut lb, &mut lb2, &mut lc] {
            assert!(rx.rx.try_recv().is_err(), "one run per connection");
        }
    }

    /// An entry's `deliver` frame is serialised once: every connection it goes to (several
    /// recipients of one record, several connections of one user) holds the same bytes, and
    /// they are the frame a mailbox read of the entry gives.
    #[tokio::test]
    async fn an_entrys_frame_is_serialised_once_for_all_its_connections() {
        let (hub, local) = local_hub();
        let (_regs, [mut la, mut lb, mut lb2]) = alice_and_two_bobs(&hub);
        let mut both = item(10, 11, "alice");
        both.recipients = vec!["alice".into(), "bob".into()];
        let expected = ServerFrame::Deliver(decode_entry(&both.entry).unwrap()).to_json();
        local.deliver(3, &[both]);
        let frame = |l: &mut LocalRuns| {
            let mut run = l.rx.try_recv().unwrap();
            assert_eq!(run.entries.len(), 1);
            let e = run.entries.pop().unwrap();
            assert_eq!((e.seq, e.sent_at_us), (11, 7));
            e.frame
        };
        let (a, b, b2) = (frame(&mut la), frame(&mut lb), frame(&mut lb2));
        assert_eq!(a.as_str(), expected);
        assert_eq!(a.as_ptr(), b.as_ptr(), "one serialisation, shared");
        assert_eq!(a.as_ptr(), b2.as_ptr(), "one serialisation, shared");
    }

    /// A local entry decodes only as a mailbox read would: the entry of its own seq, with a
    /// UTF-8 sender and body; its frame is the mailbox read's frame of it.
    #[test]
    fn a_local_entry_decodes_as_a_read_would() {
        let bytes = tidemark_protocol::entry::encode_entry(11, 7, "alice", "h\"i\u{1}é");
        let e = LocalEntry::decode(&bytes, 11).expect("decodes");
        assert_eq!((e.seq, e.sent_at_us), (11, 7));
        assert_eq!(
            e.frame.as_str(),
            ServerFrame::Deliver(decode_entry(&bytes).unwrap()).to_json()
        );
        assert!(
            LocalEntry::decode(&bytes, 12).is_none(),
            "another seq's entry"
        );
        assert!(LocalEntry::decode(&bytes[..10], 11).is_none(), "truncated");
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() = 0xff;
        assert!(decode_entry(&bad).is_err());
        assert!(
            LocalEntry::decode(&bad, 11).is_none(),
            "a body that is not UTF-8"
        );
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
        hub.resubscribed(&(0..8).collect::<Vec<_>>());
        assert!(woken(&a).await && woken(&b).await && woken(&c).await);
        assert_eq!(hub.wake(Some(3), &hint(9, 40, 6, &["bob"])), 1);
        assert_eq!(hub.hinted_w(3), 6);
        assert!(woken(&b).await);
        // but only on the shards of the instance that resubscribed: shard 3's sequence is
        // kept when another instance's subscriber comes back, so a skipped number still shows
        hub.resubscribed(&(8..16).collect::<Vec<_>>());
        assert!(!woken(&a).await && !woken(&b).await && !woken(&c).await);
        assert_eq!(hub.wake(Some(3), &hint(9, 42, 7, &[])), 2, "41 was skipped");
    }

    /// ADR-0098: a wake subscriber that (re)subscribes to its mailbox instance forgets only
    /// that instance's shards' places in their hint sequences. Before, it was given every
    /// shard, so a subscriber coming back made the next hint of another instance's shard pass
    /// as in sequence even when it skipped a number (here 2): the shard's connections were not
    /// woken for a move nobody was told of.
    #[tokio::test]
    async fn a_subscriber_coming_back_keeps_the_other_instances_hint_sequences() {
        let redis = tidemark_redis_proc::RedisProcess::start().unwrap();
        let hub = Arc::new(WakeHub::default());
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        // alice on shard 1 (this instance's), bob on shard 5 (another instance's)
        let _ra = hub.register("alice", 1, a.clone());
        let _rb = hub.register("bob", 5, b.clone());
        assert_eq!(hub.wake(Some(1), &hint(1, 1, 10, &["alice"])), 1);
        assert_eq!(hub.wake(Some(5), &hint(1, 1, 10, &["bob"])), 1);
        assert!(woken(&a).await && woken(&b).await);
        let store = MailboxStore::connect(
            &redis.url(),
            tidemark_store::redis::watermark::Layout::PackedV2,
        )
        .await
        .unwrap();
        let sweep = Sweep::new(store, vec![0, 1, 2, 3], Duration::from_secs(60));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run_subscriber(
            hub.clone(),
            redis.url(),
            0..8,
            sweep,
            cancel.clone(),
        ));
        let t0 = std::time::Instant::now();
        while hub.woke_all.load(Ordering::Acquire) == 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "never subscribed");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // its own shards' connections re-read once; the other instance's are left alone
        assert!(woken(&a).await && !woken(&b).await);
        assert_eq!(
            hub.wake(Some(5), &hint(1, 3, 12, &[])),
            1,
            "shard 5 kept its place: number 2 was skipped, so its connections re-read"
        );
        assert_eq!(
            hub.wake(Some(1), &hint(1, 7, 12, &[])),
            0,
            "shard 1 starts over after the subscription: any next number is accepted"
        );
        cancel.cancel();
        task.await.unwrap();
    }

    /// ADR-0126: a subscriber that cannot subscribe (here: its Redis user may publish hints
    /// but not subscribe to the pattern; Redis 7 gives a new ACL user no channel at all) is
    /// reported on the health board once it has not been subscribed for
    /// [`crate::health::WAKE_DOWN_AFTER`], with the failure, and no longer once it has
    /// subscribed again. Before, it retried every 500 ms for ever and nothing reported it.
    #[tokio::test]
    async fn a_subscriber_that_cannot_subscribe_is_reported_until_it_does() {
        use crate::health::WAKE_DOWN_AFTER;
        let redis = tidemark_redis_proc::RedisProcess::start().unwrap();
        let client = redis::Client::open(redis.url()).unwrap();
        let mut admin = client.get_multiplexed_async_connection().await.unwrap();
        let acl = |rules: &'static [&'static str]| {
            let mut cmd = redis::cmd("ACL");
            cmd.arg("SETUSER").arg("default").arg(rules);
            cmd
        };
        // a PSUBSCRIBE pattern must be allowed literally: `wake:{*` lets PUBLISH through only
        let _: () = acl(&["resetchannels", "&wake:{*"])
            .query_async(&mut admin)
            .await
            .unwrap();
        let board = Arc::new(HealthBoard::default());
        let hub = Arc::new(WakeHub::default());
        hub.report_to(board.clone());
        let store = MailboxStore::connect(
            &redis.url(),
            tidemark_store::redis::watermark::Layout::PackedV2,
        )
        .await
        .unwrap();
        let sweep = Sweep::new(store, vec![0, 1], Duration::from_secs(60));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run_subscriber(
            hub.clone(),
            redis.url(),
            0..2,
            sweep,
            cancel.clone(),
        ));
        let t0 = std::time::Instant::now();
        let problem = loop {
            let p = board.problems(Duration::from_secs(60));
            if let Some(p) = p.into_iter().find(|p| p.starts_with("wake subscriber of ")) {
                break p;
            }
            assert!(
                t0.elapsed() < WAKE_DOWN_AFTER + Duration::from_secs(5),
                "a subscriber that cannot subscribe was never reported"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(
            t0.elapsed() >= WAKE_DOWN_AFTER,
            "reported at once: {problem}"
        );
        assert!(problem.contains("no permissions"), "{problem}");
        assert_eq!(hub.woke_all_times(), 0, "subscribed?");
        // allowed again: it subscribes, and is no longer reported
        let _: () = acl(&["allchannels"]).query_async(&mut admin).await.unwrap();
        let t1 = std::time::Instant::now();
        while hub.woke_all_times() == 0 || !board.problems(Duration::from_secs(60)).is_empty() {
            assert!(t1.elapsed() < Duration::from_secs(5), "never subscribed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        cancel.cancel();
        task.await.unwrap();
        assert!(board.problems(Duration::from_secs(60)).is_empty());
    }

    /// ADR-0100: a hint of another epoch lets the hinted W go back also right after a
    /// resubscription (a mailbox failover that loses W also cuts the subscription). Before,
    /// only a hint following one of the old epoch did, and the hub kept the old, higher W:
    /// hinted reads counted entries below it as read before they were re-materialised.
    #[tokio::test]
    async fn a_new_epoch_lowers_the_hinted_w_after_a_resubscription_too() {
        let hub = Arc::new(WakeHub::default());
        assert_eq!(hub.wake(Some(3), &hint(4, 9, 100, &[])), 0);
        assert_eq!(hub.hinted_w(3), 100);
        hub.resubscribed(&[3]);
        // the same epoch: W only rises
        hub.wake(Some(3), &hint(4, 10, 90, &[]));
        assert_eq!(hub.hinted_w(3), 100);
        hub.resubscribed(&[3]);
        // a re-fence after W went back to 60
        hub.wake(Some(3), &hint(5, 11, 60, &[]));
        assert_eq!(hub.hinted_w(3), 60, "the new epoch's W, though lower");
    }

    /// ADR-0067: a connection told by a hint to catch up to W that is still below it at the
    /// sweep after next (a whole sweep later) is woken and flagged to read in full; one that
    /// caught up, or was never told (its user had no entries), is left alone.
    #[tokio::test]
    async fn the_sweep_wakes_a_connection_still_below_what_a_hint_told_it() {
        let hub = Arc::new(WakeHub::default());
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (_ra, la) = hub.register_local("alice", 3, a.clone(), BUDGET);
        let (_rb, lb) = hub.register_local("bob", 3, b.clone(), BUDGET);
        // in sequence, names alice only: alice is owed 10
        assert_eq!(hub.wake(Some(3), &hint(1, 1, 10, &["alice"])), 1);
        assert!(woken(&a).await && !woken(&b).await);
        // the first sweep after it: alice may still be reading
        assert_eq!(hub.swept(3, 10, false), 0);
        // a whole sweep later alice has not caught up (the wake was lost on its way): woken,
        // to read in full; bob, never told, is not
        assert_eq!(hub.swept(3, 10, false), 1);
        assert!(woken(&a).await && !woken(&b).await);
        assert!(la.progress.recheck.load(Ordering::Acquire));
        assert!(!lb.progress.recheck.load(Ordering::Acquire));
        // and again at every sweep until it has
        assert_eq!(hub.swept(3, 10, false), 1);
        assert!(woken(&a).await);
        la.progress.seen.store(10, Ordering::Release);
        la.progress.recheck.store(false, Ordering::Release);
        assert_eq!(hub.swept(3, 10, false), 0);
        assert!(!woken(&a).await && !la.progress.recheck.load(Ordering::Acquire));
        // a hint handed to alice as local runs (ADR-0047) does not wake her, but she is
        // owed it all the same: runs that never arrived are found too
        let items = [item(10, 11, "alice")];
        LocalDelivery { hub: hub.clone() }.deliver(3, &items);
        assert_eq!(hub.wake(Some(3), &hint(1, 2, 11, &["alice"])), 0);
        assert_eq!(hub.swept(3, 11, false), 0);
        assert_eq!(hub.swept(3, 11, false), 1);
        assert!(woken(&a).await && la.progress.recheck.load(Ordering::Acquire));
        // a whole-shard re-check (a new epoch, W went back to 5) owes every connection the
        // new W, never the old one
        assert_eq!(hub.wake(Some(3), &hint(2, 0, 5, &[])), 2);
        la.progress.seen.store(5, Ordering::Release);
        lb.progress.seen.store(5, Ordering::Release);
        assert_eq!(
            hub.swept(3, 5, true),
            1,
            "the last sweep's owed 11: alice once more"
        );
        assert_eq!(hub.swept(3, 5, false), 0);
    }

    /// ADR-0067: a resubscription wakes every connection at no known W; the next sweep owes
    /// each the W it reads, and the sweep after that flags those still below it.
    #[tokio::test]
    async fn after_a_resubscription_the_sweep_owes_every_connection_the_w_it_reads() {
        let hub = Arc::new(WakeHub::default());
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (_ra, la) = hub.register_local("alice", 3, a.clone(), BUDGET);
        let (_rb, lb) = hub.register_local("bob", 3, b.clone(), BUDGET);
        assert_eq!(hub.wake(Some(3), &hint(1, 1, 10, &[])), 0);
        hub.resubscribed(&(0..8).collect::<Vec<_>>());
        assert!(woken(&a).await && woken(&b).await);
        // the first hint of the new subscription shows no gap and names no one: W 12
        assert_eq!(hub.wake(Some(3), &hint(1, 5, 12, &[])), 0);
        // alice read to W; bob's read stopped at the hinted 10 (what ADR-0067's fix mends)
        la.progress.seen.store(12, Ordering::Release);
        lb.progress.seen.store(10, Ordering::Release);
        // nothing the old sweep can see (W is what was hinted); both are owed 12 from now
        assert_eq!(hub.swept(3, 12, false), 0);
        // a whole sweep later bob is still below: flagged and woken, alice not
        assert_eq!(hub.swept(3, 12, false), 1);
        assert!(!woken(&a).await && woken(&b).await);
        assert!(lb.progress.recheck.load(Ordering::Acquire));
        assert!(!la.progress.recheck.load(Ordering::Acquire));
        // caught up: left alone
        lb.progress.seen.store(12, Ordering::Release);
        lb.progress.recheck.store(false, Ordering::Release);
        assert_eq!(hub.swept(3, 12, false), 0);
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

    #[tokio::test]
    async fn a_hint_of_moves_handed_as_runs_wakes_only_connections_without_runs() {
        // ADR-0047: such a hint may come late (the materializer's flush); the connections
        // that take runs were handed its entries already
        let (hub, local) = local_hub();
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (_ra, mut la) = hub.register_local("alice", 3, a.clone(), BUDGET);
        // alice's delivery loop takes every run (the sweep's own check of that, ADR-0067, is
        // tested above)
        la.progress.seen.store(u64::MAX, Ordering::Release);
        // bob's connection takes no runs: hints are its only wake
        let _rb = hub.register("bob", 3, b.clone());
        hub.wake(Some(3), &hint(1, 1, 10, &[]));
        local.deliver(3, &[item(10, 11, "alice"), item(11, 12, "bob")]);
        local.deliver(3, &[item(12, 13, "alice")]);
        assert_eq!(la.rx.try_recv().unwrap().to, 12);
        assert_eq!(la.rx.try_recv().unwrap().to, 13);
        // the flush: one hint for both runs, in sequence, W inside the chain
        assert_eq!(hub.wake(Some(3), &hint(1, 2, 13, &["alice", "bob"])), 1);
        assert!(woken(&b).await && !woken(&a).await);
        assert_eq!(hub.hinted_w(3), 13);
        // nor does the sweep count those moves as missed
        assert_eq!(hub.swept(3, 13, false), 0);
        // a move not handed here (the chunked path), then a run: the chain restarts above
        // the hinted W, so the next hint wakes everyone it names, and the sweep too
        local.deliver(3, &[item(15, 16, "alice")]);
        assert_eq!(hub.wake(Some(3), &hint(1, 3, 16, &["alice", "bob"])), 2);
        assert!(woken(&a).await && woken(&b).await);
        local.deliver(3, &[item(16, 17, "alice"), item(17, 18, "alice")]);
        assert_eq!(hub.swept(3, 18, false), 0, "hinted 16, chain from 15 to 18");
        local.deliver(3, &[item(20, 21, "alice")]);
        assert_eq!(hub.swept(3, 21, false), 2, "18..20 was not handed here");
        // a hint out of sequence is never taken as handed (the whole shard, then alice)
        assert_eq!(hub.wake(Some(3), &hint(1, 9, 21, &["alice"])), 3);
    }
}
