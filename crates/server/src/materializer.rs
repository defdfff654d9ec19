//! Materializers: the single owner of each shard copies its dispatch log, in log order and
//! exactly once, into the recipients' mailboxes and moves the shard's contiguous watermark.
//!
//! One [`Worker`] runs per core Redis instance and owns the shards of that instance that this
//! process owns (static assignment). On start it claims each shard (raises `wm_epoch`, which
//! fences any older owner) and resumes from the lowest present W. Then it loops:
//!
//! 1. `XREAD BLOCK` over all its shards' logs (a connection of its own, no response timeout);
//! 2. the steady state — a one-recipient record on a uniform watermark — goes through
//!    `materialize_fresh_single_recipient` (hot path), pipelined across all shards of a
//!    mailbox instance, each shard's records in log order (each command CASes on W, so a
//!    failure cannot be overtaken);
//! 3. every other record (many recipients, or a diverged watermark) is *pending*: its lane
//!    chunks are written with `write_lane_chunk` (idempotent) and `advance_log_watermarks`
//!    moves each lane whose chunk is durable and whose CAS holds. A failed chunk holds its lane
//!    back (the blob diverges to 1216 bytes) and is retried until it lands; then the lanes meet
//!    and the blob is written back as 19 bytes, and the hot path resumes;
//! 4. a wake-up hint is published per shard that moved (`wake:{s}`, a hint only);
//! 5. once a second per shard: `gc_completed_dispatch` and the core log trimmed to the lowest W.
//!
//! Replays are no-ops, a gap makes the owner re-read from W, a fenced or corrupt shard is
//! stopped (fail closed) and reported unhealthy.
//!
//! **Failures retry by themselves.** Any Redis failure while materialising (connection refused,
//! timeout, `NOAUTH`, `LOADING`, `BUSY`, `READONLY`, …) puts the shards of the step in
//! *retry*: their in-memory records are dropped and, after a capped backoff ([`RETRY_MIN`]
//! doubling to [`RETRY_MAX`]), each re-reads its watermark and resumes reading the log from
//! its lowest W. This repeats until it succeeds, with or without new traffic (a shard never
//! waits for an unrelated send to notice a gap). A lost log connection (XREAD) is replaced
//! with the same backoff. `/healthz` names every shard in retry.
//!
//! A panic is not handled here: [`crate::run`] supervises each worker, logs and counts the
//! panic and starts the worker again (it re-claims its shards: replays are no-ops).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tidemark_protocol::entry::encode_entry;
use tidemark_store::redis::dlog::{DispatchRecord, LogReader, LogStore};
use tidemark_store::redis::store::{
    Advance, AdvanceCounts, AdvanceRecord, ChunkWritten, Gc, LaneChunk, MailboxStore, Materialized,
    SingleItem,
};
use tidemark_store::redis::watermark::{Layout, FULL_BLOB_BYTES, LANES, U48_MAX};
use tidemark_store::topology::ShardMap;
use tidemark_store::wake::{publish_wake, WakeHint};
use tokio_util::sync::CancellationToken;

use crate::health::{HealthBoard, ShardStatus};

/// Most shards garbage-collected in one loop iteration.
const GC_SHARDS_PER_LOOP: usize = 4;

/// First retry delay of a shard whose writes or reads failed.
pub const RETRY_MIN: Duration = Duration::from_millis(50);
/// Longest retry delay (the backoff doubles up to this).
pub const RETRY_MAX: Duration = Duration::from_secs(1);
/// Longest wait for an XREAD beyond its BLOCK time before the connection is presumed dead.
const READ_GRACE: Duration = Duration::from_secs(10);
/// How often a shard held by a log discontinuity re-checks the log.
const DISCONTINUITY_RECHECK: Duration = Duration::from_secs(5);
/// A hold or retry that lasts is logged again this often (else once per state change).
const LOG_REMINDER: Duration = Duration::from_secs(60);

/// Fault injection for tests and fault runs.
pub trait ChunkFault: Send + Sync {
    /// True: skip this lane chunk write, as if it had failed; `attempt` counts from 0 per
    /// (record, lane).
    fn fail(&self, shard: u32, offset: u64, lane: usize, attempt: u32) -> bool;

    /// True: panic just before record `offset` of `shard` is routed (tests of supervision).
    fn panic_before(&self, _shard: u32, _offset: u64) -> bool {
        false
    }
}

/// Tuning of a materializer.
#[derive(Clone)]
pub struct MaterializerOptions {
    /// Most records read per XREAD.
    pub batch: usize,
    /// XREAD BLOCK time when idle.
    pub block: Duration,
    /// How often each shard is garbage-collected (staging state, core log).
    pub gc_interval: Duration,
    /// Fault injection for chunk writes.
    pub fault: Option<Arc<dyn ChunkFault>>,
}

impl Default for MaterializerOptions {
    fn default() -> Self {
        MaterializerOptions {
            batch: 512,
            block: Duration::from_millis(500),
            gc_interval: Duration::from_secs(1),
            fault: None,
        }
    }
}

/// Errors that stop a whole worker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Storage failure.
    #[error(transparent)]
    Store(#[from] tidemark_store::Error),
}

impl Error {
    /// Stable code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Store(e) => e.code(),
        }
    }
}

struct Pending {
    rec: DispatchRecord,
    /// Recipients by lane.
    lanes: BTreeMap<usize, Vec<String>>,
    /// Lanes whose chunk is durable.
    done: BTreeSet<usize>,
    /// Attempts per lane (for fault injection and logs).
    attempts: HashMap<usize, u32>,
}

impl Pending {
    fn new(rec: DispatchRecord, map: &ShardMap) -> Pending {
        let mut lanes: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for r in &rec.recipients {
            lanes.entry(map.route(r).lane).or_default().push(r.clone());
        }
        Pending {
            rec,
            lanes,
            done: BTreeSet::new(),
            attempts: HashMap::new(),
        }
    }

    fn advance_record(&self) -> AdvanceRecord {
        let mut needed = [false; LANES];
        for l in self.lanes.keys() {
            needed[*l] = true;
        }
        AdvanceRecord {
            offset: self.rec.offset,
            prev: self.rec.prev,
            needed,
        }
    }
}

struct ShardRt {
    shard: u32,
    mb: usize,
    epoch: u64,
    /// Highest offset read from the log (materialised or pending).
    read_pos: u64,
    uniform: bool,
    pending: VecDeque<Pending>,
    stopped: bool,
    /// Set while the shard waits to retry after a failure: it reads nothing until then.
    retry: Option<Retry>,
    /// Why the shard is held (an empty lane, a log discontinuity), reported in health and
    /// re-checked periodically; cleared when W moves again.
    held: Option<ShardStatus>,
    /// When the current hold or retry was last logged (one line per state change, then a
    /// reminder every [`LOG_REMINDER`]).
    last_logged: Option<Instant>,
    touched: BTreeSet<String>,
    moved: bool,
    min_w: u64,
    last_gc: Instant,
}

impl ShardRt {
    /// A shard this worker does not run (its watermark was corrupt at start).
    fn stopped(shard: u32, mb: usize) -> ShardRt {
        ShardRt {
            shard,
            mb,
            epoch: 0,
            read_pos: 0,
            uniform: false,
            pending: VecDeque::new(),
            stopped: true,
            retry: None,
            held: None,
            last_logged: None,
            touched: BTreeSet::new(),
            moved: false,
            min_w: 0,
            last_gc: Instant::now(),
        }
    }
}

/// A shard's retry after a failure.
#[derive(Debug, Clone, Copy)]
struct Retry {
    /// When the next attempt is due.
    due: Instant,
    /// The delay that led to `due` (doubles on each failure, up to [`RETRY_MAX`]).
    backoff: Duration,
    /// A failure (reported as `retrying` in health) rather than a periodic re-check.
    failure: bool,
}

/// One materializer worker: the owned shards of one core instance.
pub struct Worker {
    /// Routing (a record's recipients → lanes) and the shard → mailbox instance table.
    map: ShardMap,
    core: LogStore,
    core_url: String,
    /// `core_url` without its password, for logs and `/healthz`.
    core_shown: String,
    reader: LogReader,
    mailboxes: Vec<MailboxStore>,
    rts: BTreeMap<u32, ShardRt>,
    opts: MaterializerOptions,
    health: Arc<HealthBoard>,
    /// Current delay before replacing a failed log connection (None: reads are healthy).
    read_backoff: Option<Duration>,
    /// When the owner marks (`owner:{s}`) were last refreshed.
    marks_at: Option<Instant>,
}

fn single_item(rec: &DispatchRecord) -> SingleItem {
    SingleItem {
        offset: rec.offset,
        prev: rec.prev,
        recipient: rec.recipients[0].clone(),
        entry: encode_entry(rec.offset, rec.sent_at_us, &rec.sender, &rec.body),
    }
}

/// Rebuilds a record from a hot item (the entry carries everything the chunked path needs).
fn record_from_item(it: &SingleItem) -> DispatchRecord {
    let e = tidemark_protocol::entry::decode_entry(&it.entry)
        .expect("entries built by this worker decode");
    DispatchRecord {
        offset: it.offset,
        prev: it.prev,
        sender: e.from,
        client_id: String::new(),
        recipients: vec![it.recipient.clone()],
        body: e.body,
        sent_at_us: e.sent_at_us,
    }
}

impl Worker {
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
        let core_url = map.core_urls()[core].as_str();
        debug_assert!(shards.iter().all(|&s| map.core_of(s) == core));
        let reader = LogReader::connect(core_url).await?;
        let core_shown = tidemark_store::redact_url(core_url);
        let core_url = core_url.to_string();
        let core = LogStore::connect(&core_url).await?;
        let mut w = Worker {
            map,
            core,
            core_url,
            core_shown,
            reader,
            mailboxes,
            rts: BTreeMap::new(),
            opts,
            health,
            read_backoff: None,
            marks_at: None,
        };
        let mut corrupt = Vec::new();
        for &s in shards {
            let mb = w.map.mailbox_of(s);
            w.health.update(s, |h| h.status = ShardStatus::Starting);
            let store = &mut w.mailboxes[mb];
            let claimed = match store.claim(s).await {
                Ok(epoch) => store.read_watermark(s).await.map(|wm| (epoch, wm)),
                Err(e) => Err(e),
            };
            let (epoch, wm) = match claimed {
                Ok(c) => c,
                // new code: only this shard stops (fail closed); the others run. Old
                // (packed-v1) code refuses the whole start before claiming (run::serve).
                Err(e) if e.is_corrupt() && store.layout() == Layout::PackedV2 => {
                    tracing::error!(shard = s, error = %e, "shard not claimed: corrupt watermark");
                    metrics::counter!("tidemark_shard_corrupt_total").increment(1);
                    w.rts.insert(s, ShardRt::stopped(s, mb));
                    w.health
                        .update(s, |h| h.status = ShardStatus::Corrupt(e.to_string()));
                    corrupt.push(s);
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
            w.rts.insert(
                s,
                ShardRt {
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
                    moved: false,
                    min_w,
                    last_gc: Instant::now() - Duration::from_secs(3600),
                },
            );
            w.health.update(s, |h| {
                h.status = ShardStatus::Running;
                h.epoch = epoch;
                h.min_w = min_w;
                h.last_progress = Instant::now();
                h.retrying = None;
            });
        }
        let claimed: Vec<u32> = w
            .rts
            .values()
            .filter(|rt| !rt.stopped)
            .map(|rt| rt.shard)
            .collect();
        tracing::info!(
            core = %w.core_url,
            shards = %tidemark_store::deployment::format_ranges(&claimed),
            corrupt = %tidemark_store::deployment::format_ranges(&corrupt),
            "claimed shards"
        );
        Ok(w)
    }

    /// The shards this worker owns.
    pub fn shards(&self) -> Vec<u32> {
        self.rts.keys().copied().collect()
    }

    /// The core instance this worker reads.
    pub fn core_url(&self) -> &str {
        &self.core_url
    }

    fn stop(&mut self, shard: u32, status: ShardStatus) {
        if let Some(rt) = self.rts.get_mut(&shard) {
            rt.stopped = true;
            rt.retry = None;
            rt.pending.clear();
        }
        tracing::error!(shard, ?status, "shard stopped");
        match &status {
            ShardStatus::Fenced { .. } => {
                metrics::counter!("tidemark_shard_fenced_total").increment(1)
            }
            ShardStatus::Corrupt(_) => {
                metrics::counter!("tidemark_shard_corrupt_total").increment(1)
            }
            _ => {}
        }
        self.health.update(shard, |h| {
            h.status = status;
            h.retrying = None;
        });
    }

    /// Puts `shard` in retry after `why`: its records in memory are dropped and, after the
    /// backoff, it re-reads its watermark and resumes from its lowest W.
    fn schedule_retry(&mut self, shard: u32, why: &str) {
        let Some(rt) = self.rts.get_mut(&shard) else {
            return;
        };
        if rt.stopped {
            return;
        }
        let backoff = rt
            .retry
            .map_or(RETRY_MIN, |r| (r.backoff * 2).min(RETRY_MAX));
        rt.retry = Some(Retry {
            due: Instant::now() + backoff,
            backoff,
            failure: true,
        });
        rt.pending.clear();
        self.health.set_retrying(shard, why);
    }

    /// Runs the resync of every shard whose retry is due; a failed resync backs off further.
    async fn retry_due(&mut self) {
        let now = Instant::now();
        let due: Vec<u32> = self
            .rts
            .values()
            .filter(|rt| !rt.stopped && rt.retry.is_some_and(|r| r.due <= now))
            .map(|rt| rt.shard)
            .collect();
        for s in due {
            match self.resync(s).await {
                Ok(()) => {
                    let rt = self.rts.get_mut(&s).expect("shard");
                    if rt.stopped {
                        continue;
                    }
                    if !rt.retry.take().is_some_and(|r| r.failure) {
                        continue;
                    }
                    tracing::info!(shard = s, w = rt.min_w, "shard resumed after a failure");
                    metrics::counter!("tidemark_shard_recoveries_total").increment(1);
                    self.health.update(s, |h| {
                        h.retrying = None;
                        h.last_progress = Instant::now();
                    });
                }
                Err(e) => {
                    tracing::warn!(shard = s, error = %e, "resync failed; retrying");
                    self.schedule_retry(s, &e.to_string());
                }
            }
        }
    }

    /// Earliest retry due among shards in retry.
    fn next_retry(&self) -> Option<Instant> {
        self.rts
            .values()
            .filter(|rt| !rt.stopped)
            .filter_map(|rt| rt.retry.map(|r| r.due))
            .min()
    }

    /// The log read failed: report it on every shard, wait (capped backoff), replace the
    /// connection.
    async fn log_read_failed(&mut self, e: &str, cancel: &CancellationToken) {
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
            Ok(Ok(r)) => self.reader = r,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, core = %self.core_shown, "log reconnect failed")
            }
            Err(_) => tracing::warn!(core = %self.core_shown, "log reconnect timed out"),
        }
    }

    /// The log read succeeded after failures: clear what [`Self::log_read_failed`] reported.
    fn log_read_ok(&mut self) {
        if self.read_backoff.take().is_none() {
            return;
        }
        tracing::info!(core = %self.core_shown, "log read resumed");
        for rt in self.rts.values() {
            if rt.retry.is_none() {
                self.health.update(rt.shard, |h| {
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
    /// `tidemark_store::redis::store::OWNER_MARK_TTL_MS`) of every running shard, once a
    /// second: one pipeline per mailbox instance.
    async fn refresh_marks(&mut self) {
        if self
            .marks_at
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.marks_at = Some(Instant::now());
        let mut marks: BTreeMap<usize, Vec<(u32, u64)>> = BTreeMap::new();
        for rt in self.rts.values().filter(|rt| !rt.stopped) {
            marks.entry(rt.mb).or_default().push((rt.shard, rt.epoch));
        }
        for (mb, marks) in marks {
            if let Err(e) = self.mailboxes[mb].refresh_owner_marks(&marks).await {
                tracing::debug!(error = %e, "owner marks not refreshed");
            }
        }
    }

    /// Removes this owner's marks (only where they still hold its epoch).
    async fn clear_marks(&mut self) {
        for rt in self.rts.values().filter(|rt| !rt.stopped) {
            let _ = self.mailboxes[rt.mb]
                .clear_owner_mark(rt.shard, rt.epoch)
                .await;
        }
    }

    async fn run_loop(&mut self, cancel: &CancellationToken) -> Result<(), Error> {
        loop {
            if cancel.is_cancelled() {
                return Ok(());
            }
            self.refresh_marks().await;
            self.retry_due().await;
            let positions: Vec<(u32, u64)> = self
                .rts
                .values()
                .filter(|rt| !rt.stopped && rt.retry.is_none())
                .map(|rt| (rt.shard, rt.read_pos))
                .collect();
            let next_retry = self.next_retry();
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
            let any_pending = self.rts.values().any(|rt| !rt.pending.is_empty());
            let mut block = if any_pending {
                Duration::from_millis(20)
            } else {
                self.opts.block
            };
            if let Some(due) = next_retry {
                block = block.min(due.saturating_duration_since(Instant::now()));
            }
            // XREAD BLOCK 0 would block for ever
            let block = block.max(Duration::from_millis(1));
            let read = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                r = tokio::time::timeout(
                    block + READ_GRACE,
                    self.reader.read(&positions, self.opts.batch, block),
                ) => r,
            };
            let batches = match read {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => {
                    self.log_read_failed(&e.to_string(), cancel).await;
                    continue;
                }
                Err(_) => {
                    self.log_read_failed("XREAD timed out", cancel).await;
                    continue;
                }
            };
            self.log_read_ok();
            let stepped: Vec<u32> = positions.iter().map(|p| p.0).collect();
            if let Err(e) = self.step(batches).await {
                // Redis trouble: nothing is lost (the log is still there); every shard of the
                // step re-reads from its W once the backoff has passed, until that succeeds.
                tracing::warn!(error = %e, "materialize step failed; shards retry from W");
                metrics::counter!("tidemark_errors_total", "code" => e.code()).increment(1);
                let why = e.to_string();
                let mut retry: BTreeSet<u32> = stepped.into_iter().collect();
                // shards with pending records were processed by the step too
                retry.extend(
                    self.rts
                        .values()
                        .filter(|rt| !rt.pending.is_empty())
                        .map(|rt| rt.shard),
                );
                for s in retry {
                    self.schedule_retry(s, &why);
                }
            }
        }
    }

    /// Re-reads a shard's watermark and restarts reading from its lowest W.
    async fn resync(&mut self, s: u32) -> Result<(), Error> {
        let Some(rt) = self.rts.get(&s) else {
            return Ok(());
        };
        if rt.stopped {
            return Ok(());
        }
        let (mb, epoch) = (rt.mb, rt.epoch);
        match self.mailboxes[mb].read_watermark(s).await {
            Ok(wm) => {
                if wm.epoch != epoch {
                    self.stop(
                        s,
                        ShardStatus::Fenced {
                            current_epoch: Some(wm.epoch),
                        },
                    );
                    return Ok(());
                }
                let rt = self.rts.get_mut(&s).expect("shard");
                rt.pending.clear();
                rt.min_w = wm.lanes.min_present_w().unwrap_or(0);
                rt.read_pos = rt.min_w;
                rt.uniform = wm.lanes.is_uniform();
                let min_w = rt.min_w;
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

    async fn step(&mut self, batches: Vec<(u32, Vec<DispatchRecord>)>) -> Result<(), Error> {
        // Route records: hot items per mailbox instance, the rest to pending.
        let mut holes = Vec::new();
        let mut hot: BTreeMap<usize, Vec<(u32, u64, Vec<SingleItem>)>> = BTreeMap::new();
        for (s, recs) in batches {
            let map = &self.map;
            let Some(rt) = self.rts.get_mut(&s) else {
                continue;
            };
            if rt.stopped {
                continue;
            }
            let mut items = Vec::new();
            let mut hole = None;
            for rec in recs {
                if rec.offset <= rt.read_pos {
                    continue; // already read (a re-read after resync overlaps)
                }
                if let Some(f) = &self.opts.fault {
                    if f.panic_before(s, rec.offset) {
                        panic!(
                            "injected fault: panic before shard {s} offset {}",
                            rec.offset
                        );
                    }
                }
                if rec.prev != rt.read_pos {
                    // a hole in the log (trimmed above W, or W moved back by a restore)
                    hole = Some((rt.read_pos, rec.offset));
                    break;
                }
                rt.read_pos = rec.offset;
                if rt.pending.is_empty() && rt.uniform && rec.recipients.len() == 1 {
                    items.push(single_item(&rec));
                } else {
                    rt.pending.push_back(Pending::new(rec, map));
                }
            }
            if !items.is_empty() {
                hot.entry(rt.mb).or_default().push((s, rt.epoch, items));
            }
            if let Some((w, next)) = hole {
                // records before the hole still go through; the shard then waits
                holes.push((s, w, Some(next)));
            }
        }
        for (s, w, next) in holes {
            self.hold_discontinuity(s, w, next);
        }
        for (mb, batches) in hot {
            let outcomes = self.mailboxes[mb].materialize_batches(&batches).await?;
            for ((s, _, items), outs) in batches.into_iter().zip(outcomes) {
                self.handle_hot(s, items, outs).await?;
            }
        }
        let with_pending: Vec<u32> = self
            .rts
            .values()
            .filter(|rt| !rt.stopped && !rt.pending.is_empty())
            .map(|rt| rt.shard)
            .collect();
        for s in with_pending {
            self.process_pending(s).await?;
        }
        self.publish_and_gc().await
    }

    async fn handle_hot(
        &mut self,
        s: u32,
        items: Vec<SingleItem>,
        outs: Vec<Materialized>,
    ) -> Result<(), Error> {
        let mut applied = 0u64;
        for (i, out) in outs.into_iter().enumerate() {
            match out {
                Materialized::Applied { .. } | Materialized::Replay { .. } => {
                    let rt = self.rts.get_mut(&s).expect("shard");
                    rt.touched.insert(items[i].recipient.clone());
                    rt.moved = true;
                    rt.min_w = rt.min_w.max(items[i].offset);
                    applied += 1;
                }
                Materialized::NotUniform => {
                    // The rest goes to the chunked path, in order, ahead of later pending.
                    let rt = self.rts.get_mut(&s).expect("shard");
                    rt.uniform = false;
                    let mut moved: Vec<Pending> = Vec::new();
                    for it in &items[i..] {
                        let rec = record_from_item(it);
                        moved.push(Pending::new(rec, &self.map));
                    }
                    let rt = self.rts.get_mut(&s).expect("shard");
                    for p in moved.into_iter().rev() {
                        rt.pending.push_front(p);
                    }
                    break;
                }
                Materialized::Gap { w } => {
                    tracing::warn!(
                        shard = s,
                        w,
                        offset = items[i].offset,
                        "gap: re-reading from W"
                    );
                    metrics::counter!("tidemark_gaps_total").increment(1);
                    self.resync(s).await?;
                    break;
                }
                Materialized::Fenced { current_epoch } => {
                    self.stop(s, ShardStatus::Fenced { current_epoch });
                    break;
                }
                Materialized::Corrupt(v) => {
                    self.stop(
                        s,
                        ShardStatus::Corrupt(format!("{} lane {:?}", v.code, v.lane)),
                    );
                    break;
                }
            }
        }
        metrics::counter!("tidemark_materialized_total", "path" => "hot").increment(applied);
        if applied > 0 {
            self.clear_held(s);
        }
        Ok(())
    }

    /// Holds shard `s` for `why` (an empty lane, a log discontinuity): its records in memory
    /// are dropped and it re-reads from W after `recheck`, until W moves again. Logged and
    /// counted once per change of reason, with a reminder every [`LOG_REMINDER`].
    fn hold(&mut self, s: u32, why: ShardStatus, recheck: Duration) {
        let Some(rt) = self.rts.get_mut(&s) else {
            return;
        };
        let changed = rt.held.as_ref() != Some(&why);
        let remind = rt.last_logged.is_none_or(|t| t.elapsed() >= LOG_REMINDER);
        if changed {
            match &why {
                ShardStatus::LaneEmpty { lane, offset } => {
                    tracing::error!(shard = s, lane, offset, "record needs an empty lane; held");
                    metrics::counter!("tidemark_lane_empty_holds_total").increment(1);
                }
                ShardStatus::Discontinuity { w, next } => {
                    tracing::error!(shard = s, w, ?next, "log discontinuity; shard held");
                    metrics::counter!("tidemark_log_discontinuities_total").increment(1);
                }
                _ => {}
            }
            rt.last_logged = Some(Instant::now());
        } else if remind {
            tracing::warn!(shard = s, status = ?why, "shard still held");
            rt.last_logged = Some(Instant::now());
        }
        rt.held = Some(why.clone());
        rt.retry = Some(Retry {
            due: Instant::now() + recheck,
            backoff: recheck,
            failure: false,
        });
        rt.pending.clear();
        let min_w = rt.min_w;
        self.health.update(s, |h| {
            h.status = why;
            h.min_w = min_w;
        });
    }

    /// The log holds no record `w + 1` (its next record is `next`).
    fn hold_discontinuity(&mut self, s: u32, w: u64, next: Option<u64>) {
        self.hold(
            s,
            ShardStatus::Discontinuity { w, next },
            DISCONTINUITY_RECHECK,
        );
    }

    /// A held shard's W moved again (the lane was initialised, the log continues): running.
    fn clear_held(&mut self, s: u32) {
        if let Some(rt) = self.rts.get_mut(&s) {
            if rt.held.take().is_some() {
                rt.last_logged = None;
                tracing::info!(shard = s, "held shard moves again; running");
                self.health.update(s, |h| h.status = ShardStatus::Running);
            }
        }
    }

    /// Chunked path for a shard's pending records: write missing lane chunks, then advance.
    async fn process_pending(&mut self, s: u32) -> Result<(), Error> {
        let (mb, epoch) = {
            let rt = &self.rts[&s];
            (rt.mb, rt.epoch)
        };
        let wm = match self.mailboxes[mb].read_watermark(s).await {
            Ok(wm) => wm,
            Err(e) if e.is_corrupt() => {
                self.stop(s, ShardStatus::Corrupt(e.to_string()));
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        // Old (packed-v1) code refuses newer data here too, before writing any chunk: the
        // Rust decoder is new code and accepts both layouts (ADR-0015: old code fails closed).
        if self.mailboxes[mb].layout() == Layout::PackedV1
            && (wm.layout != Layout::PackedV1 || wm.blob_len != FULL_BLOB_BYTES)
        {
            let cause = if wm.layout != Layout::PackedV1 {
                "unknown_layout"
            } else {
                "bad_length"
            };
            self.stop(s, ShardStatus::Corrupt(format!("{cause} (packed-v1 code)")));
            return Ok(());
        }
        if wm.epoch != epoch {
            self.stop(
                s,
                ShardStatus::Fenced {
                    current_epoch: Some(wm.epoch),
                },
            );
            return Ok(());
        }
        let fault = self.opts.fault.clone();
        let rt = self.rts.get_mut(&s).expect("shard");
        let mut chunks: Vec<LaneChunk> = Vec::new();
        let mut chunk_refs: Vec<(usize, usize)> = Vec::new(); // (pending index, lane)
        for (pi, p) in rt.pending.iter_mut().enumerate() {
            for (lane, rcpts) in &p.lanes {
                let rec = wm.lanes.lane(*lane);
                if !rec.present || rec.w >= p.rec.offset || p.done.contains(lane) {
                    continue;
                }
                let attempt = p.attempts.entry(*lane).or_insert(0);
                let a = *attempt;
                *attempt += 1;
                if let Some(f) = &fault {
                    if f.fail(s, p.rec.offset, *lane, a) {
                        metrics::counter!("tidemark_chunk_failures_total").increment(1);
                        continue;
                    }
                }
                let entry =
                    encode_entry(p.rec.offset, p.rec.sent_at_us, &p.rec.sender, &p.rec.body);
                chunks.push(LaneChunk {
                    offset: p.rec.offset,
                    lane: *lane,
                    entries: rcpts.iter().map(|r| (r.clone(), entry.clone())).collect(),
                });
                chunk_refs.push((pi, *lane));
            }
        }
        if !chunks.is_empty() {
            let outs = self.mailboxes[mb]
                .write_lane_chunks(s, epoch, &chunks)
                .await?;
            for ((pi, lane), out) in chunk_refs.into_iter().zip(outs) {
                match out {
                    ChunkWritten::Done { .. } => {
                        self.rts.get_mut(&s).expect("shard").pending[pi]
                            .done
                            .insert(lane);
                    }
                    ChunkWritten::Fenced { current_epoch } => {
                        self.stop(s, ShardStatus::Fenced { current_epoch });
                        return Ok(());
                    }
                }
            }
        }
        let recs: Vec<AdvanceRecord> = self.rts[&s]
            .pending
            .iter()
            .map(Pending::advance_record)
            .collect();
        // `moved` is ORed over the parts: an early part may move lanes while the last does
        // not, and the hint must still go out.
        let mut last: Option<AdvanceCounts> = None;
        let mut moved = false;
        let mut empty_lane = None;
        for part in recs.chunks(256) {
            let adv = self.mailboxes[mb].advance_many(s, epoch, part).await?;
            match adv {
                Advance::Moved(c) | Advance::Replay(c) | Advance::Held(c) | Advance::Gap(c) => {
                    moved |= matches!(adv, Advance::Moved(_));
                    last = Some(c);
                }
                Advance::EmptyLane {
                    counts,
                    lane,
                    offset,
                } => {
                    // no later record can be taken before this one: stop here
                    moved |= counts.advanced > 0;
                    last = Some(counts);
                    empty_lane = Some((lane, offset));
                    break;
                }
                Advance::Fenced { current_epoch } => {
                    self.stop(s, ShardStatus::Fenced { current_epoch });
                    return Ok(());
                }
                Advance::Corrupt(v) => {
                    self.stop(
                        s,
                        ShardStatus::Corrupt(format!("{} lane {:?}", v.code, v.lane)),
                    );
                    return Ok(());
                }
            }
        }
        let Some(c) = last else {
            return Ok(());
        };
        let rt = self.rts.get_mut(&s).expect("shard");
        let min_w = c.min_w.unwrap_or(0);
        if moved {
            rt.moved = true;
            // recipients in lanes that moved may have new entries: hint them all
            for p in &rt.pending {
                rt.touched.extend(p.rec.recipients.iter().cloned());
            }
        }
        let first_prev = rt.pending.front().map(|p| p.rec.prev);
        let mut done = 0u64;
        while rt.pending.front().is_some_and(|p| p.rec.offset <= min_w) {
            rt.pending.pop_front();
            done += 1;
        }
        metrics::counter!("tidemark_materialized_total", "path" => "chunk").increment(done);
        rt.min_w = rt.min_w.max(min_w);
        rt.uniform = rt.pending.is_empty() && c.min_w == c.max_w;
        if let Some((lane, offset)) = empty_lane {
            // Held whole (nothing dropped): re-checked every RETRY_MAX until the lane exists.
            self.hold(s, ShardStatus::LaneEmpty { lane, offset }, RETRY_MAX);
            return Ok(());
        }
        if moved {
            self.clear_held(s);
        }
        if !moved && c.held == 0 && c.gaps > 0 && first_prev.is_some_and(|p| min_w < p) {
            tracing::warn!(shard = s, min_w, "chunked path gap: re-reading from W");
            self.resync(s).await?;
        }
        Ok(())
    }

    async fn publish_and_gc(&mut self) -> Result<(), Error> {
        let now = Instant::now();
        // one pipeline of PUBLISH per mailbox instance, not one round trip per shard
        let mut pubs: BTreeMap<usize, Vec<(u32, WakeHint)>> = BTreeMap::new();
        let mut gc_due = Vec::new();
        for rt in self.rts.values_mut() {
            // a shard stopped in this step may still have moved before: hint it
            if rt.moved {
                rt.moved = false;
                let touched = std::mem::take(&mut rt.touched);
                pubs.entry(rt.mb).or_default().push((
                    rt.shard,
                    WakeHint {
                        min_w: rt.min_w,
                        recipients: touched.into_iter().collect(),
                    },
                ));
                let min_w = rt.min_w;
                self.health.update(rt.shard, |h| {
                    h.min_w = min_w;
                    h.last_progress = now;
                });
            }
            // stopped shards too: their head and lag stay live (messages still wait there)
            if now.duration_since(rt.last_gc) >= self.opts.gc_interval {
                gc_due.push((rt.last_gc, rt.shard));
            }
        }
        // a few shards per loop (oldest first), so GC round trips never stall a batch
        gc_due.sort_unstable();
        gc_due.truncate(GC_SHARDS_PER_LOOP);
        let gc_due: Vec<u32> = gc_due.into_iter().map(|(_, s)| s).collect();
        for s in &gc_due {
            if let Some(rt) = self.rts.get_mut(s) {
                rt.last_gc = now;
            }
        }
        for (mb, hints) in pubs {
            // a lost hint is caught by the gateways' periodic re-check
            let _ = publish_wake(&self.mailboxes[mb], &hints).await;
        }
        for s in gc_due {
            // GC only frees space: a failure is retried at the next interval, nothing else
            if let Err(e) = self.gc_shard(s).await {
                tracing::warn!(shard = s, error = %e, "gc failed; retried later");
                metrics::counter!("tidemark_errors_total", "code" => "gc").increment(1);
            }
        }
        Ok(())
    }

    async fn gc_shard(&mut self, s: u32) -> Result<(), Error> {
        let mb = self.rts[&s].mb;
        if self.rts[&s].stopped {
            // no GC for a stopped shard (fenced, corrupt): only its head and lag
            let head = self.core.head(s).await?;
            self.health.update(s, |h| {
                h.head = head;
                h.log_exhausted = head >= U48_MAX;
            });
            return Ok(());
        }
        match self.mailboxes[mb].gc_completed(s, 1000).await? {
            Gc::Done { min_w, .. } => {
                let min_w = min_w.unwrap_or(0);
                if min_w > 0 {
                    self.core.trim(s, min_w).await?;
                }
                let mut head = self.core.head(s).await?;
                if head < min_w {
                    // the core instance lost commits the mailbox side already holds (restored
                    // to an earlier point, or an AOF that lost writes): the next commit would
                    // get an offset at or below W and be taken for a replay. Raise the head.
                    let max_w = self.mailboxes[mb]
                        .read_watermark(s)
                        .await?
                        .lanes
                        .max_present_w()
                        .unwrap_or(min_w);
                    if let Some(old) = self.core.raise_head(s, max_w).await? {
                        tracing::error!(
                            shard = s,
                            head = old,
                            w = max_w,
                            "core log head below W (core restored to an earlier point?); \
                             head raised to W so new commits follow it"
                        );
                        metrics::counter!("tidemark_head_raised_total").increment(1);
                        head = max_w;
                    }
                }
                let rt = self.rts.get_mut(&s).expect("shard");
                let idle = rt.pending.is_empty() && head <= min_w;
                if idle && rt.held.is_some() {
                    // caught up with the head (a rebase moved W to it): nothing is held
                    self.clear_held(s);
                }
                let rt = self.rts.get_mut(&s).expect("shard");
                if head > min_w && rt.pending.is_empty() && rt.retry.is_none() {
                    // behind the head with nothing in flight: the log must hold W + 1
                    let next = self.core.read_after(s, min_w, 1).await?;
                    let next = next.first().map(|r| r.offset);
                    if next != Some(min_w + 1) {
                        self.hold_discontinuity(s, min_w, next);
                    }
                }
                self.health.update(s, |h| {
                    h.head = head;
                    h.min_w = min_w;
                    h.log_exhausted = head >= U48_MAX;
                    if idle {
                        h.last_progress = Instant::now();
                    }
                });
            }
            Gc::Corrupt(v) => {
                self.stop(
                    s,
                    ShardStatus::Corrupt(format!("{} lane {:?}", v.code, v.lane)),
                );
            }
        }
        Ok(())
    }
}

/// Fails a given percentage of lane chunk writes, decided by a hash of (shard, offset, lane,
/// attempt), so every chunk eventually lands. For fault runs (`serve --fault-chunk-fail-pct`).
#[derive(Debug, Clone, Copy)]
pub struct RandomChunkFault {
    /// 0..=100; 100 is capped at 90 so that retries can succeed.
    pub percent: u8,
}

impl ChunkFault for RandomChunkFault {
    fn fail(&self, shard: u32, offset: u64, lane: usize, attempt: u32) -> bool {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&(shard, offset, lane, attempt), &mut h);
        let roll = std::hash::Hasher::finish(&h) % 100;
        roll < u64::from(self.percent.min(90))
    }
}
