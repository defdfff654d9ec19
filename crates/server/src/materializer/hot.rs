//! Routing a read batch (hot items per mailbox instance, the rest to the chunked path) and
//! the hot path: records of one recipient (of up to [`MAX_HOT_RECIPIENTS`] on packed-v2,
//! ADR-0048) on a uniform watermark, pipelined across shards.

use tidemark_protocol::entry::encode_entry;
use tidemark_store::redis::dlog::DispatchRecord;
use tidemark_store::redis::store::{Materialized, SingleItem, MAX_HOT_RECIPIENTS};
use tidemark_store::redis::watermark::Layout;

use super::chunked::Pending;
use super::worker::Worker;
use super::Error;
use crate::health::ShardStatus;

/// The hot item of `rec`, which takes the record's recipients (ADR-0080: not copied; the
/// record keeps an empty list, and gets them back if it goes to the chunked path).
pub(super) fn single_item(rec: &mut DispatchRecord) -> SingleItem {
    SingleItem {
        offset: rec.offset,
        prev: rec.prev,
        recipients: std::mem::take(&mut rec.recipients),
        entry: encode_entry(rec.offset, rec.sent_at_us, &rec.sender, &rec.body),
    }
}

/// One mailbox instance's part of a routed read batch: the hot items of each shard (shard,
/// epoch, items) and, in the same order, the records they came from (whose recipients the
/// items hold).
#[derive(Default)]
struct MailboxRun {
    batches: Vec<(u32, u64, Vec<SingleItem>)>,
    recs: Vec<Vec<DispatchRecord>>,
}

/// A routed read batch: each mailbox instance's part, indexed by the instance's number (a
/// `Vec`, not a map built per step: ADR-0078); instances past the last with hot items are left
/// out, and an instance with none has an empty part.
pub(super) struct Routed {
    hot: Vec<MailboxRun>,
}

impl Worker {
    /// Routes a read batch: hot items per mailbox instance, the rest to the shards' pending
    /// queues; moves each shard's read position past what it took (so the next read can be
    /// issued before the batch is applied) and holds a shard whose log has a hole.
    pub(super) fn route(&mut self, batches: Vec<(u32, Vec<DispatchRecord>)>) -> Routed {
        // Route records: hot items per mailbox instance, the rest to pending.
        let mut holes = Vec::new();
        // with each hot item its record, in the same order: a record the script sends back
        // (NotUniform) goes to the chunked path as it was read, never decoded back
        let mut hot: Vec<MailboxRun> = Vec::new();
        let gate = self.opts.lease_gate.clone();
        for (s, recs) in batches {
            let map = &self.map;
            let Some(sh) = self.owned.get_mut(&s) else {
                continue;
            };
            if sh.stopped || gate.as_ref().is_some_and(|g| !g.may_write(s)) {
                continue;
            }
            // ADR-0048: on packed-v2 a record of a few recipients is as hot as one of one
            let most = match self.mailboxes[sh.mb].layout() {
                Layout::PackedV2 => self.opts.hot_recipients.clamp(1, MAX_HOT_RECIPIENTS),
                Layout::PackedV1 => 1,
            };
            let mut items = Vec::new();
            let mut recs_of_items = Vec::new();
            let mut hole = None;
            for mut rec in recs {
                if rec.offset <= sh.read_pos {
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
                if rec.prev != sh.read_pos {
                    // a hole in the log (trimmed above W, or W moved back by a restore)
                    hole = Some((sh.read_pos, rec.offset));
                    break;
                }
                sh.read_pos = rec.offset;
                if sh.pending.is_empty() && sh.uniform && (1..=most).contains(&rec.recipients.len())
                {
                    items.push(single_item(&mut rec));
                    recs_of_items.push(rec);
                } else {
                    sh.pending.push_back(Pending::new(rec, map));
                }
            }
            if !items.is_empty() {
                let run = super::grown_to(&mut hot, sh.mb);
                run.batches.push((s, sh.epoch, items));
                run.recs.push(recs_of_items);
            }
            if let Some((w, next)) = hole {
                // records before the hole still go through; the shard then waits
                holes.push((s, w, Some(next)));
            }
        }
        for (s, w, next) in holes {
            self.hold_discontinuity(s, w, next);
        }
        Routed { hot }
    }

    /// Applies a routed batch: the hot items (one pipeline per mailbox instance), then the
    /// pending records, then the wake hints and a little GC.
    pub(super) async fn apply(&mut self, routed: Routed) -> Result<(), Error> {
        let gate = self.opts.lease_gate.clone();
        for (mb, MailboxRun { batches, recs }) in routed.hot.into_iter().enumerate() {
            if batches.is_empty() {
                continue;
            }
            let outcomes = self.mailboxes[mb].materialize_batches(&batches).await?;
            if let Some(f) = &self.opts.fault {
                if batches
                    .iter()
                    .any(|(s, _, items)| f.lose_replies(*s, items[0].offset))
                {
                    return Err(Error::Store(tidemark_store::Error::InvalidArgument(
                        "injected fault: the step's replies were lost".into(),
                    )));
                }
            }
            for (((s, _, items), recs), outs) in batches.into_iter().zip(recs).zip(outcomes) {
                match outs {
                    Ok(outs) => self.handle_hot(s, items, recs, outs).await?,
                    // this shard alone re-reads from its W after the backoff; the others'
                    // moves are handled (hinted, handed) as usual
                    Err(e) => {
                        tracing::warn!(shard = s, error = %e, "materialize step failed for a shard; it retries from W");
                        metrics::counter!("tidemark_errors_total", "code" => e.code()).increment(1);
                        self.schedule_retry(s, &e.to_string());
                    }
                }
            }
        }
        let with_pending: Vec<u32> = self
            .owned
            .values()
            .filter(|sh| !sh.stopped && !sh.pending.is_empty())
            .filter(|sh| gate.as_ref().is_none_or(|g| g.may_write(sh.shard)))
            .map(|sh| sh.shard)
            .collect();
        for s in with_pending {
            self.process_pending(s).await?;
        }
        self.publish_and_gc().await
    }

    pub(super) async fn handle_hot(
        &mut self,
        s: u32,
        mut items: Vec<SingleItem>,
        mut recs: Vec<DispatchRecord>,
        outs: Vec<Materialized>,
    ) -> Result<(), Error> {
        let mut applied = 0u64;
        // the items taken (applied or replayed): their recipients are named in the shard's
        // next hint, once the run has been handed on
        let mut taken = 0;
        // every record applied, none replayed: W went from the first one's prev to the last
        // one's offset, and the run can be handed to this process's connections (ADR-0041)
        let mut fresh = outs.len() == items.len();
        for (i, out) in outs.into_iter().enumerate() {
            fresh &= matches!(out, Materialized::Applied { .. });
            match out {
                Materialized::Applied { .. } | Materialized::Replay { .. } => {
                    taken = i + 1;
                    let sh = self.shard_mut(s);
                    sh.moved = true;
                    sh.min_w = sh.min_w.max(items[i].offset);
                    applied += 1;
                }
                Materialized::NotUniform => {
                    // The rest goes to the chunked path, in order, ahead of later pending,
                    // each as the record it was read as (its recipients given back).
                    let moved: Vec<Pending> = recs
                        .drain(i..)
                        .zip(items.drain(i..))
                        .map(|(mut rec, item)| {
                            rec.recipients = item.recipients;
                            Pending::new(rec, &self.map)
                        })
                        .collect();
                    let sh = self.shard_mut(s);
                    sh.uniform = false;
                    for p in moved.into_iter().rev() {
                        sh.pending.push_front(p);
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
                    // named before the resync, which may fail and end the step here
                    self.name_in_hint(s, &mut items, taken);
                    taken = 0;
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
        let handed = match &self.opts.local {
            Some(local) if fresh => {
                local.deliver(s, &items);
                true
            }
            _ => false,
        };
        self.name_in_hint(s, &mut items, taken);
        if applied > 0 && !handed {
            self.shard_mut(s).unhanded = true;
        }
        crate::telemetry::hot().materialized_hot.increment(applied);
        if applied > 0 {
            self.clear_held(s);
        }
        Ok(())
    }

    /// Moves the recipients of the first `taken` items (applied or replayed) into shard
    /// `s`'s next hint (ADR-0080: moved, not copied).
    fn name_in_hint(&mut self, s: u32, items: &mut Vec<SingleItem>, taken: usize) {
        let sh = self.shard_mut(s);
        for item in items.drain(..taken) {
            sh.touched.extend(item.recipients);
        }
    }
}
