//! The chunked path: pending records (many recipients, or a diverged watermark) get their
//! lane chunks written (idempotent), then `advance_log_watermarks` moves every lane whose
//! chunk is durable.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use std::time::{Duration, Instant};
use tidemark_protocol::entry::encode_entry;
use tidemark_store::redis::dlog::DispatchRecord;
use tidemark_store::redis::store::{
    Advance, AdvanceCounts, AdvanceRecord, ChunkWritten, LaneChunk,
};
use tidemark_store::redis::watermark::{Layout, ShardWatermark, FULL_BLOB_BYTES, LANES};
use tidemark_store::topology::ShardMap;

use super::worker::Worker;
use super::{Error, RETRY_MAX};
use crate::health::ShardStatus;

pub(super) struct Pending {
    pub(super) rec: DispatchRecord,
    /// Recipients by lane.
    pub(super) lanes: BTreeMap<usize, Vec<String>>,
    /// Lanes whose chunk is durable.
    pub(super) done: BTreeSet<usize>,
    /// Attempts per lane (for fault injection and logs).
    pub(super) attempts: HashMap<usize, u32>,
}

impl Pending {
    pub(super) fn new(rec: DispatchRecord, map: &ShardMap) -> Pending {
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

    pub(super) fn advance_record(&self) -> AdvanceRecord {
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

/// How long the chunked path's rounds may move nothing while a lane is held before the
/// chunks marked written are written again (ADR-0112). Rounds come every ~20 ms while
/// records are pending: rewriting on each would multiply the writes of a lane held by a
/// failing chunk; once a second is enough for the rare chunk the instance lost.
pub(super) const REWRITE_HELD_AFTER: Duration = Duration::from_secs(1);

/// What one round of advances did (ORed over its parts).
struct Advanced {
    /// Counts of the last part (its `min_w`/`max_w` are the shard's after the round).
    counts: AdvanceCounts,
    /// Some part moved a lane: hints go out.
    moved: bool,
    /// Some part held a lane (a needed chunk not found written).
    held: bool,
    /// A record needs an empty lane (`(lane, offset)`): nothing after it can be taken.
    empty_lane: Option<(usize, u64)>,
}

impl Worker {
    /// Chunked path for a shard's pending records: write missing lane chunks, then advance,
    /// then drop what W covers. Each step may stop (fenced, corrupt) or hold the shard.
    pub(super) async fn process_pending(&mut self, s: u32) -> Result<(), Error> {
        let Some(wm) = self.ownable_watermark(s).await? else {
            return Ok(());
        };
        if !self.write_missing_chunks(s, &wm).await? {
            return Ok(());
        }
        let Some(adv) = self.advance_pending(s).await? else {
            return Ok(());
        };
        self.settle_pending(s, adv).await
    }

    /// The shard's watermark, if this worker may still write it: `None` after stopping the
    /// shard (corrupt, fenced, or newer data than packed-v1 code may touch).
    async fn ownable_watermark(&mut self, s: u32) -> Result<Option<ShardWatermark>, Error> {
        let (mb, epoch) = {
            let sh = &self.owned[&s];
            (sh.mb, sh.epoch)
        };
        let wm = match self.mailboxes[mb].read_watermark(s).await {
            Ok(wm) => wm,
            Err(e) if e.is_corrupt() => {
                self.stop(s, ShardStatus::Corrupt(e.to_string()));
                return Ok(None);
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
            return Ok(None);
        }
        if wm.epoch != epoch {
            let current_epoch = Some(wm.epoch);
            self.stop(s, ShardStatus::Fenced { current_epoch });
            return Ok(None);
        }
        Ok(Some(wm))
    }

    /// Writes the lane chunk of every pending record whose lane is present, behind the record
    /// and not yet durable (fault injection may skip some). False: the shard was fenced.
    async fn write_missing_chunks(&mut self, s: u32, wm: &ShardWatermark) -> Result<bool, Error> {
        let fault = self.opts.fault.clone();
        let sh = self.shard_mut(s);
        let (mb, epoch) = (sh.mb, sh.epoch);
        let mut chunks: Vec<LaneChunk> = Vec::new();
        let mut chunk_refs: Vec<(usize, usize)> = Vec::new(); // (pending index, lane)
        for (pi, p) in sh.pending.iter_mut().enumerate() {
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
        if chunks.is_empty() {
            return Ok(true);
        }
        let outs = self.mailboxes[mb]
            .write_lane_chunks(s, epoch, &chunks)
            .await?;
        for ((pi, lane), out) in chunk_refs.into_iter().zip(outs) {
            match out {
                ChunkWritten::Done { .. } => {
                    let p = &mut self.shard_mut(s).pending[pi];
                    p.done.insert(lane);
                    if let Some(f) = &fault {
                        f.chunk_written(s, p.rec.offset, lane);
                    }
                }
                ChunkWritten::Fenced { current_epoch } => {
                    self.stop(s, ShardStatus::Fenced { current_epoch });
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Advances the lanes of every pending record, 256 records a call. `None`: nothing was
    /// called, or the shard was stopped (fenced, corrupt).
    async fn advance_pending(&mut self, s: u32) -> Result<Option<Advanced>, Error> {
        let sh = &self.owned[&s];
        let (mb, epoch) = (sh.mb, sh.epoch);
        let recs: Vec<AdvanceRecord> = sh.pending.iter().map(Pending::advance_record).collect();
        // `moved` is ORed over the parts: an early part may move lanes while the last does
        // not, and the hint must still go out.
        let mut last: Option<AdvanceCounts> = None;
        let mut moved = false;
        let mut held = false;
        let mut empty_lane = None;
        for part in recs.chunks(256) {
            let adv = self.mailboxes[mb].advance_many(s, epoch, part).await?;
            match adv {
                Advance::Moved(c) | Advance::Replay(c) | Advance::Held(c) | Advance::Gap(c) => {
                    moved |= matches!(adv, Advance::Moved(_));
                    held |= c.held > 0;
                    last = Some(c);
                }
                Advance::EmptyLane {
                    counts,
                    lane,
                    offset,
                } => {
                    // no later record can be taken before this one: stop here
                    moved |= counts.advanced > 0;
                    held |= counts.held > 0;
                    last = Some(counts);
                    empty_lane = Some((lane, offset));
                    break;
                }
                Advance::Fenced { current_epoch } => {
                    self.stop(s, ShardStatus::Fenced { current_epoch });
                    return Ok(None);
                }
                Advance::Corrupt(v) => {
                    self.stop(
                        s,
                        ShardStatus::Corrupt(format!("{} lane {:?}", v.code, v.lane)),
                    );
                    return Ok(None);
                }
            }
        }
        Ok(last.map(|counts| Advanced {
            counts,
            moved,
            held,
            empty_lane,
        }))
    }

    /// After a round of advances: hint the recipients, drop the records W covers, and hold
    /// (an empty lane), resume (W moved) or re-read from W (a gap).
    async fn settle_pending(&mut self, s: u32, adv: Advanced) -> Result<(), Error> {
        let c = adv.counts;
        let sh = self.shard_mut(s);
        let min_w = c.min_w.unwrap_or(0);
        if adv.moved {
            sh.moved = true;
            sh.unhanded = true;
            // recipients in lanes that moved may have new entries: hint them all
            for p in &sh.pending {
                sh.touched.extend(p.rec.recipients.iter().cloned());
            }
        }
        let first_prev = sh.pending.front().map(|p| p.rec.prev);
        let mut done = 0u64;
        while sh.pending.front().is_some_and(|p| p.rec.offset <= min_w) {
            sh.pending.pop_front();
            done += 1;
        }
        metrics::counter!("tidemark_materialized_total", "path" => "chunk").increment(done);
        sh.min_w = sh.min_w.max(min_w);
        sh.uniform = sh.pending.is_empty() && c.min_w == c.max_w;
        if let Some((lane, offset)) = adv.empty_lane {
            // Held whole (nothing dropped): re-checked every RETRY_MAX until the lane exists.
            self.hold(s, ShardStatus::LaneEmpty { lane, offset }, RETRY_MAX);
            return Ok(());
        }
        if adv.moved {
            self.clear_held(s);
        }
        let sh = self.shard_mut(s);
        // The hold's clock starts over only when the shard's lowest W rises (or nothing is
        // held), never because some lane moved (ADR-0119): while the shard keeps receiving,
        // each new record is pending behind the held one and moves the other lanes on every
        // round, and a clock reset by any move never reached `REWRITE_HELD_AFTER`. The
        // lowest W cannot rise past a held lane, so it stops rising within a few rounds.
        let since = match sh.held_since {
            _ if !adv.held => None,
            Some((since, w)) if min_w <= w => Some(since),
            _ => Some(Instant::now()),
        };
        sh.held_since = since.map(|t| (t, min_w));
        if let Some(since) = since {
            // A lane held by a chunk marked written: its write failed this round (it is
            // retried anyway), or the instance no longer has it (a failover to a replica that
            // had not received it). Before, such a chunk was never written again and the lane
            // stayed held for ever. Written again once the hold has lasted
            // `REWRITE_HELD_AFTER` (the writes are idempotent; lanes W covers are skipped).
            if since.elapsed() >= REWRITE_HELD_AFTER {
                let mut cleared = 0;
                for p in &mut sh.pending {
                    cleared += p.done.len();
                    p.done.clear();
                }
                sh.held_since = None;
                if cleared > 0 {
                    metrics::counter!("tidemark_chunks_rewritten_total").increment(cleared as u64);
                    tracing::warn!(
                        shard = s,
                        chunks = cleared,
                        "a lane stayed held with its chunks written: writing them again"
                    );
                }
            }
        }
        if !adv.moved && c.held == 0 && c.gaps > 0 && first_prev.is_some_and(|p| min_w < p) {
            tracing::warn!(shard = s, min_w, "chunked path gap: re-reading from W");
            self.resync(s).await?;
        }
        Ok(())
    }
}
