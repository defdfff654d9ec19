//! Materialisation on [`MailboxStore`]: the hot path
//! (`materialize_fresh_single_recipient.lua`: one record, a shard's batch, batches of several
//! shards in one pipeline), the chunked path (`write_lane_chunk.lua`, then
//! `advance_log_watermark(s).lua`) and the GC of staging state (`gc_completed_dispatch.lua`).
//! The records handed in are typed here ([`SingleItem`], [`LaneChunk`], [`AdvanceRecord`]);
//! the replies are decoded in [`super::reply`].

use redis::Cmd;

use super::reply::{
    parse_advance, parse_chunk_written, parse_gc, parse_materialized, Advance, ChunkWritten, Gc,
    Materialized,
};
use super::{check_u48, MailboxStore};
use crate::error::{Error, Result};
use crate::keys;
use crate::redis::watermark::LANES;

/// One record for the hot path.
#[derive(Debug, Clone)]
pub struct SingleItem {
    /// Log offset (= MailboxSeq).
    pub offset: u64,
    /// The record's prev offset.
    pub prev: u64,
    /// Recipient id.
    pub recipient: String,
    /// Encoded mailbox entry.
    pub entry: Vec<u8>,
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

    fn materialize_cmd(&self, shard: u32, epoch: &str, item: &SingleItem) -> Cmd {
        let wm = keys::wm(shard);
        let mb = keys::mailbox(shard, &item.recipient);
        let (o, p) = (item.offset.to_string(), item.prev.to_string());
        Self::evalsha(
            &self.set.materialize_fresh_single_recipient,
            &[wm.as_bytes(), mb.as_bytes()],
            &[epoch.as_bytes(), o.as_bytes(), p.as_bytes(), &item.entry],
        )
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

    /// The hot path for consecutive records of one shard, pipelined in log order. Each
    /// command CASes on W, so after the first non-applied outcome the rest report gaps.
    pub async fn materialize_batch(
        &mut self,
        shard: u32,
        epoch: u64,
        items: &[SingleItem],
    ) -> Result<Vec<Materialized>> {
        let e = epoch.to_string();
        let mut cmds = Vec::with_capacity(items.len());
        for it in items {
            check_u48("offset", it.offset)?;
            cmds.push((shard, self.materialize_cmd(shard, &e, it)));
        }
        let replies = self.invoke_pipeline(&cmds).await?;
        replies
            .iter()
            .map(|v| parse_materialized(v)?.ok_or(Error::NoWatermark { shard }))
            .collect()
    }

    /// Hot-path batches of several shards (all on this instance) in one pipeline; each
    /// shard's items stay in log order. Returns one outcome list per batch.
    pub async fn materialize_batches(
        &mut self,
        batches: &[(u32, u64, Vec<SingleItem>)],
    ) -> Result<Vec<Vec<Materialized>>> {
        let mut cmds = Vec::new();
        for (shard, epoch, items) in batches {
            let e = epoch.to_string();
            for it in items {
                check_u48("offset", it.offset)?;
                cmds.push((*shard, self.materialize_cmd(*shard, &e, it)));
            }
        }
        let replies = self.invoke_pipeline(&cmds).await?;
        let mut it = replies.iter();
        let mut out = Vec::with_capacity(batches.len());
        for (shard, _, items) in batches {
            let mut v = Vec::with_capacity(items.len());
            for _ in items {
                let r = it.next().expect("one reply per command");
                v.push(parse_materialized(r)?.ok_or(Error::NoWatermark { shard: *shard })?);
            }
            out.push(v);
        }
        Ok(out)
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
