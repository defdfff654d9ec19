//! The worker: one per core instance, owning this process's shards of it. Claims them,
//! reads their logs with `XREAD BLOCK` (or, in feed mode, takes the records this process's
//! gateway committed and polls the logs: `feed.rs`, ADR-0049), hands each batch to the hot
//! and chunked paths, keeps the owner marks, and replaces a failed log connection.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tidemark_store::redis::dlog::{DispatchRecord, LogReader, LogStore, ReplicaWait};
use tidemark_store::redis::store::{Fence, MailboxStore};
use tidemark_store::redis::watermark::Layout;
use tidemark_store::topology::ShardMap;
use tokio_util::sync::CancellationToken;

use super::feed::{FeedRead, FeedState};
use super::owned::OwnedShards;
use super::shard::{OwnedShard, StepScan};
use super::stall::{bounded, Stalls, MAILBOX_CALL_TIMEOUT};
use super::{
    Error, MaterializerOptions, GATE_RECHECK, OWNER_MARK_REFRESH, READ_GRACE, RETRY_MAX, RETRY_MIN,
};
use crate::health::{HealthBoard, ShardStatus};

/// One materializer worker: the owned shards of one core instance.
pub struct Worker {
    /// Routing (a record's recipients → lanes) and the shard → mailbox instance table.
    pub(super) map: ShardMap,
    pub(super) core: LogStore,
    pub(super) core_url: String,
    /// `core_url` without its password, for logs and `/healthz`.
    pub(super) core_shown: String,
    /// The log reader; `None` only while a read ahead has it.
    pub(super) reader: Option<LogReader>,
    /// The core replica wait the reader applies (ADR-0064), resolved once at the start and
    /// given to every replacement reader.
    pub(super) read_wait: Option<ReplicaWait>,
    /// A read issued while the last step was applied ([`Worker::take_ahead`]).
    pub(super) ahead: Option<Ahead>,
    pub(super) mailboxes: Vec<MailboxStore>,
    /// The state of every shard this worker owns (running or stopped), by shard.
    pub(super) owned: OwnedShards,
    pub(super) opts: MaterializerOptions,
    pub(super) health: Arc<HealthBoard>,
    /// Current delay before replacing a failed log connection (None: reads are healthy).
    pub(super) read_backoff: Option<Duration>,
    /// When the owner marks (`owner:{s}`) were last refreshed.
    pub(super) marks_at: Option<Instant>,
    /// When the health board was last told which shards the loop goes through.
    pub(super) served_at: Option<Instant>,
    /// Per mailbox instance: how its wake hints are paced (ADR-0047).
    pub(super) hint_pace: Vec<HintPace>,
    /// The records this process's gateway commits to these shards, and whether the loop
    /// takes them instead of reading the logs (ADR-0049).
    pub(super) feed: Option<FeedState>,
    /// Log trims that GC found due and has not sent yet, `(shard, upto)`, and when the first
    /// of them was found: sent together (ADR-0088), so that core Redis pays one `fdatasync`
    /// for many shards' trims, not one each.
    pub(super) trims: Vec<(u32, u64)>,
    pub(super) trims_since: Option<Instant>,
    /// Which mailbox instances answer (ADR-0129): every call of the loop to one is bounded,
    /// and one that did not answer in time is left alone for a while, so that it holds up
    /// only its own shards.
    pub(super) stalls: Stalls,
}

/// How one mailbox instance's wake hints are paced (ADR-0047). A hint that only announces
/// moves this process's connections were handed as local runs is needed by no one else
/// when no other gateway listens: it may wait, at most `hint_linger` after the first such
/// hint, and is merged meanwhile with the shard's later moves (one hint per shard at the
/// flush). It is never dropped: a gateway that subscribes meanwhile learns of every move
/// at the flush.
pub(super) struct HintPace {
    /// The last publish reached a subscriber besides this process's gateway (or none has
    /// been made yet): every hint goes out with its step.
    pub(super) others: bool,
    /// Since when a hint of this instance has been waiting for the flush; `None`: none.
    pub(super) waiting_since: Option<Instant>,
}

impl HintPace {
    fn new() -> HintPace {
        HintPace {
            others: true,
            waiting_since: None,
        }
    }
}

/// A read of the logs made while a step was applied: where each shard was read from, and
/// what came back.
pub(super) struct Ahead {
    from: BTreeMap<u32, u64>,
    batches: Vec<(u32, Vec<DispatchRecord>)>,
}

/// How often a worker tells the health board which shards its loop goes through.
const SERVED_EVERY: Duration = Duration::from_millis(250);

impl Worker {
    /// In leases mode, whether `s`'s lease gate is closed: the shard is not this node's to
    /// claim or write now (ADR-0030; ADR-0120 and ADR-0130 check it before their claims).
    fn gate_closed(&self, s: u32) -> bool {
        self.opts
            .lease_gate
            .as_ref()
            .is_some_and(|g| !g.may_write(s))
    }

    /// Connects to core instance `core` of `map` and to the mailbox instances (`mailboxes`,
    /// one per instance of the map), claims every shard in `shards` (all on that core
    /// instance), and resumes each from its lowest W.
    pub async fn start(
        map: ShardMap,
        core: usize,
        mailboxes: Vec<MailboxStore>,
        shards: &[u32],
        opts: MaterializerOptions,
        health: Arc<HealthBoard>,
    ) -> Result<Worker, Error> {
        Worker::start_after(map, core, mailboxes, shards, opts, health, &BTreeMap::new()).await
    }

    /// [`Worker::start`] for a worker started again in place of one that ended (a panic, an
    /// error) without a lease to say the shards are still its own (static ownership,
    /// ADR-0105): a shard whose stored epoch is still the one the ended worker held (`prior`)
    /// is claimed as a start claims it, by a compare-and-set from that epoch; one whose epoch
    /// moved on was claimed by another owner meanwhile, and is stopped as fenced instead of
    /// being taken back from it. Shards not in `prior` are claimed as by a start.
    pub async fn start_after(
        map: ShardMap,
        core: usize,
        mailboxes: Vec<MailboxStore>,
        shards: &[u32],
        opts: MaterializerOptions,
        health: Arc<HealthBoard>,
        prior: &BTreeMap<u32, u64>,
    ) -> Result<Worker, Error> {
        let core_url = map.core_urls()[core].as_str();
        debug_assert!(shards.iter().all(|&s| map.core_of(s) == core));
        let mut reader = LogReader::connect(core_url).await?;
        let core_shown = tidemark_store::redact_url(core_url);
        let core_url = core_url.to_string();
        let core = LogStore::connect(&core_url).await?;
        let read_wait = opts.core_wait.resolve(&mut core.connection()).await?;
        reader.set_replica_wait(read_wait);
        let mut mailboxes = mailboxes;
        for mb in &mut mailboxes {
            mb.set_replica_wait(&opts.mailbox_wait).await?;
        }
        // before the shards' W are read: from then on every commit of this process is handed
        // over (log mode reads what came before anyway)
        let needs = read_wait.map_or(0, |w| w.replicas);
        let feed = opts.feed.as_ref().map(|f| FeedState::new(f, shards, needs));
        let stalls = Stalls::new(&mailboxes, map.mailbox_urls());
        let mut w = Worker {
            map,
            core,
            core_url,
            core_shown,
            reader: Some(reader),
            read_wait,
            ahead: None,
            mailboxes,
            owned: OwnedShards::default(),
            opts,
            health,
            read_backoff: None,
            marks_at: None,
            served_at: None,
            hint_pace: Vec::new(),
            feed,
            trims: Vec::new(),
            trims_since: None,
            stalls,
        };
        w.hint_pace = w.mailboxes.iter().map(|_| HintPace::new()).collect();
        let mut corrupt = Vec::new();
        for &s in shards {
            let mb = w.map.mailbox_of(s);
            w.health.update(s, |h| h.status = ShardStatus::Starting);
            // ADR-0130: in leases mode a shard whose lease gate is closed is not this node's to
            // claim now (the lease lapsed, and another node may hold it and have claimed it: a
            // claim would fence that node). Owned unclaimed, as a shard whose instance did not
            // answer (ADR-0097): `resync` claims it once the gate is open, and the lease loop
            // stops this worker if the lease is lost. Before, a worker started again after a
            // panic, between the lease's lapse and the lease loop's next tick, claimed it.
            if w.gate_closed(s) {
                tracing::info!(
                    shard = s,
                    "shard not claimed at the start: its lease gate is closed"
                );
                w.own_unclaimed(
                    s,
                    mb,
                    "its lease is not this node's now; claimed once it is",
                );
                continue;
            }
            let store = &mut w.mailboxes[mb];
            // the claim and the read after it, bounded (ADR-0129): a hung instance costs the
            // start one short wait, not the connection's response timeout for each shard
            let claiming = async {
                let claim = match prior.get(&s).copied().filter(|&e| e > 0) {
                    Some(was) => claim_from(store, s, was).await,
                    None => store.claim(s).await.map(|epoch| Fence::Raised { epoch }),
                };
                match claim {
                    Ok(Fence::Raised { epoch }) => {
                        store.read_watermark(s).await.map(|wm| Ok((epoch, wm)))
                    }
                    Ok(Fence::Lost { current_epoch }) => Ok(Err(current_epoch)),
                    Err(e) => Err(e),
                }
            };
            let claimed = match w.stalls.within(mb, MAILBOX_CALL_TIMEOUT, claiming).await {
                Some(Ok(Err(current_epoch))) => {
                    // another owner claimed it since the ended worker held it (ADR-0105): not
                    // taken back
                    w.owned.insert(s, OwnedShard::stopped(s, mb));
                    w.stop(s, ShardStatus::Fenced { current_epoch });
                    continue;
                }
                Some(Ok(Ok(c))) => Ok(c),
                Some(Err(e)) => Err(e),
                None => {
                    // no answer in time: its outcome is unknown (ADR-0097's claim made twice
                    // at worst, the second fencing the first, which wrote nothing)
                    let why = w.stalls.error(mb).to_string();
                    tracing::warn!(shard = s, error = %why,
                        "shard not claimed at the start; claimed once its instance answers");
                    w.own_unclaimed(s, mb, &why);
                    continue;
                }
            };
            let store = &w.mailboxes[mb];
            let (epoch, wm) = match claimed {
                Ok(c) => c,
                // new code: only this shard stops (fail closed); the others run. Old
                // (packed-v1) code refuses the whole start before claiming (run::serve).
                Err(e) if e.is_corrupt() && store.layout() == Layout::PackedV2 => {
                    tracing::error!(shard = s, error = %e, "shard not claimed: corrupt watermark");
                    metrics::counter!("tidemark_shard_corrupt_total").increment(1);
                    w.owned.insert(s, OwnedShard::stopped(s, mb));
                    w.health
                        .update(s, |h| h.status = ShardStatus::Corrupt(e.to_string()));
                    corrupt.push(s);
                    continue;
                }
                // Not claimed, for any reason but corruption: the shard is owned unclaimed
                // (epoch 0), in retry, and `resync` claims it as a start does once its
                // watermark can be read. Failing the whole worker would stop every shard of
                // this core instance, and fail every start after it (the supervisor restarts it
                // into the same error). Two cases:
                // - ADR-0060: no watermark (the mailbox instance lost the shard: a promoted
                //   replica that never had it, a Redis restarted empty); `resync` creates it
                //   once it has been missing for WATERMARK_LOST_AFTER;
                // - ADR-0097: the instance did not answer (down, restarting, unreachable) or
                //   answered an error: the shards of the instances that answer run meanwhile.
                // A corrupt watermark is refused as before (packed-v1 code).
                Err(e) if !e.is_corrupt() => {
                    if e.code() == "no_watermark" {
                        tracing::warn!(shard = s, error = %e,
                            "no watermark at the claim; created again if it stays missing");
                    } else {
                        tracing::warn!(shard = s, error = %e,
                            "shard not claimed at the start; claimed once its instance answers");
                    }
                    w.own_unclaimed(s, mb, &e.to_string());
                    if e.code() == "no_watermark" {
                        w.shard_mut(s).missing_since = Some(Instant::now());
                    }
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let min_w = wm.lanes.min_present_w().unwrap_or(0);
            tracing::debug!(
                shard = s,
                epoch,
                min_w,
                uniform = wm.lanes.is_uniform(),
                "claimed shard"
            );
            w.owned.insert(
                s,
                OwnedShard {
                    shard: s,
                    mb,
                    epoch,
                    read_pos: min_w,
                    uniform: wm.lanes.is_uniform(),
                    pending: VecDeque::new(),
                    stopped: false,
                    retry: None,
                    held: None,
                    last_logged: None,
                    touched: BTreeSet::new(),
                    // the claim's hint (seq 0): gateways re-check the shard's connections, so
                    // a move the previous owner made but never hinted is not missed
                    moved: true,
                    hint_seq: 0,
                    unhanded: true,
                    quiet: false,
                    min_w,
                    last_gc: Instant::now() - Duration::from_secs(3600),
                    missing_since: None,
                    shown_w: None,
                    deferred: false,
                    held_since: None,
                    refencing: None,
                },
            );
            w.health.update(s, |h| {
                h.status = ShardStatus::Running;
                h.epoch = epoch;
                h.min_w = min_w;
                h.last_progress = Instant::now();
                h.served_at = Instant::now();
                h.retrying = None;
            });
        }
        let claimed: Vec<u32> = w
            .owned
            .values()
            .filter(|sh| !sh.stopped)
            .map(|sh| sh.shard)
            .collect();
        tracing::info!(
            core = %w.core_shown,
            shards = %tidemark_store::deployment::format_ranges(&claimed),
            corrupt = %tidemark_store::deployment::format_ranges(&corrupt),
            "claimed shards"
        );
        Ok(w)
    }

    /// Owns shard `s` (on mailbox instance `mb`) unclaimed: epoch 0, running, in retry for
    /// `why`; `resync` claims it once its watermark can be read and, in leases mode, its lease
    /// gate is open (ADR-0060, ADR-0097, ADR-0130). Its claim's hint (seq 0) goes out at once.
    fn own_unclaimed(&mut self, s: u32, mb: usize, why: &str) {
        let mut sh = OwnedShard::stopped(s, mb);
        sh.stopped = false;
        sh.moved = true;
        sh.unhanded = true;
        self.owned.insert(s, sh);
        self.health.update(s, |h| h.status = ShardStatus::Running);
        self.schedule_retry(s, why);
    }

    /// The shards this worker owns.
    pub fn shards(&self) -> Vec<u32> {
        self.owned.keys().copied().collect()
    }

    /// The core instance this worker reads.
    pub fn core_url(&self) -> &str {
        &self.core_url
    }

    /// The log read failed: report it on every shard, wait (capped backoff), replace the
    /// connection.
    pub(super) async fn log_read_failed(&mut self, e: &str, cancel: &CancellationToken) {
        let backoff = self
            .read_backoff
            .map_or(RETRY_MIN, |b| (b * 2).min(RETRY_MAX));
        self.read_backoff = Some(backoff);
        tracing::warn!(error = %e, core = %self.core_shown, ?backoff, "log read failed; retrying");
        metrics::counter!("tidemark_errors_total", "code" => "log_read").increment(1);
        let why = format!("reading the log on {}: {e}", self.core_shown);
        for s in self.shards() {
            self.health.set_retrying(s, &why);
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        match tokio::time::timeout(READ_GRACE, LogReader::connect(&self.core_url)).await {
            Ok(Ok(mut r)) => {
                r.set_replica_wait(self.read_wait);
                self.reader = Some(r);
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, core = %self.core_shown, "log reconnect failed")
            }
            Err(_) => tracing::warn!(core = %self.core_shown, "log reconnect timed out"),
        }
    }

    /// The log read succeeded after failures: clear what [`Self::log_read_failed`] reported.
    pub(super) fn log_read_ok(&mut self) {
        if self.read_backoff.take().is_none() {
            return;
        }
        tracing::info!(core = %self.core_shown, "log read resumed");
        for sh in self.owned.values() {
            if sh.retry.is_none() {
                self.health.update(sh.shard, |h| {
                    h.retrying = None;
                    h.last_progress = Instant::now();
                });
            }
        }
    }

    /// Runs until `cancel` fires. Redis failures never end it (shards retry, see the module
    /// documentation); it returns early only with the error of a bug (none today). On a clean
    /// stop the owner marks are removed, so offline tools see no live owner at once.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), Error> {
        let r = self.run_loop(&cancel).await;
        let _ = tokio::time::timeout(Duration::from_secs(1), self.clear_marks()).await;
        r
    }

    /// Refreshes `owner:{s}` (this owner's epoch, expiring after
    /// `tidemark_store::redis::store::OWNER_MARK_TTL_MS`) of every running shard, every
    /// [`OWNER_MARK_REFRESH`]: one pipeline per mailbox instance.
    pub(super) async fn refresh_marks(&mut self) {
        if self
            .marks_at
            .is_some_and(|t| t.elapsed() < OWNER_MARK_REFRESH)
        {
            return;
        }
        self.marks_at = Some(Instant::now());
        let mut marks: BTreeMap<usize, Vec<(u32, u64)>> = BTreeMap::new();
        for sh in self.owned.values().filter(|sh| !sh.stopped) {
            marks.entry(sh.mb).or_default().push((sh.shard, sh.epoch));
        }
        // each instance's bounded (ADR-0129): one that does not answer is skipped, and holds
        // up the others' shards at most one short wait
        for (mb, marks) in marks {
            let call = self.mailboxes[mb].refresh_owner_marks(&marks);
            match self.stalls.within(mb, MAILBOX_CALL_TIMEOUT, call).await {
                Some(Ok(())) => {}
                Some(Err(e)) => tracing::debug!(error = %e, "owner marks not refreshed"),
                None => tracing::debug!(mailbox = mb, "owner marks not refreshed: no answer"),
            }
        }
    }

    /// Shows on the health board the mailbox instances that stopped or started answering
    /// (ADR-0129): every running shard of one that stopped is reported retrying, and the
    /// report is taken back from those not in retry once it answers again (a shard in retry
    /// clears its own once its resync succeeds).
    fn show_stalls(&mut self) {
        for (mb, answers) in self.stalls.changes() {
            let why = self.stalls.error(mb).to_string();
            for sh in self.owned.values().filter(|sh| sh.mb == mb && !sh.stopped) {
                if !answers {
                    self.health.set_retrying(sh.shard, &why);
                } else if sh.retry.is_none() {
                    self.health.update(sh.shard, |h| h.retrying = None);
                }
            }
        }
    }

    /// Whether the health board is due to hear which shards the loop goes through (at most
    /// every [`SERVED_EVERY`]).
    fn served_due(&self, now: Instant) -> bool {
        self.served_at
            .is_none_or(|t| now.saturating_duration_since(t) >= SERVED_EVERY)
    }

    /// Tells the health board that the loop went through `shards` (read, or waiting for their
    /// retry) at `now`: a running shard it does not go through for long is reported (see
    /// [`crate::health::NOT_SERVED_AFTER`]). Called when [`Worker::served_due`] said so.
    fn mark_served(&mut self, now: Instant, shards: &[u32]) {
        self.served_at = Some(now);
        self.health.mark_served(shards);
    }

    /// Removes this owner's marks (only where they still hold its epoch); not on an instance
    /// that does not answer (ADR-0129: they expire there).
    pub(super) async fn clear_marks(&mut self) {
        let now = Instant::now();
        for sh in self.owned.values().filter(|sh| !sh.stopped) {
            if self.stalls.stalled(sh.mb, now) {
                continue;
            }
            let _ = self.mailboxes[sh.mb]
                .clear_owner_mark(sh.shard, sh.epoch)
                .await;
        }
    }

    pub(super) async fn run_loop(&mut self, cancel: &CancellationToken) -> Result<(), Error> {
        // When the last log read started, and whether it found a backlog (a log that filled
        // its COUNT): without one, the next read waits for `read_linger` after it (ADR-0042)
        let mut last_read: Option<Instant> = None;
        let mut backlog = true;
        loop {
            if cancel.is_cancelled() {
                return Ok(());
            }
            self.refresh_marks().await;
            self.show_stalls();
            // one pass over the owned shards (ADR-0077); the shards whose retry is due are
            // resynced first, and the pass is made again after them
            // (one clock read for the step's head, again only after resyncs)
            let mut now = Instant::now();
            let want_served = self.served_due(now);
            let mut scan = self.scan(now, want_served);
            if !scan.due.is_empty() {
                self.resync_due(std::mem::take(&mut scan.due)).await;
                now = Instant::now();
                scan = self.scan(now, want_served);
            }
            let StepScan {
                served,
                positions,
                gated,
                mut next_retry,
                any_pending,
                ..
            } = scan;
            if want_served {
                self.mark_served(now, &served);
            }
            // a closed lease gate opens again by itself (the next renewal): look again soon
            if gated {
                let soon = now + GATE_RECHECK;
                next_retry = Some(next_retry.map_or(soon, |d| d.min(soon)));
            }
            if positions.is_empty() {
                match next_retry {
                    // every shard stopped (fenced/corrupt): stay alive for /healthz
                    None => {
                        cancel.cancelled().await;
                        return Ok(());
                    }
                    Some(due) => {
                        tokio::select! {
                            _ = cancel.cancelled() => return Ok(()),
                            _ = tokio::time::sleep_until(due.into()) => {}
                        }
                        continue;
                    }
                }
            }
            // the read issued while the last step was applied, where it still fits
            let batches = match self.take_ahead(&positions) {
                Some(b) => b,
                None => {
                    if let Some(due) = self.linger_until(last_read, backlog) {
                        tokio::select! {
                            _ = cancel.cancelled() => return Ok(()),
                            _ = tokio::time::sleep_until(due.into()) => {}
                        }
                    }
                    last_read = Some(Instant::now());
                    let mut block = if any_pending {
                        Duration::from_millis(20)
                    } else {
                        self.opts.block
                    };
                    if let Some(due) = next_retry {
                        block = block.min(due.saturating_duration_since(Instant::now()));
                    }
                    // a hint waiting for its flush is published even if no record comes
                    if let Some(due) = self.hint_flush_due() {
                        block = block.min(due.saturating_duration_since(Instant::now()));
                    }
                    // XREAD BLOCK 0 would block for ever
                    let block = block.max(Duration::from_millis(1));
                    if self.feed_on() {
                        // ADR-0049: what this process committed, the log only polled
                        match self.feed_read(&positions, block, cancel).await {
                            FeedRead::Batches(b) => b,
                            FeedRead::Cancelled => return Ok(()),
                            FeedRead::Failed(e) => {
                                self.log_read_failed(&e, cancel).await;
                                continue;
                            }
                        }
                    } else {
                        let reader = self.reader.as_mut().expect("the reader is back");
                        let read = tokio::select! {
                            _ = cancel.cancelled() => return Ok(()),
                            r = tokio::time::timeout(
                                block + READ_GRACE,
                                reader.read(&positions, self.opts.batch, block),
                            ) => r,
                        };
                        match read {
                            Ok(Ok(b)) => b,
                            Ok(Err(e)) => {
                                self.log_read_failed(&e.to_string(), cancel).await;
                                continue;
                            }
                            Err(_) => {
                                self.log_read_failed("XREAD timed out", cancel).await;
                                continue;
                            }
                        }
                    }
                }
            };
            self.log_read_ok();
            // confirmations a node refused: held back per shard, counted here (ADR-0069)
            let refused = self.reader.as_mut().map_or(0, |r| r.take_confirm_errors());
            if refused > 0 {
                metrics::counter!("tidemark_errors_total", "code" => "log_confirm")
                    .increment(refused);
            }
            backlog = batches.iter().any(|(_, r)| r.len() >= self.opts.batch);
            if !self.feed_on() {
                self.feed_after_log_read(backlog);
            }
            let stepped: Vec<u32> = positions.iter().map(|p| p.0).collect();
            let busy = !batches.is_empty();
            let routed = self.route(batches);
            // While the batch is applied (mailbox Redis), the next one is read (core Redis):
            // from the positions routing left, without blocking; used next time only where
            // they still hold ([`Worker::take_ahead`]).
            // (not in feed mode: the feed fills while the batch is applied)
            let ahead_from: Vec<(u32, u64)> = if busy && !self.feed_on() {
                self.readable()
            } else {
                Vec::new()
            };
            let mut reader = self.reader.take().expect("the reader is here");
            let count = self.opts.batch;
            let linger = self.linger_until(last_read, backlog);
            if !ahead_from.is_empty() {
                last_read = Some(linger.unwrap_or_else(Instant::now));
            }
            let (applied, ahead) = tokio::join!(self.apply(routed), async {
                if ahead_from.is_empty() {
                    return None;
                }
                if let Some(due) = linger {
                    tokio::time::sleep_until(due.into()).await;
                }
                let r = tokio::time::timeout(
                    READ_GRACE,
                    reader.read(&ahead_from, count, Duration::ZERO),
                )
                .await;
                // a failed read ahead is dropped: the next read finds the trouble again
                match r {
                    Ok(Ok(b)) if !b.is_empty() => Some(Ahead {
                        from: ahead_from.iter().copied().collect(),
                        batches: b,
                    }),
                    _ => None,
                }
            });
            self.reader = Some(reader);
            self.ahead = ahead;
            if let Err(e) = applied {
                // Redis trouble: nothing is lost (the log is still there); every shard of the
                // step re-reads from its W once the backoff has passed, until that succeeds.
                tracing::warn!(error = %e, "materialize step failed; shards retry from W");
                metrics::counter!("tidemark_errors_total", "code" => e.code()).increment(1);
                let why = e.to_string();
                let mut retry: BTreeSet<u32> = stepped.into_iter().collect();
                // shards with pending records were processed by the step too
                retry.extend(
                    self.owned
                        .values()
                        .filter(|sh| !sh.pending.is_empty())
                        .map(|sh| sh.shard),
                );
                for s in retry {
                    self.schedule_retry(s, &why);
                }
            }
        }
    }

    /// When the earliest hint that waits for its instance's flush is due (ADR-0047).
    fn hint_flush_due(&self) -> Option<Instant> {
        self.hint_pace
            .iter()
            .filter_map(|p| p.waiting_since)
            .min()
            .map(|t| t + self.opts.hint_linger)
    }

    /// When the next log read may start: `read_linger` after the last one started, unless
    /// that one found a backlog (or there is no linger); `None`: now.
    fn linger_until(&self, last_read: Option<Instant>, backlog: bool) -> Option<Instant> {
        let linger = self.opts.read_linger;
        if backlog || linger.is_zero() {
            return None;
        }
        let due = last_read? + linger;
        (due > Instant::now()).then_some(due)
    }

    /// The shards the loop reads now and where from: running, not waiting for a retry, lease
    /// gate open.
    fn readable(&self) -> Vec<(u32, u64)> {
        let gate = self.opts.lease_gate.as_ref();
        self.owned
            .values()
            .filter(|sh| !sh.stopped && sh.retry.is_none())
            .filter(|sh| gate.is_none_or(|g| g.may_write(sh.shard)))
            .map(|sh| (sh.shard, sh.read_pos))
            .collect()
    }

    /// The batches of the read ahead whose shard is still read from the position that read
    /// started at (`positions`: the loop's now). A shard that moved since (a resync, a hold,
    /// a retry, a stop) drops its part; `None` when nothing is left.
    fn take_ahead(&mut self, positions: &[(u32, u64)]) -> Option<Vec<(u32, Vec<DispatchRecord>)>> {
        let ahead = self.ahead.take()?;
        let now: BTreeMap<u32, u64> = positions.iter().copied().collect();
        let keep: Vec<(u32, Vec<DispatchRecord>)> = ahead
            .batches
            .into_iter()
            .filter(|(s, recs)| {
                !recs.is_empty() && now.contains_key(s) && now.get(s) == ahead.from.get(s)
            })
            .collect();
        (!keep.is_empty()).then_some(keep)
    }

    /// Re-reads a shard's watermark and restarts reading from its lowest W; bounded by
    /// [`MAILBOX_CALL_TIMEOUT`] (ADR-0129): on an instance that does not answer (or is left
    /// alone for not answering) it fails at once or within that, and the shard retries later.
    /// One given up has an unknown outcome (a claim or re-fence may have landed): the next
    /// resync reads what is stored and goes on from it (ADR-0097, ADR-0120).
    pub(super) async fn resync(&mut self, s: u32) -> Result<(), Error> {
        let Some(sh) = self.owned.get(&s) else {
            return Ok(());
        };
        if sh.stopped {
            return Ok(());
        }
        let mb = sh.mb;
        if !self.stalls.ready(mb).await {
            return Err(self.stalls.error(mb));
        }
        let limit = self.stalls.limit(mb, MAILBOX_CALL_TIMEOUT);
        match bounded(limit, self.resync_now(s)).await {
            Some(r) => {
                self.stalls.answered(mb);
                r
            }
            None => {
                self.stalls.timed_out(mb);
                Err(self.stalls.error(mb))
            }
        }
    }

    /// [`Worker::resync`], unbounded.
    async fn resync_now(&mut self, s: u32) -> Result<(), Error> {
        let Some(sh) = self.owned.get(&s) else {
            return Ok(());
        };
        if sh.stopped {
            return Ok(());
        }
        let (mb, mut epoch) = (sh.mb, sh.epoch);
        let read = match self.mailboxes[mb].read_watermark(s).await {
            Err(e) if e.code() == "no_watermark" => {
                // The watermark is gone while we own the shard: the mailbox instance lost
                // everything of it (restarted without its data, a promoted replica that never
                // had the key). That is a watermark gone back to nothing: create it again as a
                // start does (at W = 0 with our epoch, never over one that exists by now) and
                // re-materialise from the log, which holds everything above the last W
                // confirmed on the replicas (a trimmed log shows as a discontinuity and holds
                // the shard, as after a restore). The quiet path: nothing else would. Only
                // once it has been missing for WATERMARK_LOST_AFTER: one read that finds
                // nothing may have met a node that is no longer the shard's primary.
                let since = *self
                    .shard_mut(s)
                    .missing_since
                    .get_or_insert_with(Instant::now);
                if since.elapsed() < super::WATERMARK_LOST_AFTER {
                    return Err(e.into());
                }
                // a shard owned unclaimed is created and claimed only while its lease is ours
                // (ADR-0130, as below)
                if epoch == 0 && self.gate_closed(s) {
                    return Err(Error::LeaseLapsed { shard: s });
                }
                let layout = self.mailboxes[mb].layout();
                // a shard never claimed (no watermark at the worker's start, ADR-0060) is
                // created as a start creates it (epoch 1), then claimed
                match self.mailboxes[mb]
                    .init_watermark(s, layout, epoch.max(1), 0, false)
                    .await
                {
                    Ok(()) => tracing::error!(
                        shard = s,
                        epoch,
                        "watermark missing on the mailbox instance; created again at W=0"
                    ),
                    // another owner (or a start) created it first: read what is there
                    Err(tidemark_store::Error::AlreadyExists { .. }) => {}
                    Err(e) => return Err(e.into()),
                }
                if epoch == 0 {
                    epoch = self.mailboxes[mb].claim(s).await?;
                    tracing::info!(
                        shard = s,
                        epoch,
                        "claimed shard after its watermark was created again"
                    );
                    self.shard_mut(s).epoch = epoch;
                    self.health.update(s, |h| h.epoch = epoch);
                }
                self.mailboxes[mb].read_watermark(s).await
            }
            other => other,
        };
        // ADR-0097: a shard owned unclaimed (epoch 0: its instance did not answer at the
        // worker's start) is claimed as a start claims it, once its watermark can be read.
        // Compared with epoch 0, the epoch found (ours from before, or the last owner's)
        // stopped the shard as fenced, for good.
        let read = match read {
            Ok(_) if epoch == 0 => {
                if self.gate_closed(s) {
                    // not ours to claim now (leases mode): the lease loop stops this worker
                    return Err(Error::LeaseLapsed { shard: s });
                }
                match self.mailboxes[mb].claim(s).await {
                    Ok(e) => {
                        epoch = e;
                        tracing::info!(shard = s, epoch, "claimed shard once it could be read");
                        self.shard_mut(s).epoch = epoch;
                        self.health.update(s, |h| h.epoch = epoch);
                        self.mailboxes[mb].read_watermark(s).await
                    }
                    Err(e) => Err(e),
                }
            }
            other => other,
        };
        match read {
            Ok(wm) => {
                self.shard_mut(s).missing_since = None;
                // W below what this worker saw applied, in our epoch (ADR-0100): the mailbox
                // side lost writes too, but kept the epoch (a promoted replica that had the
                // claim and not our last moves). Re-fenced like an epoch gone back, so that
                // the hints from here on carry a new epoch: a gateway's hub then lets its
                // hinted W go back with it; otherwise its hinted reads would count entries
                // below the old W as read before they are re-materialised.
                let regressed = wm.epoch == epoch
                    && wm.lanes.min_present_w().unwrap_or(0) < self.owned[&s].min_w;
                // ADR-0120: the last re-fence got no answer (its connection was cut, often by
                // the same failover), and the epoch stored is the one it asked for. It is
                // ours if the script ran, or another claimer's that raised the same epoch
                // from the one we found: taken as neither, but fenced past it below, as a
                // claim would (only an epoch our own compare-and-set answered is used). Before,
                // it was taken for another owner's and the shard stopped, for good in static
                // mode. In leases mode only while the lease is ours, as a claim.
                let unconfirmed = self.owned[&s]
                    .refencing
                    .is_some_and(|t| t > epoch && wm.epoch == t);
                if unconfirmed && self.gate_closed(s) {
                    return Err(Error::LeaseLapsed { shard: s });
                }
                if wm.epoch < epoch || regressed || unconfirmed {
                    // W and the epoch went backwards: the mailbox side lost writes it had
                    // acknowledged to us (a promoted replica, a restore). No other owner can
                    // have written an epoch below ours: raise it past ours again and resume
                    // from the W it has; the log above it is still there (trimmed only below
                    // a W confirmed on the replicas) and replays are no-ops (ADR-0032).
                    // (`unconfirmed`: past the epoch our unanswered re-fence asked for.)
                    let target = wm.epoch.max(epoch) + 1;
                    // kept until an answer says the epoch is ours: a failure on the way leaves
                    // the stored epoch unknown (ADR-0120)
                    self.shard_mut(s).refencing = Some(target);
                    let raised = self.mailboxes[mb].fence_epoch(s, wm.epoch, target).await?;
                    if let Some(f) = &self.opts.fault {
                        if f.lose_fence_reply(s, target) {
                            return Err(Error::Store(tidemark_store::Error::InvalidArgument(
                                "injected fault: the re-fence's reply was lost".into(),
                            )));
                        }
                    }
                    let Fence::Raised { epoch: new } = raised else {
                        return Err(Error::Store(tidemark_store::Error::InvalidArgument(
                            format!(
                                "shard {s}: epoch changed while re-fencing a regressed watermark"
                            ),
                        )));
                    };
                    self.shard_mut(s).refencing = None;
                    tracing::warn!(
                        shard = s,
                        stored_epoch = wm.epoch,
                        our_epoch = epoch,
                        new_epoch = new,
                        "watermark went backwards; re-fenced in a new epoch"
                    );
                    self.shard_mut(s).epoch = new;
                    self.health.update(s, |h| h.epoch = new);
                } else if wm.epoch != epoch {
                    self.stop(
                        s,
                        ShardStatus::Fenced {
                            current_epoch: Some(wm.epoch),
                        },
                    );
                    return Ok(());
                } else {
                    // our epoch is stored: a re-fence that got no answer did not run
                    self.shard_mut(s).refencing = None;
                }
                let sh = self.shard_mut(s);
                sh.pending.clear();
                let was = sh.min_w;
                sh.min_w = wm.lanes.min_present_w().unwrap_or(0);
                if sh.min_w < was || wm.epoch < epoch || unconfirmed {
                    // W never moves back by itself: the mailbox side lost writes (a promoted
                    // replica, a restore); resuming from the stored W re-materialises them.
                    // The one place a regression is logged and counted (GC and the scripts'
                    // replies only bring the shard here).
                    tracing::error!(
                        shard = s,
                        w = sh.min_w,
                        was,
                        "watermark went backwards; re-materialising from the log"
                    );
                    metrics::counter!("tidemark_watermark_regressions_total").increment(1);
                    // hinted at once, in the new epoch (ADR-0100): gateways learn that W went
                    // back now, not at the first step that re-materialises
                    sh.hint_seq += 1;
                    sh.moved = true;
                    sh.unhanded = true;
                } else if sh.min_w > was {
                    // W moved past what this worker saw applied: a step whose replies were
                    // lost (a pipeline that failed on another shard's script, a connection cut
                    // after the scripts ran) wrote entries that were never hinted, and their
                    // recipients are not known here. The next hint skips a number, so every
                    // gateway re-checks every connection of the shard (ADR-0035); without it
                    // those entries waited for their recipients' next message, a reconnect or
                    // the slow sweep (ADR-0062).
                    tracing::info!(
                        shard = s,
                        w = sh.min_w,
                        was,
                        "watermark moved by a step whose replies were lost; waking the shard"
                    );
                    sh.hint_seq += 1;
                    sh.moved = true;
                    sh.unhanded = true;
                }
                sh.read_pos = sh.min_w;
                sh.uniform = wm.lanes.is_uniform();
                let min_w = sh.min_w;
                self.health.update(s, |h| h.min_w = min_w);
                Ok(())
            }
            Err(e) if e.is_corrupt() => {
                self.stop(s, ShardStatus::Corrupt(e.to_string()));
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Claims shard `s` for a worker started again in place of one that held it at epoch `was`
/// (ADR-0105): raised from `was` (or, if the stored epoch went below `was`, a watermark that
/// went back, from whatever is stored, as a start would); `Lost` when the stored epoch is
/// above `was`: another owner claimed the shard meanwhile.
async fn claim_from(
    store: &mut MailboxStore,
    s: u32,
    was: u64,
) -> Result<Fence, tidemark_store::Error> {
    let wm = store.check_claimable(s).await?;
    if wm.epoch > was {
        return Ok(Fence::Lost {
            current_epoch: Some(wm.epoch),
        });
    }
    if wm.epoch < was {
        return store.claim(s).await.map(|epoch| Fence::Raised { epoch });
    }
    store.fence_epoch(s, was, was + 1).await
}
