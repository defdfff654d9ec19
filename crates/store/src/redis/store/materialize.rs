//! Materialisation on [`MailboxStore`]: the hot path
//! (`materialize_fresh_single_recipient.lua`: a shard's records of 1..=[`MAX_HOT_RECIPIENTS`]
//! recipients each (ADR-0048) in runs of up to [`MAX_RUN`] records and [`MAX_RUN_ENTRIES`]
//! entries, one call per run, the runs of several shards in one pipeline), the chunked path
//! (`write_lane_chunk.lua`, then `advance_log_watermark(s).lua`) and the GC of staging state
//! (`gc_completed_dispatch.lua`).
//! The records handed in are typed here ([`SingleItem`], [`LaneChunk`], [`AdvanceRecord`]);
//! the replies are decoded in [`super::reply`].

use redis::{Cmd, Value};

use super::reply::{
    parse_advance, parse_chunk_written, parse_gc, parse_materialized, Advance, ChunkWritten, Gc,
    Materialized,
};
use super::{check_u48, MailboxStore};
use crate::error::{Error, Result};
use crate::keys;
use crate::redis::watermark::{Layout, LANES};

/// Most records of one shard in one call of the hot path (ADR-0039): enough to spread the
/// call's fixed cost (the watermark read and checks, its write-back, the script call itself)
/// thin, few enough that one call holds mailbox Redis for about half a millisecond.
pub const MAX_RUN: usize = 128;

/// Most recipients of one record on the hot path (ADR-0048): above the protocol's default
/// `max_recipients` (100), so that with the default limits every record can take it; a
/// record of more goes to the chunked path, whose calls are bounded per lane, so that no
/// one call holds mailbox Redis for long.
pub const MAX_HOT_RECIPIENTS: usize = 128;

/// Most mailbox entries written by one call of the hot path (ADR-0048): a run ends before
/// the record that would pass it (a run of one-recipient records ends at [`MAX_RUN`] first).
pub const MAX_RUN_ENTRIES: usize = 256;

/// One record for the hot path: its entry is written to each recipient's mailbox and W
/// moves past it in one atomic step.
#[derive(Debug, Clone)]
pub struct SingleItem {
    /// Log offset (= MailboxSeq).
    pub offset: u64,
    /// The record's prev offset.
    pub prev: u64,
    /// Recipient ids: one (ADR-0015's hot path) up to [`MAX_HOT_RECIPIENTS`] (ADR-0048).
    pub recipients: Vec<String>,
    /// Encoded mailbox entry (the same member in every recipient's mailbox).
    pub entry: Vec<u8>,
}

/// Splits a shard's hot items into runs of one call each: at most [`MAX_RUN`] records and
/// [`MAX_RUN_ENTRIES`] entries (each item holds 1..=[`MAX_HOT_RECIPIENTS`], checked before).
fn runs(items: &[SingleItem]) -> Vec<&[SingleItem]> {
    let mut out = Vec::new();
    let (mut start, mut entries) = (0, 0);
    for (i, it) in items.iter().enumerate() {
        let k = it.recipients.len();
        if i > start && (i - start == MAX_RUN || entries + k > MAX_RUN_ENTRIES) {
            out.push(&items[start..i]);
            (start, entries) = (i, 0);
        }
        entries += k;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// One lane's chunk of a record: its recipients in that lane and their entries.
#[derive(Debug, Clone)]
pub struct LaneChunk {
    /// Record offset.
    pub offset: u64,
    /// Lane 0..64.
    pub lane: usize,
    /// (recipient, encoded entry).
    pub entries: Vec<(String, Vec<u8>)>,
}

/// One record for `advance_log_watermark(s)`.
#[derive(Debug, Clone)]
pub struct AdvanceRecord {
    /// Log offset.
    pub offset: u64,
    /// The record's prev offset.
    pub prev: u64,
    /// Lanes that have recipients in this record (their chunk must be durable).
    pub needed: [bool; LANES],
}

impl AdvanceRecord {
    fn needed_mask(&self) -> Vec<u8> {
        self.needed
            .iter()
            .map(|&b| if b { b'1' } else { b'0' })
            .collect()
    }
}

impl MailboxStore {
    // ---- materialize_fresh_single_recipient.lua ----

    /// One call of the hot path for a run of records of one shard (ADR-0039): ADR-0015's
    /// form when every record has one recipient, else the many-recipient form (ADR-0048).
    fn materialize_cmd(&self, shard: u32, epoch: &str, run: &[SingleItem]) -> Cmd {
        let single = run.iter().all(|it| it.recipients.len() == 1);
        let keys: usize = run.iter().map(|it| it.recipients.len()).sum();
        // sized once: the watermark's and each mailbox's key, and per record its numbers
        // and entry (ADR-0071)
        let bytes: usize = run
            .iter()
            .map(|it| {
                it.entry.len() + 48 + it.recipients.iter().map(|r| r.len() + 16).sum::<usize>()
            })
            .sum::<usize>()
            + 128;
        let mut c = redis::Cmd::with_capacity(5 + keys + 4 * run.len(), bytes);
        c.arg("EVALSHA")
            .arg(&self.set.materialize_fresh_single_recipient.sha)
            .arg(keys + 1)
            .arg(keys::Key::wm(shard));
        // the keys are written into the command's buffer, with no `String` each (ADR-0082)
        for it in run {
            for r in &it.recipients {
                c.arg(keys::Key::mailbox(shard, r));
            }
        }
        c.arg(epoch);
        if single {
            for it in run {
                c.arg(it.offset).arg(it.prev).arg(&it.entry[..]);
            }
        } else {
            c.arg("m");
            for it in run {
                c.arg(it.offset)
                    .arg(it.prev)
                    .arg(it.recipients.len())
                    .arg(&it.entry[..]);
            }
        }
        c
    }

    /// Checks a shard's hot items (u48 offsets, strictly increasing: a run's replies count
    /// records in order; 1..=[`MAX_HOT_RECIPIENTS`] recipients, and more than one only on
    /// packed-v2, whose script has that form) and adds one command per run to `cmds`.
    fn push_runs(
        &self,
        cmds: &mut Vec<(u32, Cmd)>,
        shard: u32,
        epoch: u64,
        items: &[SingleItem],
    ) -> Result<()> {
        let mut last = None;
        for it in items {
            check_u48("offset", it.offset)?;
            if last.is_some_and(|l| it.offset <= l) {
                return Err(Error::InvalidArgument(format!(
                    "hot-path offsets of shard {shard} not increasing: {} after {}",
                    it.offset,
                    last.unwrap_or_default()
                )));
            }
            last = Some(it.offset);
            let k = it.recipients.len();
            let most = match self.layout() {
                Layout::PackedV2 => MAX_HOT_RECIPIENTS,
                Layout::PackedV1 => 1,
            };
            if k == 0 || k > most {
                return Err(Error::InvalidArgument(format!(
                    "hot-path record {} of shard {shard} has {k} recipients (1..={most} on {})",
                    it.offset,
                    self.layout()
                )));
            }
        }
        let e = epoch.to_string();
        for run in runs(items) {
            cmds.push((shard, self.materialize_cmd(shard, &e, run)));
        }
        Ok(())
    }

    /// The outcomes of a shard's items from the replies of its runs.
    /// One shard's outcomes from its runs' replies (taken from `replies`, one per run: all of
    /// them, even after an error, so the next shard's start where they should). The first
    /// error is the shard's; the runs before it were applied, and its re-read of W finds them.
    fn run_outcomes(
        shard: u32,
        items: &[SingleItem],
        replies: &mut impl Iterator<Item = redis::RedisResult<Value>>,
    ) -> Result<Vec<Materialized>> {
        let mut out = Ok(Vec::with_capacity(items.len()));
        for run in runs(items) {
            let r = replies.next().expect("one reply per run");
            let Ok(got) = &mut out else {
                continue;
            };
            let offsets: Vec<u64> = run.iter().map(|it| it.offset).collect();
            match r
                .map_err(Error::from)
                .and_then(|r| parse_materialized(&r, &offsets)?.ok_or(Error::NoWatermark { shard }))
            {
                Ok(o) => got.extend(o),
                Err(e) => out = Err(e),
            }
        }
        out
    }

    /// The hot path for one record.
    pub async fn materialize_single(
        &mut self,
        shard: u32,
        epoch: u64,
        item: &SingleItem,
    ) -> Result<Materialized> {
        Ok(self
            .materialize_batch(shard, epoch, std::slice::from_ref(item))
            .await?
            .pop()
            .expect("one item"))
    }

    /// The hot path for consecutive records of one shard, in log order: runs of at most
    /// [`MAX_RUN`] records, one script call each, pipelined. One outcome per record; after
    /// the first record neither applied nor a replay, the rest report gaps (or the same
    /// watermark outcome).
    pub async fn materialize_batch(
        &mut self,
        shard: u32,
        epoch: u64,
        items: &[SingleItem],
    ) -> Result<Vec<Materialized>> {
        let mut cmds = Vec::new();
        self.push_runs(&mut cmds, shard, epoch, items)?;
        let replies = self.exec_reloading(&cmds).await?;
        Self::run_outcomes(shard, items, &mut replies.into_iter())
    }

    /// Hot-path batches of several shards (all on this instance) in one pipeline; each
    /// shard's items stay in log order. Returns one outcome list per batch, or that shard's
    /// error: a script that fails on one shard (a mailbox key of another type, say) fails
    /// that shard alone, while the others' outcomes, already written, are still reported
    /// (before, the first error failed the whole batch and every other shard's moves went
    /// unreported: written, never hinted). On a Redis Cluster a shard whose node fails or
    /// does not answer within [`crate::endpoint::SHARD_CALL_TIMEOUT`] is that shard's error
    /// alone (its outcome unknown: a run may have been applied, and its re-read of W finds
    /// it), ADR-0124. The outer error: the pipeline itself failed (one instance).
    pub async fn materialize_batches(
        &mut self,
        batches: &[(u32, u64, Vec<SingleItem>)],
    ) -> Result<Vec<Result<Vec<Materialized>>>> {
        let mut cmds = Vec::new();
        for (shard, epoch, items) in batches {
            self.push_runs(&mut cmds, *shard, *epoch, items)?;
        }
        let replies = self.exec_reloading(&cmds).await?;
        let mut it = replies.into_iter();
        Ok(batches
            .iter()
            .map(|(shard, _, items)| Self::run_outcomes(*shard, items, &mut it))
            .collect())
    }

    // ---- write_lane_chunk.lua ----

    /// Writes one lane's chunk of record `offset` (`entries`: recipient, encoded entry).
    pub async fn write_lane_chunk(
        &mut self,
        shard: u32,
        epoch: u64,
        offset: u64,
        lane: usize,
        entries: &[(&str, &[u8])],
    ) -> Result<ChunkWritten> {
        check_u48("offset", offset)?;
        let wm = keys::wm(shard);
        let stg = keys::staging(shard, offset);
        let idx = keys::staging_index(shard);
        let mbs: Vec<String> = entries
            .iter()
            .map(|(r, _)| keys::mailbox(shard, r))
            .collect();
        let mut ks: Vec<&[u8]> = vec![wm.as_bytes(), stg.as_bytes(), idx.as_bytes()];
        ks.extend(mbs.iter().map(|m| m.as_bytes()));
        let (e, o, l) = (epoch.to_string(), offset.to_string(), lane.to_string());
        let mut args: Vec<&[u8]> = vec![e.as_bytes(), o.as_bytes(), l.as_bytes()];
        args.extend(entries.iter().map(|(_, en)| *en));
        let cmd = Self::evalsha(&self.set.write_lane_chunk, &ks, &args);
        let v = self.invoke(&cmd).await?;
        parse_chunk_written(shard, &v)
    }

    /// Many lane chunks (any records of one shard) in one pipeline. Returns one outcome per
    /// chunk, in order.
    pub async fn write_lane_chunks(
        &mut self,
        shard: u32,
        epoch: u64,
        chunks: &[LaneChunk],
    ) -> Result<Vec<ChunkWritten>> {
        let wm = keys::wm(shard);
        let idx = keys::staging_index(shard);
        let e = epoch.to_string();
        let mut cmds = Vec::with_capacity(chunks.len());
        for c in chunks {
            check_u48("offset", c.offset)?;
            let stg = keys::staging(shard, c.offset);
            let mbs: Vec<String> = c
                .entries
                .iter()
                .map(|(r, _)| keys::mailbox(shard, r))
                .collect();
            let mut ks: Vec<&[u8]> = vec![wm.as_bytes(), stg.as_bytes(), idx.as_bytes()];
            ks.extend(mbs.iter().map(|m| m.as_bytes()));
            let (o, l) = (c.offset.to_string(), c.lane.to_string());
            let mut args: Vec<&[u8]> = vec![e.as_bytes(), o.as_bytes(), l.as_bytes()];
            args.extend(c.entries.iter().map(|(_, en)| en.as_slice()));
            cmds.push((shard, Self::evalsha(&self.set.write_lane_chunk, &ks, &args)));
        }
        let replies = self.invoke_pipeline(&cmds).await?;
        replies
            .iter()
            .map(|v| parse_chunk_written(shard, v))
            .collect()
    }

    // ---- advance_log_watermark(s).lua ----

    /// `advance_log_watermark.lua` for one record.
    pub async fn advance(
        &mut self,
        shard: u32,
        epoch: u64,
        rec: &AdvanceRecord,
    ) -> Result<Advance> {
        check_u48("offset", rec.offset)?;
        let wm = keys::wm(shard);
        let stg = keys::staging(shard, rec.offset);
        let (e, o, p) = (
            epoch.to_string(),
            rec.offset.to_string(),
            rec.prev.to_string(),
        );
        let mask = rec.needed_mask();
        let cmd = Self::evalsha(
            &self.set.advance_log_watermark,
            &[wm.as_bytes(), stg.as_bytes()],
            &[e.as_bytes(), o.as_bytes(), p.as_bytes(), &mask],
        );
        let v = self.invoke(&cmd).await?;
        parse_advance(shard, "advance_log_watermark", &v)
    }

    /// `advance_log_watermarks.lua` for many records of one shard, in log order.
    pub async fn advance_many(
        &mut self,
        shard: u32,
        epoch: u64,
        recs: &[AdvanceRecord],
    ) -> Result<Advance> {
        let wm = keys::wm(shard);
        let stgs: Vec<String> = recs
            .iter()
            .map(|r| keys::staging(shard, r.offset))
            .collect();
        let mut ks: Vec<&[u8]> = vec![wm.as_bytes()];
        ks.extend(stgs.iter().map(|s| s.as_bytes()));
        let e = epoch.to_string();
        let mut owned: Vec<Vec<u8>> = Vec::with_capacity(recs.len() * 3);
        for r in recs {
            check_u48("offset", r.offset)?;
            owned.push(r.offset.to_string().into_bytes());
            owned.push(r.prev.to_string().into_bytes());
            owned.push(r.needed_mask());
        }
        let mut args: Vec<&[u8]> = vec![e.as_bytes()];
        args.extend(owned.iter().map(|a| a.as_slice()));
        let cmd = Self::evalsha(&self.set.advance_log_watermarks, &ks, &args);
        let v = self.invoke(&cmd).await?;
        parse_advance(shard, "advance_log_watermarks", &v)
    }

    // ---- gc_completed_dispatch.lua ----

    /// Drops staging state at or below the lowest present W (at most `limit` records).
    pub async fn gc_completed(&mut self, shard: u32, limit: u32) -> Result<Gc> {
        let wm = keys::wm(shard);
        let idx = keys::staging_index(shard);
        let prefix = keys::staging_prefix(shard);
        let lim = limit.clamp(1, 5000).to_string();
        let cmd = Self::evalsha(
            &self.set.gc_completed_dispatch,
            &[wm.as_bytes(), idx.as_bytes()],
            &[prefix.as_bytes(), lim.as_bytes()],
        );
        let v = self.invoke(&cmd).await?;
        parse_gc(shard, &v)
    }
}
