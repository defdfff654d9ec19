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

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tidemark_protocol::entry::encode_entry;
use tidemark_store::keys;
use tidemark_store::redis::dlog::{CoreStore, DispatchRecord, LogReader};
use tidemark_store::redis::store::{
    Advance, AdvanceRecord, ChunkWritten, Gc, LaneChunk, Materialized, SingleItem, Store,
};
use tidemark_store::redis::watermark::{Layout, FULL_BLOB_BYTES, LANES};
use tidemark_store::routing::route;
use tokio_util::sync::CancellationToken;

/// Most shards garbage-collected in one loop iteration.
const GC_SHARDS_PER_LOOP: usize = 4;

/// Decides whether a lane chunk write is made to fail (fault injection in tests and chaos
/// runs); `attempt` counts from 0 per (record, lane).
pub trait ChunkFault: Send + Sync {
    /// True: skip this chunk write, as if it had failed.
    fn fail(&self, shard: u32, offset: u64, lane: usize, attempt: u32) -> bool;
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

/// State of one shard as the owner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardStatus {
    /// Claiming and resuming.
    Starting,
    /// Materialising.
    Running,
    /// Another owner raised the epoch; this one stopped.
    Fenced { current_epoch: Option<u64> },
    /// The watermark is corrupt; the shard is stopped (fail closed).
    Corrupt(String),
    /// Some other failure stopped the shard.
    Failed(String),
}

/// Health of one shard, for `/healthz` and `/metrics`.
#[derive(Debug, Clone)]
pub struct ShardHealth {
    /// Current status.
    pub status: ShardStatus,
    /// Epoch this owner holds.
    pub epoch: u64,
    /// Lowest present W last seen.
    pub min_w: u64,
    /// Log head last seen (`head:{s}`).
    pub head: u64,
    /// When W last moved (or the shard was last seen idle with nothing to do).
    pub last_progress: Instant,
}

/// Shared board of shard health.
#[derive(Debug, Default)]
pub struct HealthBoard {
    shards: Mutex<BTreeMap<u32, ShardHealth>>,
}

impl HealthBoard {
    fn update(&self, shard: u32, f: impl FnOnce(&mut ShardHealth)) {
        let mut m = self.shards.lock().expect("health lock");
        let h = m.entry(shard).or_insert_with(|| ShardHealth {
            status: ShardStatus::Starting,
            epoch: 0,
            min_w: 0,
            head: 0,
            last_progress: Instant::now(),
        });
        f(h);
    }

    /// A copy of every shard's health.
    pub fn snapshot(&self) -> BTreeMap<u32, ShardHealth> {
        self.shards.lock().expect("health lock").clone()
    }

    /// Problems that make the service unhealthy: a shard not running, or one with a lag that
    /// has not moved for `stuck_after`.
    pub fn problems(&self, stuck_after: Duration) -> Vec<String> {
        let mut out = Vec::new();
        for (s, h) in self.snapshot() {
            match &h.status {
                ShardStatus::Running => {
                    if h.head > h.min_w && h.last_progress.elapsed() > stuck_after {
                        out.push(format!(
                            "shard {s}: stuck at W={} with head {} for {:?}",
                            h.min_w,
                            h.head,
                            h.last_progress.elapsed()
                        ));
                    }
                }
                ShardStatus::Starting => out.push(format!("shard {s}: starting")),
                other => out.push(format!("shard {s}: {other:?}")),
            }
        }
        out
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
    fn new(rec: DispatchRecord, shards: u32) -> Pending {
        let mut lanes: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for r in &rec.recipients {
            lanes
                .entry(route(r, shards).lane)
                .or_default()
                .push(r.clone());
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
    touched: BTreeSet<String>,
    moved: bool,
    min_w: u64,
    last_gc: Instant,
}

/// One materializer worker: the owned shards of one core instance.
pub struct Worker {
    shards_total: u32,
    core: CoreStore,
    core_url: String,
    reader: LogReader,
    mailboxes: Vec<Store>,
    rts: BTreeMap<u32, ShardRt>,
    opts: MaterializerOptions,
    health: Arc<HealthBoard>,
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
    /// Connects to the core instance and the mailbox instances, claims every shard in
    /// `shards` (each `(shard, mailbox instance index)`), and resumes each from its lowest W.
    pub async fn start(
        shards_total: u32,
        core_url: &str,
        mailboxes: Vec<Store>,
        shards: &[(u32, usize)],
        opts: MaterializerOptions,
        health: Arc<HealthBoard>,
    ) -> Result<Worker, Error> {
        let core = CoreStore::connect(core_url).await?;
        let reader = LogReader::connect(core_url).await?;
        let mut w = Worker {
            shards_total,
            core,
            core_url: core_url.to_string(),
            reader,
            mailboxes,
            rts: BTreeMap::new(),
            opts,
            health,
        };
        for &(s, mb) in shards {
            w.health.update(s, |h| h.status = ShardStatus::Starting);
            let store = &mut w.mailboxes[mb];
            let epoch = store.claim(s).await?;
            let wm = store.read_watermark(s).await?;
            let min_w = wm.lanes.min_present_w().unwrap_or(0);
            tracing::info!(
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
            });
        }
        Ok(w)
    }

    /// The core instance this worker reads.
    pub fn core_url(&self) -> &str {
        &self.core_url
    }

    fn stop(&mut self, shard: u32, status: ShardStatus) {
        if let Some(rt) = self.rts.get_mut(&shard) {
            rt.stopped = true;
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
        self.health.update(shard, |h| h.status = status);
    }

    /// Runs until `cancel` fires or every shard has stopped.
    pub async fn run(mut self, cancel: CancellationToken) -> Result<(), Error> {
        loop {
            if cancel.is_cancelled() {
                return Ok(());
            }
            let positions: Vec<(u32, u64)> = self
                .rts
                .values()
                .filter(|rt| !rt.stopped)
                .map(|rt| (rt.shard, rt.read_pos))
                .collect();
            if positions.is_empty() {
                // every shard stopped (fenced/corrupt): stay alive for /healthz, do nothing
                cancel.cancelled().await;
                return Ok(());
            }
            let any_pending = self.rts.values().any(|rt| !rt.pending.is_empty());
            let block = if any_pending {
                Duration::from_millis(20)
            } else {
                self.opts.block
            };
            let read = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                r = self.reader.read(&positions, self.opts.batch, block) => r,
            };
            let batches = match read {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, core = %self.core_url, "log read failed; retrying");
                    metrics::counter!("tidemark_errors_total", "code" => "log_read").increment(1);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if let Ok(r) = LogReader::connect(&self.core_url).await {
                        self.reader = r;
                    }
                    continue;
                }
            };
            if let Err(e) = self.step(batches).await {
                // Redis trouble: nothing is lost (the log is still there); re-read from W.
                tracing::warn!(error = %e, "materialize step failed; resyncing from W");
                metrics::counter!("tidemark_errors_total", "code" => e.code()).increment(1);
                tokio::time::sleep(Duration::from_millis(200)).await;
                let shards: Vec<u32> = self.rts.keys().copied().collect();
                for s in shards {
                    if let Err(e) = self.resync(s).await {
                        tracing::warn!(shard = s, error = %e, "resync failed");
                    }
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
        let mut hot: BTreeMap<usize, Vec<(u32, u64, Vec<SingleItem>)>> = BTreeMap::new();
        for (s, recs) in batches {
            let shards_total = self.shards_total;
            let Some(rt) = self.rts.get_mut(&s) else {
                continue;
            };
            if rt.stopped {
                continue;
            }
            let mut items = Vec::new();
            for rec in recs {
                if rec.offset <= rt.read_pos {
                    continue; // already read (a re-read after resync overlaps)
                }
                if rec.prev != rt.read_pos {
                    // a hole in what we read (log trimmed above W?): re-read from W
                    tracing::warn!(
                        shard = s,
                        prev = rec.prev,
                        read_pos = rt.read_pos,
                        "log discontinuity"
                    );
                    break;
                }
                rt.read_pos = rec.offset;
                if rt.pending.is_empty() && rt.uniform && rec.recipients.len() == 1 {
                    items.push(single_item(&rec));
                } else {
                    rt.pending.push_back(Pending::new(rec, shards_total));
                }
            }
            if !items.is_empty() {
                hot.entry(rt.mb).or_default().push((s, rt.epoch, items));
            }
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
                    let shards_total = self.shards_total;
                    let rt = self.rts.get_mut(&s).expect("shard");
                    rt.uniform = false;
                    let mut moved: Vec<Pending> = Vec::new();
                    for it in &items[i..] {
                        let rec = record_from_item(it);
                        moved.push(Pending::new(rec, shards_total));
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
        Ok(())
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
        let mut last = None;
        for part in recs.chunks(256) {
            let adv = self.mailboxes[mb].advance_many(s, epoch, part).await?;
            match adv {
                Advance::Moved(c) | Advance::Replay(c) | Advance::Held(c) | Advance::Gap(c) => {
                    last = Some((matches!(adv, Advance::Moved(_)), c));
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
        let Some((moved, c)) = last else {
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
        if !moved && c.held == 0 && c.gaps > 0 && first_prev.is_some_and(|p| min_w < p) {
            tracing::warn!(shard = s, min_w, "chunked path gap: re-reading from W");
            self.resync(s).await?;
        }
        Ok(())
    }

    async fn publish_and_gc(&mut self) -> Result<(), Error> {
        let now = Instant::now();
        // one pipeline of PUBLISH per mailbox instance, not one round trip per shard
        let mut pubs: BTreeMap<usize, redis::Pipeline> = BTreeMap::new();
        let mut gc_due = Vec::new();
        for rt in self.rts.values_mut() {
            if rt.stopped {
                continue;
            }
            if rt.moved {
                rt.moved = false;
                let touched = std::mem::take(&mut rt.touched);
                let names: Vec<&str> = touched.iter().map(String::as_str).collect();
                pubs.entry(rt.mb)
                    .or_default()
                    .cmd("PUBLISH")
                    .arg(keys::wake(rt.shard))
                    .arg(tidemark_store::wake::encode(rt.min_w, &names))
                    .ignore();
                let min_w = rt.min_w;
                self.health.update(rt.shard, |h| {
                    h.min_w = min_w;
                    h.last_progress = now;
                });
            }
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
        for (mb, pipe) in pubs {
            let mut conn = self.mailboxes[mb].connection();
            // a lost hint is caught by the gateways' periodic re-check
            let _: Result<(), _> = pipe.query_async(&mut conn).await;
        }
        for s in gc_due {
            self.gc_shard(s).await?;
        }
        Ok(())
    }

    async fn gc_shard(&mut self, s: u32) -> Result<(), Error> {
        let mb = self.rts[&s].mb;
        match self.mailboxes[mb].gc_completed(s, 1000).await? {
            Gc::Done { min_w, .. } => {
                let min_w = min_w.unwrap_or(0);
                if min_w > 0 {
                    self.core.trim(s, min_w).await?;
                }
                let head = self.core.head(s).await?;
                let rt = self.rts.get_mut(&s).expect("shard");
                let idle = rt.pending.is_empty() && head <= min_w;
                metrics::gauge!("tidemark_shard_lag", "shard" => s.to_string())
                    .set(head.saturating_sub(min_w) as f64);
                self.health.update(s, |h| {
                    h.head = head;
                    h.min_w = min_w;
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
