//! The watermark's own operations on [`MailboxStore`]: read (`read_log_watermarks.lua`,
//! decoded by [`super::decode_watermark`]), create (`init_watermark.lua`), fence
//! (`fence_epoch.lua`), claim and its dry run, and the offline rewrites (downgrade to
//! packed-v1, re-base after a restore) done with WATCH/MULTI.

use redis::Cmd;

use super::reply::{decode_read_reply, parse_fence, Fence};
use super::{check_u48, MailboxStore};
use crate::error::{Error, Result};
use crate::keys;
use crate::redis::watermark::{
    encode_blob, CorruptCause, LaneRecord, LaneWatermarks, Layout, ShardWatermark, FIELD_BLOB,
    FIELD_EPOCH, FIELD_LAYOUT, FULL_BLOB_BYTES, LANES,
};

impl MailboxStore {
    // ---- read_log_watermarks.lua ----

    /// Reads and decodes the watermarks of `shards` through `read_log_watermarks.lua`.
    /// Each entry is the shard's decoded watermark or its error: missing, corrupt (a
    /// `wm:{s}` that is not a hash too: [`CorruptCause::WrongType`], ADR-0123), and on a
    /// Redis Cluster a node that failed or did not answer within
    /// [`crate::endpoint::SHARD_CALL_TIMEOUT`] (ADR-0124). The outer error: the call failed
    /// as a whole (one instance that did not answer).
    pub async fn read_watermarks(&mut self, shards: &[u32]) -> Result<Vec<Result<ShardWatermark>>> {
        if self.conn.is_cluster() && shards.len() > 1 {
            // one script call cannot read keys of several slots: one per shard, and a shard
            // whose node fails is that shard's error alone
            let cmds: Vec<(u32, Cmd)> = shards
                .iter()
                .map(|&s| (s, self.read_watermarks_cmd(&[s])))
                .collect();
            let replies = self.exec_reloading(&cmds).await?;
            return Ok(shards
                .iter()
                .zip(replies)
                .map(|(&s, v)| {
                    v.map_err(Error::from)
                        .and_then(|v| decode_read_reply(&[s], &v))
                        .and_then(|mut one| one.pop().expect("one shard"))
                })
                .collect());
        }
        let cmd = self.read_watermarks_cmd(shards);
        let v = self.invoke(&cmd).await?;
        decode_read_reply(shards, &v)
    }

    pub(super) fn read_watermarks_cmd(&self, shards: &[u32]) -> Cmd {
        let keys: Vec<String> = shards.iter().map(|&s| keys::wm(s)).collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Self::evalsha(&self.set.read_log_watermarks, &key_refs, &[])
    }

    /// Reads one shard's watermark; missing and corrupt are errors.
    pub async fn read_watermark(&mut self, shard: u32) -> Result<ShardWatermark> {
        self.read_watermarks(&[shard])
            .await?
            .pop()
            .expect("one shard asked, one answer")
    }

    // ---- initialisation, fencing, downgrade ----

    /// Creates `wm:{s}` with all 64 lanes present at `w` (floor `w`), uniform, in `layout`.
    /// Refuses an existing watermark unless `force` ([`MailboxStore::init_watermark_epoch`]).
    pub async fn init_watermark(
        &mut self,
        shard: u32,
        layout: Layout,
        epoch: u64,
        w: u64,
        force: bool,
    ) -> Result<()> {
        self.init_watermark_epoch(shard, layout, epoch, w, force)
            .await
            .map(|_| ())
    }

    /// [`MailboxStore::init_watermark`], returning the epoch written: `epoch`, or with `force`
    /// over an existing watermark the larger of `epoch` and its epoch + 1, so that an
    /// overwrite never moves a shard's epoch back and fences every owner of the old one
    /// (ADR-0110).
    pub async fn init_watermark_epoch(
        &mut self,
        shard: u32,
        layout: Layout,
        epoch: u64,
        w: u64,
        force: bool,
    ) -> Result<u64> {
        check_u48("w", w)?;
        let lanes = LaneWatermarks::uniform(LaneRecord::at(w, w));
        let blob = encode_blob(layout, &lanes);
        let key = keys::wm(shard);
        // One atomic step: refuse if present (unless forced), else write all three fields.
        // not on any hot path: the script is not part of the set, and loads itself on NOSCRIPT
        static INIT: std::sync::LazyLock<crate::redis::scripts::Script> =
            std::sync::LazyLock::new(|| {
                crate::redis::scripts::Script::new(
                    "init_watermark",
                    include_str!("../lua/common/init_watermark.lua").to_string(),
                )
            });
        let written: redis::Value = INIT
            .key(&key)
            .arg(layout.as_str())
            .arg(epoch.to_string())
            .arg(blob)
            .arg(if force { "1" } else { "0" })
            .invoke(&mut self.conn)
            .await?;
        match &written {
            redis::Value::Int(0) => Err(Error::AlreadyExists { shard }),
            redis::Value::BulkString(b) => std::str::from_utf8(b)
                .ok()
                .and_then(|e| e.parse().ok())
                .ok_or_else(|| Error::UnexpectedReply {
                    script: "init_watermark",
                    detail: format!("{written:?}"),
                }),
            _ => Err(Error::UnexpectedReply {
                script: "init_watermark",
                detail: format!("{written:?}"),
            }),
        }
    }

    /// Compare-and-set of the epoch (`fence_epoch.lua`).
    pub async fn fence_epoch(&mut self, shard: u32, expected: u64, new: u64) -> Result<Fence> {
        let key = keys::wm(shard);
        let (e, n) = (expected.to_string(), new.to_string());
        let cmd = Self::evalsha(
            &self.set.fence_epoch,
            &[key.as_bytes()],
            &[e.as_bytes(), n.as_bytes()],
        );
        let v = self.invoke(&cmd).await?;
        parse_fence(shard, new, &v)
    }

    /// Reads the epoch (validating the whole watermark) and raises it by one: what a new owner
    /// does when it starts, and what `tidemark shard fence` does. Returns the new epoch.
    ///
    /// A store of packed-v1 scripts (old code) claims only a packed-v1 watermark of 1216
    /// bytes: anything else is [`Error::Corrupt`] (`unknown_layout` or `bad_length`, as its
    /// scripts would say) *before* the epoch is raised: old code never raises the epoch of a
    /// shard it cannot run, so it never fences the owner of such a shard (ADR-0015: old code
    /// fails closed; ADR-0022).
    pub async fn claim(&mut self, shard: u32) -> Result<u64> {
        loop {
            let wm = self.check_claimable(shard).await?;
            let new = wm.epoch.checked_add(1).ok_or_else(|| {
                Error::InvalidArgument(format!("shard {shard}: epoch cannot be raised above u64"))
            })?;
            match self.fence_epoch(shard, wm.epoch, new).await? {
                Fence::Raised { epoch } => return Ok(epoch),
                Fence::Lost { .. } => continue,
            }
        }
    }

    /// Reads and validates the shard's watermark and checks that this code can own it (a
    /// packed-v1 script set only owns packed-v1 data with 1216-byte blobs), writing nothing.
    /// [`MailboxStore::claim`] does this first; a process checks every shard it will own this way
    /// before it claims any, so a refusal never leaves some shards fenced.
    pub async fn check_claimable(&mut self, shard: u32) -> Result<ShardWatermark> {
        let wm = self.read_watermark(shard).await?;
        if self.set.layout == Layout::PackedV1 {
            let cause = if wm.layout != Layout::PackedV1 {
                Some(CorruptCause::UnknownLayout {
                    value: wm.layout.as_str().to_string(),
                })
            } else if wm.blob_len != FULL_BLOB_BYTES {
                Some(CorruptCause::BadLength {
                    layout: wm.layout,
                    len: wm.blob_len,
                })
            } else {
                None
            };
            if let Some(cause) = cause {
                return Err(Error::Corrupt { shard, cause });
            }
        }
        Ok(wm)
    }

    /// The ADR's offline downgrade: validates, then rewrites the blob as 1216 bytes with layout
    /// `packed-v1` (WATCH/MULTI, so a concurrent write aborts it). Owners must be stopped.
    /// Returns the watermark as it was.
    pub async fn downgrade_to_v1(&mut self, shard: u32) -> Result<ShardWatermark> {
        self.rewrite_watched(shard, "downgrade", |wm| {
            vec![
                (FIELD_LAYOUT, Layout::PackedV1.as_str().as_bytes().to_vec()),
                (FIELD_BLOB, encode_blob(Layout::PackedV1, &wm.lanes)),
                (FIELD_EPOCH, wm.epoch.to_string().into_bytes()),
            ]
        })
        .await
    }

    /// Re-bases the shard after a restore that moved W back behind a trimmed log: every
    /// present lane below `to` is set to `W = W_floor = W_recomputed = to` (the records at or
    /// below `to` that these lanes had not reached are given up: the log no longer holds
    /// them); lanes at or above `to` and empty lanes are kept. The epoch is unchanged, so a
    /// held owner resumes from `to` at its next re-check. WATCH/MULTI: a concurrent write
    /// aborts it. Returns the watermark as it was.
    pub async fn rebase_lanes(&mut self, shard: u32, to: u64) -> Result<ShardWatermark> {
        check_u48("to", to)?;
        self.rewrite_watched(shard, "rebase", |wm| {
            let mut lanes = wm.lanes.clone();
            for l in 0..LANES {
                let r = lanes.lane(l);
                if r.present && r.w < to {
                    lanes.0[l] = LaneRecord::at(to, to);
                }
            }
            vec![(FIELD_BLOB, encode_blob(wm.layout, &lanes))]
        })
        .await
    }

    /// Offline rewrite of `wm:{s}`: WATCH, read and validate, then write the fields `fields`
    /// computes from the watermark in one MULTI/EXEC (aborted by any concurrent write).
    /// Returns the watermark as it was.
    async fn rewrite_watched(
        &mut self,
        shard: u32,
        what: &str,
        fields: impl FnOnce(&ShardWatermark) -> Vec<(&'static str, Vec<u8>)>,
    ) -> Result<ShardWatermark> {
        let key = keys::wm(shard);
        redis::cmd("WATCH")
            .arg(&key)
            .query_async::<()>(&mut self.conn)
            .await?;
        let wm = match self.read_watermark(shard).await {
            Ok(wm) => wm,
            Err(e) => {
                let _: redis::RedisResult<()> =
                    redis::cmd("UNWATCH").query_async(&mut self.conn).await;
                return Err(e);
            }
        };
        let mut pipe = redis::pipe();
        let hset = pipe.atomic().cmd("HSET").arg(&key);
        for (f, v) in fields(&wm) {
            hset.arg(f).arg(v);
        }
        let res: Option<()> = hset.ignore().query_async(&mut self.conn).await?;
        if res.is_none() {
            return Err(Error::InvalidArgument(format!(
                "shard {shard}: watermark changed during the {what} (is an owner still running?)"
            )));
        }
        Ok(wm)
    }
}
