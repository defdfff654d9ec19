//! Typed access to the mailbox Redis: one wrapper per script, EVALSHA with NOSCRIPT
//! recovery, and the only call site of [`decode_lane_watermarks`] [ADR-0015].
//!
//! Scripts are loaded with `SCRIPT LOAD` when a [`MailboxStore`] connects. A Redis restart empties
//! the script cache; a call that meets `NOSCRIPT` reloads the whole set and repeats. For a
//! pipeline the *whole* pipeline is repeated in its original order: every watermark script is a
//! CAS on `W` and every entry write is idempotent, so the commands that had already applied
//! come back as replays and nothing is ever applied out of order.
//!
//! Script replies are turned into values ([`Materialized`], [`Advance`], …); only failures
//! that must stop the caller (Redis down, missing watermark) are [`Error`]s. A corrupt verdict
//! from Lua is a value too ([`Verdict`]), so callers handle it explicitly (fail closed).
//!
//! Every reply's status number is decoded once into a [`ScriptStatus`] (the reply convention
//! of `lua/common/_lanes.lua`) and a corrupt verdict's cause string into a [`CorruptCode`];
//! a number or a code outside those tables is an [`Error::UnexpectedReply`].

use redis::aio::ConnectionManager;
use redis::{Cmd, Value};

use super::scripts::{self, Script, ScriptSet};
use super::watermark::{
    decode_lane_watermarks, encode_blob, CorruptCause, CorruptCode, LaneRecord, LaneWatermarks,
    Layout, ShardWatermark, FIELD_BLOB, FIELD_EPOCH, FIELD_LAYOUT, FULL_BLOB_BYTES, LANES, U48_MAX,
};
use crate::error::{Error, Result};
use crate::keys;

/// The status of a script reply `{status, ...}`: the reply convention shared by the watermark
/// scripts, documented in the header of `lua/common/_lanes.lua` (the hot path's bare integer
/// reply for "applied" is decoded before the status). Which statuses a script can return
/// depends on the script; an expected status is matched by each wrapper.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScriptStatus {
    /// `{0, ...}`: applied / advanced.
    Applied,
    /// `{1, W}`: replay, the record is at or below W; nothing written.
    Replay,
    /// `{2, W}`: gap, `expected_previous` is above W; nothing advanced.
    Gap,
    /// `{3, epoch}`: fenced, the ARGV epoch differs from `wm_epoch`; nothing written.
    Fenced,
    /// `{4}`: not uniform, the hot path is not applicable; nothing written.
    NotUniform,
    /// `{5}`: missing, `wm:{s}` does not exist.
    Missing,
    /// `{6, ...}`: held, a lane's chunk is not durable yet; nothing advanced.
    Held,
    /// `{7, ..., lane, o}`: empty lane, record `o` has recipients in the empty lane `lane`.
    EmptyLane,
    /// `{-1, cause, lane}`: corrupt, `cause` is a [`CorruptCode`], `lane` a lane or -1.
    Corrupt,
}

impl ScriptStatus {
    /// Every status.
    pub const ALL: [ScriptStatus; 9] = [
        ScriptStatus::Applied,
        ScriptStatus::Replay,
        ScriptStatus::Gap,
        ScriptStatus::Fenced,
        ScriptStatus::NotUniform,
        ScriptStatus::Missing,
        ScriptStatus::Held,
        ScriptStatus::EmptyLane,
        ScriptStatus::Corrupt,
    ];

    /// The number the scripts return.
    pub fn code(self) -> i64 {
        match self {
            ScriptStatus::Applied => 0,
            ScriptStatus::Replay => 1,
            ScriptStatus::Gap => 2,
            ScriptStatus::Fenced => 3,
            ScriptStatus::NotUniform => 4,
            ScriptStatus::Missing => 5,
            ScriptStatus::Held => 6,
            ScriptStatus::EmptyLane => 7,
            ScriptStatus::Corrupt => -1,
        }
    }

    /// The status of a reply number, `None` for a number outside the convention.
    pub fn from_code(code: i64) -> Option<ScriptStatus> {
        ScriptStatus::ALL.into_iter().find(|s| s.code() == code)
    }
}

/// A corrupt verdict returned by a Lua script: the cause code of
/// [`super::watermark::CorruptCause`] and the lane, when lane-level.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Stable cause code (`field_count`, `bad_length`, …).
    pub code: CorruptCode,
    /// Lane concerned, for lane-level causes.
    pub lane: Option<usize>,
}

/// Outcome of the hot path for one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Materialized {
    /// Entry written, all lanes at `offset`.
    Applied { offset: u64 },
    /// The record is at or below W: nothing written.
    Replay { w: u64 },
    /// `expected_previous` is not W: nothing written; re-read from W.
    Gap { w: u64 },
    /// The watermark is not uniform (or is packed-v1): use the chunked path.
    NotUniform,
    /// Another owner holds the shard.
    Fenced { current_epoch: Option<u64> },
    /// The watermark is corrupt: fail closed.
    Corrupt(Verdict),
}

/// Per-call counts of an advance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdvanceCounts {
    /// Lane moves made (summed over records).
    pub advanced: u32,
    /// Lanes held back by a chunk that is not durable.
    pub held: u32,
    /// Lanes whose CAS failed (W below expected_previous).
    pub gaps: u32,
    /// Lowest W of present lanes after the call.
    pub min_w: Option<u64>,
    /// Highest W of present lanes after the call.
    pub max_w: Option<u64>,
}

/// Outcome of `advance_log_watermark(s)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advance {
    /// At least one lane moved.
    Moved(AdvanceCounts),
    /// Every present lane was already at or above the record(s).
    Replay(AdvanceCounts),
    /// Nothing moved and some lane's CAS failed.
    Gap(AdvanceCounts),
    /// Nothing moved and some lane's chunk is not durable.
    Held(AdvanceCounts),
    /// Record `offset` has recipients in `lane`, which is empty (presence 0): no lane took it
    /// or any later record (earlier records of the call may have moved: `counts.advanced`).
    /// Its messages are kept (GC never passes it); the shard needs the lane initialised.
    EmptyLane {
        /// Counts of the call.
        counts: AdvanceCounts,
        /// The empty lane the record needs.
        lane: usize,
        /// The record held.
        offset: u64,
    },
    /// Another owner holds the shard.
    Fenced { current_epoch: Option<u64> },
    /// The watermark is corrupt.
    Corrupt(Verdict),
}

/// Outcome of a lane chunk write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkWritten {
    /// Entries written (or already there) and the lane marked durable.
    Done { entries: u32 },
    /// Another owner holds the shard; nothing written.
    Fenced { current_epoch: Option<u64> },
}

/// Outcome of `gc_completed_dispatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gc {
    /// Staging state of `deleted` records at or below `min_w` removed.
    Done { min_w: Option<u64>, deleted: u32 },
    /// Corrupt watermark: nothing deleted.
    Corrupt(Verdict),
}

/// Outcome of an epoch compare-and-set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fence {
    /// The epoch is now `epoch`.
    Raised { epoch: u64 },
    /// The epoch was not the expected one.
    Lost { current_epoch: Option<u64> },
}

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

/// Connection to one mailbox Redis with the script set of one layout.
#[derive(Clone)]
pub struct MailboxStore {
    conn: ConnectionManager,
    set: &'static ScriptSet,
}

fn check_u48(what: &str, v: u64) -> Result<()> {
    if v > U48_MAX {
        return Err(Error::InvalidArgument(format!("{what} {v} exceeds u48")));
    }
    Ok(())
}

fn is_noscript(e: &redis::RedisError) -> bool {
    e.code() == Some("NOSCRIPT")
}

fn as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

fn as_string(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::Int(i) => Some(i.to_string()),
        _ => None,
    }
}

fn opt_u64(v: Option<&Value>) -> Option<u64> {
    v.and_then(as_i64)
        .and_then(|i| if i < 0 { None } else { Some(i as u64) })
}

/// The common shape of script replies: `{status, ...}`.
struct Reply<'a> {
    script: &'static str,
    items: &'a [Value],
}

impl<'a> Reply<'a> {
    fn new(script: &'static str, v: &'a Value) -> Result<Reply<'a>> {
        match v {
            Value::Array(items) if !items.is_empty() => Ok(Reply { script, items }),
            other => Err(Error::UnexpectedReply {
                script,
                detail: format!("{other:?}"),
            }),
        }
    }
    /// The reply's status; a non-number or a number outside the convention is an error.
    fn status(&self) -> Result<ScriptStatus> {
        as_i64(&self.items[0])
            .and_then(ScriptStatus::from_code)
            .ok_or_else(|| self.bad())
    }
    fn u64_at(&self, i: usize) -> Result<u64> {
        opt_u64(self.items.get(i)).ok_or_else(|| self.bad())
    }
    fn opt_w(&self, i: usize) -> Option<u64> {
        opt_u64(self.items.get(i))
    }
    fn epoch(&self) -> Option<u64> {
        self.items
            .get(1)
            .and_then(as_string)
            .and_then(|s| super::watermark::parse_epoch(s.as_bytes()))
    }
    /// The verdict of a corrupt reply `{-1, cause, lane}`; a missing or unknown cause is an
    /// error (never accepted as some code).
    fn verdict(&self) -> Result<Verdict> {
        let code = self
            .items
            .get(1)
            .and_then(as_string)
            .and_then(|c| c.parse::<CorruptCode>().ok())
            .ok_or_else(|| self.bad())?;
        let lane = self
            .items
            .get(2)
            .and_then(as_i64)
            .and_then(|l| usize::try_from(l).ok());
        Ok(Verdict { code, lane })
    }
    fn counts(&self) -> Result<AdvanceCounts> {
        let n = |i| self.u64_at(i).map(|v| v as u32);
        Ok(AdvanceCounts {
            advanced: n(1)?,
            held: n(2)?,
            gaps: n(3)?,
            min_w: self.opt_w(4),
            max_w: self.opt_w(5),
        })
    }
    fn bad(&self) -> Error {
        Error::UnexpectedReply {
            script: self.script,
            detail: format!("{:?}", self.items),
        }
    }
}

impl MailboxStore {
    /// Connects to `url`, loads the script set of `layout`.
    pub async fn connect(url: &str, layout: Layout) -> Result<MailboxStore> {
        let client = redis::Client::open(url)?;
        let cfg = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(std::time::Duration::from_secs(30)))
            .set_connection_timeout(Some(std::time::Duration::from_secs(5)))
            .set_number_of_retries(3);
        let conn = ConnectionManager::new_with_config(client, cfg).await?;
        let mut s = MailboxStore {
            conn,
            set: scripts::for_layout(layout),
        };
        s.load_scripts().await?;
        Ok(s)
    }

    /// The layout this store writes.
    pub fn layout(&self) -> Layout {
        self.set.layout
    }

    /// The script set in use.
    pub fn scripts(&self) -> &'static ScriptSet {
        self.set
    }

    /// A clone of the underlying connection, for plain commands.
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// `SCRIPT LOAD` of every script of the set.
    pub async fn load_scripts(&mut self) -> Result<()> {
        let mut pipe = redis::pipe();
        for s in self.set.all() {
            pipe.cmd("SCRIPT").arg("LOAD").arg(&s.source);
        }
        let shas: Vec<String> = pipe.query_async(&mut self.conn).await?;
        for (s, sha) in self.set.all().iter().zip(shas) {
            if sha != s.sha {
                return Err(Error::UnexpectedReply {
                    script: s.name,
                    detail: format!("SCRIPT LOAD returned {sha}, expected {}", s.sha),
                });
            }
        }
        Ok(())
    }

    fn evalsha(script: &Script, keys: &[&[u8]], args: &[&[u8]]) -> Cmd {
        let mut c = redis::cmd("EVALSHA");
        c.arg(&script.sha).arg(keys.len());
        for k in keys {
            c.arg(*k);
        }
        for a in args {
            c.arg(*a);
        }
        c
    }

    async fn invoke(&mut self, cmd: &Cmd) -> Result<Value> {
        match cmd.query_async::<Value>(&mut self.conn).await {
            Err(e) if is_noscript(&e) => {
                self.load_scripts().await?;
                Ok(cmd.query_async::<Value>(&mut self.conn).await?)
            }
            other => Ok(other?),
        }
    }

    /// Runs `cmds` as one pipeline. On NOSCRIPT anywhere, reloads and repeats the whole
    /// pipeline in order (safe: every command is a CAS or idempotent).
    async fn invoke_pipeline(&mut self, cmds: &[Cmd]) -> Result<Vec<Value>> {
        for attempt in 0..2 {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for c in cmds {
                pipe.add_command(c.clone());
            }
            let replies: Vec<redis::RedisResult<Value>> = pipe.query_async(&mut self.conn).await?;
            let mut noscript = false;
            let mut out = Vec::with_capacity(replies.len());
            for r in replies {
                match r {
                    Ok(v) => out.push(v),
                    Err(e) if is_noscript(&e) => {
                        noscript = true;
                        out.push(Value::Nil);
                    }
                    Err(e) => {
                        if !noscript {
                            return Err(e.into());
                        }
                        out.push(Value::Nil);
                    }
                }
            }
            if !noscript {
                return Ok(out);
            }
            if attempt == 0 {
                self.load_scripts().await?;
            }
        }
        Err(Error::UnexpectedReply {
            script: "pipeline",
            detail: "NOSCRIPT persisted after SCRIPT LOAD".into(),
        })
    }

    // ---- read_log_watermarks.lua + decode_lane_watermarks (its only call site) ----

    /// Reads and decodes the watermarks of `shards` through `read_log_watermarks.lua`.
    /// Each entry is the shard's decoded watermark or its error (missing / corrupt).
    pub async fn read_watermarks(&mut self, shards: &[u32]) -> Result<Vec<Result<ShardWatermark>>> {
        let cmd = self.read_watermarks_cmd(shards);
        let v = self.invoke(&cmd).await?;
        Self::decode_read_reply(shards, &v)
    }

    fn read_watermarks_cmd(&self, shards: &[u32]) -> Cmd {
        let keys: Vec<String> = shards.iter().map(|&s| keys::wm(s)).collect();
        let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        Self::evalsha(&self.set.read_log_watermarks, &key_refs, &[])
    }

    fn decode_read_reply(shards: &[u32], v: &Value) -> Result<Vec<Result<ShardWatermark>>> {
        let bad = || Error::UnexpectedReply {
            script: "read_log_watermarks",
            detail: format!("{v:?}"),
        };
        let Value::Array(per_shard) = v else {
            return Err(bad());
        };
        if per_shard.len() != shards.len() {
            return Err(bad());
        }
        let mut out = Vec::with_capacity(shards.len());
        for (&shard, raw) in shards.iter().zip(per_shard) {
            let Value::Array(flat) = raw else {
                return Err(bad());
            };
            if flat.is_empty() {
                out.push(Err(Error::NoWatermark { shard }));
                continue;
            }
            let mut fields: Vec<(&[u8], &[u8])> = Vec::with_capacity(flat.len() / 2);
            for pair in flat.chunks(2) {
                match pair {
                    [Value::BulkString(k), Value::BulkString(val)] => {
                        fields.push((k.as_slice(), val.as_slice()))
                    }
                    _ => return Err(bad()),
                }
            }
            out.push(
                decode_lane_watermarks(&fields).map_err(|cause| Error::Corrupt { shard, cause }),
            );
        }
        Ok(out)
    }

    /// Reads one shard's watermark; missing and corrupt are errors.
    pub async fn read_watermark(&mut self, shard: u32) -> Result<ShardWatermark> {
        self.read_watermarks(&[shard])
            .await?
            .pop()
            .expect("one shard asked, one answer")
    }

    /// Reads the shard's watermark and a page of a mailbox in one pipeline (watermark first,
    /// so every entry at or below the lane's W is already in the page's range). Returns the
    /// watermark and `(seq, entry)` pairs after `after`; the caller filters by the lane's W.
    pub async fn read_watermark_and_mailbox(
        &mut self,
        shard: u32,
        user: &str,
        after: u64,
        limit: usize,
    ) -> Result<(ShardWatermark, Vec<(u64, Vec<u8>)>)> {
        let wm_cmd = self.read_watermarks_cmd(&[shard]);
        let mut range = redis::cmd("ZRANGEBYSCORE");
        range
            .arg(keys::mailbox(shard, user))
            .arg(format!("({after}"))
            .arg("+inf")
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(limit);
        let replies = self.invoke_pipeline(&[wm_cmd, range]).await?;
        let wm = Self::decode_read_reply(&[shard], &replies[0])?
            .pop()
            .expect("one shard")?;
        let entries = parse_withscores(&replies[1])?;
        Ok((wm, entries))
    }

    /// A page of a mailbox with `after < seq <= upto` (no watermark read: the caller knows
    /// from a hint that everything up to `upto` is visible).
    pub async fn read_mailbox_range(
        &mut self,
        shard: u32,
        user: &str,
        after: u64,
        upto: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>> {
        let v: Value = redis::cmd("ZRANGEBYSCORE")
            .arg(keys::mailbox(shard, user))
            .arg(format!("({after}"))
            .arg(upto)
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut self.conn)
            .await?;
        parse_withscores(&v)
    }

    // ---- initialisation, fencing, downgrade ----

    /// Creates `wm:{s}` with all 64 lanes present at `w` (floor `w`), uniform, in `layout`.
    /// Refuses an existing watermark unless `force`.
    pub async fn init_watermark(
        &mut self,
        shard: u32,
        layout: Layout,
        epoch: u64,
        w: u64,
        force: bool,
    ) -> Result<()> {
        check_u48("w", w)?;
        let lanes = LaneWatermarks::uniform(LaneRecord::at(w, w));
        let blob = encode_blob(layout, &lanes);
        let key = keys::wm(shard);
        // One atomic step: refuse if present (unless forced), else write all three fields.
        // redis::Script reloads on NOSCRIPT by itself; init is not on any hot path.
        let script = redis::Script::new(include_str!("lua/common/init_watermark.lua"));
        let created: i64 = script
            .key(&key)
            .arg(layout.as_str())
            .arg(epoch.to_string())
            .arg(blob)
            .arg(if force { "1" } else { "0" })
            .invoke_async(&mut self.conn)
            .await?;
        if created == 0 {
            return Err(Error::AlreadyExists { shard });
        }
        Ok(())
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
        Self::parse_fence(shard, new, &v)
    }

    fn parse_fence(shard: u32, new: u64, v: &Value) -> Result<Fence> {
        let r = Reply::new("fence_epoch", v)?;
        match r.status()? {
            ScriptStatus::Applied => Ok(Fence::Raised { epoch: new }),
            ScriptStatus::Fenced => Ok(Fence::Lost {
                current_epoch: r.epoch(),
            }),
            ScriptStatus::Missing => Err(Error::NoWatermark { shard }),
            _ => Err(r.bad()),
        }
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

    fn parse_materialized(v: &Value) -> Result<Option<Materialized>> {
        // applied is a bare integer (the offset): the cheapest reply for the hot path
        if let Value::Int(off) = v {
            return Ok(Some(Materialized::Applied {
                offset: *off as u64,
            }));
        }
        let r = Reply::new("materialize_fresh_single_recipient", v)?;
        Ok(Some(match r.status()? {
            ScriptStatus::Replay => Materialized::Replay { w: r.u64_at(1)? },
            ScriptStatus::Gap => Materialized::Gap { w: r.u64_at(1)? },
            ScriptStatus::Fenced => Materialized::Fenced {
                current_epoch: r.epoch(),
            },
            ScriptStatus::NotUniform => Materialized::NotUniform,
            ScriptStatus::Missing => return Ok(None),
            ScriptStatus::Corrupt => Materialized::Corrupt(r.verdict()?),
            _ => return Err(r.bad()),
        }))
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
            cmds.push(self.materialize_cmd(shard, &e, it));
        }
        let replies = self.invoke_pipeline(&cmds).await?;
        replies
            .iter()
            .map(|v| Self::parse_materialized(v)?.ok_or(Error::NoWatermark { shard }))
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
                cmds.push(self.materialize_cmd(*shard, &e, it));
            }
        }
        let replies = self.invoke_pipeline(&cmds).await?;
        let mut it = replies.iter();
        let mut out = Vec::with_capacity(batches.len());
        for (shard, _, items) in batches {
            let mut v = Vec::with_capacity(items.len());
            for _ in items {
                let r = it.next().expect("one reply per command");
                v.push(Self::parse_materialized(r)?.ok_or(Error::NoWatermark { shard: *shard })?);
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
        Self::parse_chunk_written(shard, &v)
    }

    fn parse_chunk_written(shard: u32, v: &Value) -> Result<ChunkWritten> {
        let r = Reply::new("write_lane_chunk", v)?;
        match r.status()? {
            ScriptStatus::Applied => Ok(ChunkWritten::Done {
                entries: r.u64_at(1)? as u32,
            }),
            ScriptStatus::Fenced => Ok(ChunkWritten::Fenced {
                current_epoch: r.epoch(),
            }),
            ScriptStatus::Missing => Err(Error::NoWatermark { shard }),
            _ => Err(r.bad()),
        }
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
            cmds.push(Self::evalsha(&self.set.write_lane_chunk, &ks, &args));
        }
        let replies = self.invoke_pipeline(&cmds).await?;
        replies
            .iter()
            .map(|v| Self::parse_chunk_written(shard, v))
            .collect()
    }

    // ---- advance_log_watermark(s).lua ----

    fn parse_advance(shard: u32, script: &'static str, v: &Value) -> Result<Advance> {
        let r = Reply::new(script, v)?;
        Ok(match r.status()? {
            ScriptStatus::Applied => Advance::Moved(r.counts()?),
            ScriptStatus::Replay => Advance::Replay(r.counts()?),
            ScriptStatus::Gap => Advance::Gap(r.counts()?),
            ScriptStatus::Held => Advance::Held(r.counts()?),
            ScriptStatus::EmptyLane => Advance::EmptyLane {
                counts: r.counts()?,
                lane: usize::try_from(r.u64_at(6)?).map_err(|_| r.bad())?,
                offset: r.u64_at(7)?,
            },
            ScriptStatus::Fenced => Advance::Fenced {
                current_epoch: r.epoch(),
            },
            ScriptStatus::Missing => return Err(Error::NoWatermark { shard }),
            ScriptStatus::Corrupt => Advance::Corrupt(r.verdict()?),
            ScriptStatus::NotUniform => return Err(r.bad()),
        })
    }

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
        Self::parse_advance(shard, "advance_log_watermark", &v)
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
        Self::parse_advance(shard, "advance_log_watermarks", &v)
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
        Self::parse_gc(shard, &v)
    }

    fn parse_gc(shard: u32, v: &Value) -> Result<Gc> {
        let r = Reply::new("gc_completed_dispatch", v)?;
        match r.status()? {
            ScriptStatus::Applied => Ok(Gc::Done {
                min_w: r.opt_w(1),
                deleted: r.u64_at(2)? as u32,
            }),
            ScriptStatus::Missing => Err(Error::NoWatermark { shard }),
            ScriptStatus::Corrupt => Ok(Gc::Corrupt(r.verdict()?)),
            _ => Err(r.bad()),
        }
    }

    // ---- mailboxes ----

    /// Records `user`'s ack of `seq` (monotonic) and trims entries at or below it.
    /// Returns the acked seq after the call.
    pub async fn ack_mailbox(&mut self, shard: u32, user: &str, seq: u64) -> Result<u64> {
        check_u48("seq", seq)?;
        let a = keys::acks(shard);
        let mb = keys::mailbox(shard, user);
        let s = seq.to_string();
        let cmd = Self::evalsha(
            &self.set.ack_mailbox,
            &[a.as_bytes(), mb.as_bytes()],
            &[user.as_bytes(), s.as_bytes()],
        );
        let v = self.invoke(&cmd).await?;
        let r = Reply::new("ack_mailbox", &v)?;
        r.u64_at(1)
    }

    /// `user`'s acked seq (0 when never acked).
    pub async fn acked(&mut self, shard: u32, user: &str) -> Result<u64> {
        let v: Option<u64> = redis::cmd("HGET")
            .arg(keys::acks(shard))
            .arg(user)
            .query_async(&mut self.conn)
            .await?;
        Ok(v.unwrap_or(0))
    }
}

/// Parses a `ZRANGEBYSCORE … WITHSCORES` reply into `(seq, member)` pairs.
pub fn parse_withscores(v: &Value) -> Result<Vec<(u64, Vec<u8>)>> {
    let bad = || Error::UnexpectedReply {
        script: "ZRANGEBYSCORE",
        detail: format!("{v:?}"),
    };
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let mut out = Vec::with_capacity(items.len() / 2);
    for pair in items.chunks(2) {
        match pair {
            [Value::BulkString(m), score] => {
                let s = match score {
                    Value::Double(d) => *d as u64,
                    other => as_i64(other).ok_or_else(bad)? as u64,
                };
                out.push((s, m.clone()));
            }
            _ => return Err(bad()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const LANES_LUA: &str = include_str!("lua/common/_lanes.lua");
    const LAYOUT_V1_LUA: &str = include_str!("lua/v1/_layout.lua");
    const LAYOUT_V2_LUA: &str = include_str!("lua/v2/_layout.lua");
    const HOT_V1_LUA: &str = include_str!("lua/v1/materialize_fresh_single_recipient.lua");
    const HOT_V2_LUA: &str = include_str!("lua/v2/materialize_fresh_single_recipient.lua");
    const SOURCES: [(&str, &str); 5] = [
        ("common/_lanes.lua", LANES_LUA),
        ("v1/_layout.lua", LAYOUT_V1_LUA),
        ("v2/_layout.lua", LAYOUT_V2_LUA),
        ("v1/materialize_fresh_single_recipient.lua", HOT_V1_LUA),
        ("v2/materialize_fresh_single_recipient.lua", HOT_V2_LUA),
    ];

    /// The quoted strings that follow each occurrence of `prefix` in `src`.
    fn quoted_after<'a>(src: &'a str, prefix: &str) -> Vec<&'a str> {
        src.match_indices(prefix)
            .filter_map(|(i, _)| {
                let rest = &src[i + prefix.len()..];
                rest.find('\'').map(|end| &rest[..end])
            })
            .collect()
    }

    /// Every cause string a corrupt reply of these sources can carry: `corrupt('x'…)`,
    /// `{-1, 'x', …}`, and the lane checks' `return nil, 'x'` (passed on to `corrupt`).
    fn lua_cause_strings() -> BTreeSet<(&'static str, &'static str)> {
        let mut out = BTreeSet::new();
        for (name, src) in SOURCES {
            for prefix in ["corrupt('", "{-1, '", "return nil, '"] {
                for s in quoted_after(src, prefix) {
                    out.insert((name, s));
                }
            }
        }
        out
    }

    #[test]
    fn corrupt_codes_match_the_lua_sources() {
        let found = lua_cause_strings();
        for (name, s) in &found {
            assert!(
                s.parse::<CorruptCode>().is_ok(),
                "{name} returns cause {s:?}, which is not a CorruptCode"
            );
        }
        let strings: BTreeSet<&str> = found.iter().map(|(_, s)| *s).collect();
        for code in CorruptCode::ALL {
            assert!(
                strings.contains(code.as_str()),
                "CorruptCode {code} is returned by no Lua source"
            );
            assert_eq!(code.as_str().parse::<CorruptCode>(), Ok(code));
        }
        // each hot path repeats the checks on its own: it can return every code
        for (name, src) in [("v1", HOT_V1_LUA), ("v2", HOT_V2_LUA)] {
            let hot: BTreeSet<&str> = quoted_after(src, "{-1, '").into_iter().collect();
            let all: BTreeSet<&str> = CorruptCode::ALL.iter().map(|c| c.as_str()).collect();
            assert_eq!(hot, all, "{name} hot path");
        }
        assert!("bogus".parse::<CorruptCode>().is_err());
    }

    /// The status numbers of the reply-convention header of `_lanes.lua`.
    fn documented_statuses() -> BTreeSet<i64> {
        let mut lines = LANES_LUA
            .lines()
            .skip_while(|l| !l.starts_with("-- Reply conventions"))
            .skip(1)
            .take_while(|l| l.starts_with("--"));
        let mut out = BTreeSet::new();
        for l in lines.by_ref() {
            let body = l.trim_start_matches('-').trim_start();
            if let Some(rest) = body.strip_prefix('{') {
                let n: String = rest
                    .chars()
                    .take_while(|c| *c == '-' || c.is_ascii_digit())
                    .collect();
                out.insert(n.parse().expect("a status number"));
            }
        }
        out
    }

    #[test]
    fn script_statuses_match_the_lanes_header() {
        let documented = documented_statuses();
        let ours: BTreeSet<i64> = ScriptStatus::ALL.iter().map(|s| s.code()).collect();
        assert_eq!(documented, ours);
        assert_eq!(ours.len(), ScriptStatus::ALL.len(), "codes are distinct");
        for s in ScriptStatus::ALL {
            assert_eq!(ScriptStatus::from_code(s.code()), Some(s));
        }
        // every literal status these sources return is in the table
        for (name, src) in SOURCES {
            for (i, _) in src.match_indices("return {") {
                let n: String = src[i + "return {".len()..]
                    .chars()
                    .take_while(|c| *c == '-' || c.is_ascii_digit())
                    .collect();
                if n.is_empty() {
                    continue; // {status, ...} computed, or a table that is not a reply
                }
                let n: i64 = n.parse().unwrap();
                assert!(
                    ScriptStatus::from_code(n).is_some(),
                    "{name} returns status {n}"
                );
            }
        }
    }

    fn arr(items: Vec<Value>) -> Value {
        Value::Array(items)
    }
    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }
    fn int(i: i64) -> Value {
        Value::Int(i)
    }
    fn unexpected<T: std::fmt::Debug>(r: Result<T>) -> bool {
        matches!(r, Err(Error::UnexpectedReply { .. }))
    }

    #[test]
    fn hot_path_replies_decode() {
        let p = MailboxStore::parse_materialized;
        assert_eq!(
            p(&int(9)).unwrap(),
            Some(Materialized::Applied { offset: 9 })
        );
        assert_eq!(
            p(&arr(vec![int(1), int(5)])).unwrap(),
            Some(Materialized::Replay { w: 5 })
        );
        assert_eq!(
            p(&arr(vec![int(2), bulk("4")])).unwrap(),
            Some(Materialized::Gap { w: 4 })
        );
        assert_eq!(
            p(&arr(vec![int(3), bulk("12")])).unwrap(),
            Some(Materialized::Fenced {
                current_epoch: Some(12)
            })
        );
        assert_eq!(
            p(&arr(vec![int(4)])).unwrap(),
            Some(Materialized::NotUniform)
        );
        assert_eq!(p(&arr(vec![int(5)])).unwrap(), None);
        assert_eq!(
            p(&arr(vec![int(-1), bulk("bad_epoch"), int(-1)])).unwrap(),
            Some(Materialized::Corrupt(Verdict {
                code: CorruptCode::BadEpoch,
                lane: None
            }))
        );
        assert_eq!(
            p(&arr(vec![int(-1), bulk("w_mismatch"), int(0)])).unwrap(),
            Some(Materialized::Corrupt(Verdict {
                code: CorruptCode::WMismatch,
                lane: Some(0)
            }))
        );
        // unknown status, status the hot path does not return, unknown or missing cause
        assert!(unexpected(p(&arr(vec![int(8)]))));
        assert!(unexpected(p(&arr(vec![int(-2), int(1)]))));
        assert!(unexpected(p(&arr(vec![int(6), int(0)]))));
        assert!(unexpected(p(&arr(vec![int(-1), bulk("bogus"), int(-1)]))));
        assert!(unexpected(p(&arr(vec![int(-1)]))));
        assert!(unexpected(p(&arr(vec![]))));
        assert!(unexpected(p(&bulk("OK"))));
    }

    #[test]
    fn advance_replies_decode() {
        let p = |v: Value| MailboxStore::parse_advance(7, "advance_log_watermark", &v);
        let counts = AdvanceCounts {
            advanced: 1,
            held: 2,
            gaps: 3,
            min_w: Some(4),
            max_w: None,
        };
        let c = |s: i64| arr(vec![int(s), int(1), int(2), int(3), int(4), int(-1)]);
        assert_eq!(p(c(0)).unwrap(), Advance::Moved(counts));
        assert_eq!(p(c(1)).unwrap(), Advance::Replay(counts));
        assert_eq!(p(c(2)).unwrap(), Advance::Gap(counts));
        assert_eq!(p(c(6)).unwrap(), Advance::Held(counts));
        assert_eq!(
            p(arr(vec![
                int(7),
                int(1),
                int(2),
                int(3),
                int(4),
                int(-1),
                int(63),
                int(99)
            ]))
            .unwrap(),
            Advance::EmptyLane {
                counts,
                lane: 63,
                offset: 99
            }
        );
        assert_eq!(
            p(arr(vec![int(3), bulk("not-an-epoch")])).unwrap(),
            Advance::Fenced {
                current_epoch: None
            }
        );
        assert!(matches!(
            p(arr(vec![int(5)])),
            Err(Error::NoWatermark { shard: 7 })
        ));
        assert_eq!(
            p(arr(vec![int(-1), bulk("bad_presence"), int(3)])).unwrap(),
            Advance::Corrupt(Verdict {
                code: CorruptCode::BadPresence,
                lane: Some(3)
            })
        );
        assert!(unexpected(p(arr(vec![int(4)]))));
        assert!(unexpected(p(arr(vec![int(9), int(0)]))));
        assert!(unexpected(p(arr(vec![
            int(-1),
            bulk("w_too_high"),
            int(3)
        ]))));
    }

    #[test]
    fn chunk_gc_and_fence_replies_decode() {
        assert_eq!(
            MailboxStore::parse_chunk_written(1, &arr(vec![int(0), int(3)])).unwrap(),
            ChunkWritten::Done { entries: 3 }
        );
        assert_eq!(
            MailboxStore::parse_chunk_written(1, &arr(vec![int(3), bulk("2")])).unwrap(),
            ChunkWritten::Fenced {
                current_epoch: Some(2)
            }
        );
        assert!(matches!(
            MailboxStore::parse_chunk_written(1, &arr(vec![int(5)])),
            Err(Error::NoWatermark { shard: 1 })
        ));
        assert!(unexpected(MailboxStore::parse_chunk_written(
            1,
            &arr(vec![int(-1), bulk("bad_length"), int(-1)])
        )));
        assert!(unexpected(MailboxStore::parse_chunk_written(
            1,
            &arr(vec![int(42)])
        )));

        assert_eq!(
            MailboxStore::parse_gc(2, &arr(vec![int(0), int(-1), int(0)])).unwrap(),
            Gc::Done {
                min_w: None,
                deleted: 0
            }
        );
        assert_eq!(
            MailboxStore::parse_gc(2, &arr(vec![int(0), int(10), int(4)])).unwrap(),
            Gc::Done {
                min_w: Some(10),
                deleted: 4
            }
        );
        assert_eq!(
            MailboxStore::parse_gc(2, &arr(vec![int(-1), bulk("field_count"), int(-1)])).unwrap(),
            Gc::Corrupt(Verdict {
                code: CorruptCode::FieldCount,
                lane: None
            })
        );
        assert!(unexpected(MailboxStore::parse_gc(
            2,
            &arr(vec![int(-1), bulk("unknown"), int(-1)])
        )));
        assert!(unexpected(MailboxStore::parse_gc(
            2,
            &arr(vec![int(1), int(0)])
        )));

        assert_eq!(
            MailboxStore::parse_fence(3, 8, &arr(vec![int(0), bulk("8")])).unwrap(),
            Fence::Raised { epoch: 8 }
        );
        assert_eq!(
            MailboxStore::parse_fence(3, 8, &arr(vec![int(3), bulk("9")])).unwrap(),
            Fence::Lost {
                current_epoch: Some(9)
            }
        );
        assert!(matches!(
            MailboxStore::parse_fence(3, 8, &arr(vec![int(5)])),
            Err(Error::NoWatermark { shard: 3 })
        ));
        assert!(unexpected(MailboxStore::parse_fence(
            3,
            8,
            &arr(vec![int(-7)])
        )));
    }

    #[test]
    fn rust_causes_carry_their_codes() {
        let c = CorruptCause::WBelowFloor {
            lane: 2,
            w: 1,
            w_floor: 5,
        };
        assert_eq!(c.code(), CorruptCode::WBelowFloor);
        assert_eq!(c.verdict(), ("w_below_floor", Some(2)));
    }
}
