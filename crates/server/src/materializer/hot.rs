//! Routing a read batch (hot items per mailbox instance, the rest to the chunked path) and
//! the hot path: records of one recipient (of up to [`MAX_HOT_RECIPIENTS`] on packed-v2,
//! ADR-0048) on a uniform watermark, pipelined across shards.

use tidemark_protocol::entry::encode_entry;
use tidemark_store::redis::dlog::DispatchRecord;
use tidemark_store::redis::store::{Materialized, SingleItem, MAX_HOT_RECIPIENTS};
use tidemark_store::redis::watermark::Layout;

use super::chunked::Pending;
use super::stall::{bounded, step_bound};
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

    /// Applies a routed batch: the hot items (one pipeline per mailbox instance, all at once),
    /// then the pending records, then the wake hints and a little GC.
    ///
    /// ADR-0129: the instances' pipelines run at once, each bounded ([`step_bound`]), so the
    /// step waits for the slowest at most its bound, not for the sum. An instance that is left
    /// alone for not answering is not written, and one whose pipeline fails or does not answer
    /// in time puts only its own shards of the step in retry (a write given up has an unknown
    /// outcome: the retry re-reads W). The shards of the instances that answered are handled
    /// as usual. Each shard's chunked round is bounded the same way.
    pub(super) async fn apply(&mut self, routed: Routed) -> Result<(), Error> {
        let gate = self.opts.lease_gate.clone();
        let mut hot = routed.hot;
        // per instance: how long its pipeline may take (`None`: not sent: nothing for it, or
        // it is left alone; `Some(None)`: not bounded here, a cluster)
        let mut limits: Vec<Option<Option<std::time::Duration>>> = Vec::with_capacity(hot.len());
        for (mb, run) in hot.iter().enumerate() {
            if run.batches.is_empty() {
                limits.push(None);
            } else if self.stalls.ready(mb).await {
                let entries = run
                    .batches
                    .iter()
                    .flat_map(|(_, _, items)| items)
                    .map(|it| it.recipients.len())
                    .sum();
                limits.push(Some(self.stalls.limit(mb, step_bound(entries))));
            } else {
                limits.push(None);
                let why = self.stalls.error(mb).to_string();
                for (s, _, _) in &run.batches {
                    self.schedule_retry(*s, &why);
                }
            }
        }
        let calls =
            self.mailboxes
                .iter_mut()
                .zip(&hot)
                .zip(&limits)
                .filter_map(|((store, run), limit)| {
                    let limit = (*limit)?;
                    Some(bounded(limit, store.materialize_batches(&run.batches)))
                });
        let mut answers = futures::future::join_all(calls).await.into_iter();
        for (mb, MailboxRun { batches, recs }) in hot.drain(..).enumerate() {
            if limits[mb].is_none() {
                continue;
            }
            let outcomes = match answers.next().expect("one answer per pipeline sent") {
                Some(Ok(o)) => {
                    self.stalls.answered(mb);
                    o
                }
                answer => {
                    // this instance's shards of the step alone re-read from their W after the
                    // backoff; what it may have written is found there
                    let why = match answer {
                        Some(Err(e)) => {
                            self.stalls.answered(mb);
                            tracing::warn!(error = %e, mailbox = mb,
                                "materialize step failed on a mailbox instance; its shards retry from W");
                            metrics::counter!("tidemark_errors_total", "code" => e.code())
                                .increment(1);
                            e.to_string()
                        }
                        _ => {
                            self.stalls.timed_out(mb);
                            self.stalls.error(mb).to_string()
                        }
                    };
                    for (s, _, _) in &batches {
                        self.schedule_retry(*s, &why);
                    }
                    continue;
                }
            };
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
            let mb = self.owned[&s].mb;
            if !self.stalls.ready(mb).await {
                let why = self.stalls.error(mb).to_string();
                self.schedule_retry(s, &why);
                continue;
            }
            let entries = self.owned[&s]
                .pending
                .iter()
                .map(|p| p.rec.recipients.len())
                .sum();
            let limit = self.stalls.limit(mb, step_bound(entries));
            match bounded(limit, self.process_pending(s)).await {
                Some(r) => {
                    self.stalls.answered(mb);
                    r?;
                }
                None => {
                    // given up where it stood: the retry drops the shard's records and
                    // re-reads from W, whatever of the round landed
                    self.stalls.timed_out(mb);
                    let why = self.stalls.error(mb).to_string();
                    self.schedule_retry(s, &why);
                }
            }
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
