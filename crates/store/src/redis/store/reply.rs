//! Where a script reply is decoded: every reply of the mailbox scripts becomes a value here
//! and nowhere else. The status number of `{status, ...}` is decoded once into a
//! [`ScriptStatus`] (the reply convention of `lua/common/_lanes.lua`), a corrupt verdict's
//! cause string into a [`CorruptCode`]; a number or a code outside those tables is an
//! [`Error::UnexpectedReply`], never accepted as some other outcome. One `parse_*` per script
//! turns the reply into its outcome type ([`Materialized`], [`Advance`], [`ChunkWritten`],
//! [`Gc`], [`Fence`]); `read_log_watermarks.lua`'s raw fields go to
//! [`super::decode_watermark`], its marker of a key that is not a hash becomes that shard's
//! [`CorruptCause::WrongType`]. `init_watermark.lua`'s 0/1 is typed by redis-rs at its call.

use redis::Value;

use crate::error::{Error, Result};
use crate::redis::watermark::{parse_epoch, CorruptCause, CorruptCode, ShardWatermark};

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
/// [`CorruptCause`] and the lane, when lane-level.
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
    /// Staging state of `deleted` records at or below `min_w` removed. `epoch`: the
    /// watermark's epoch (ADR-0046: an owner whose epoch it no longer is has been fenced,
    /// even if no record ever tells it so); `None` when the reply has none.
    Done {
        min_w: Option<u64>,
        deleted: u32,
        epoch: Option<u64>,
    },
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

pub(super) fn as_i64(v: &Value) -> Option<i64> {
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
        self.epoch_at(1)
    }
    fn epoch_at(&self, i: usize) -> Option<u64> {
        self.items
            .get(i)
            .and_then(as_string)
            .and_then(|s| parse_epoch(s.as_bytes()))
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

// ---- read_log_watermarks.lua ----

pub(super) fn decode_read_reply(shards: &[u32], v: &Value) -> Result<Vec<Result<ShardWatermark>>> {
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
        // `{-1, 'wrong_type', TYPE}`: the key is not a hash (ADR-0123); this shard alone is
        // corrupt (a flat HGETALL reply holds strings only, never a number)
        if let [Value::Int(-1), code, found] = flat.as_slice() {
            if as_string(code).as_deref() != Some(CorruptCode::WrongType.as_str()) {
                return Err(bad());
            }
            let found = as_string(found).ok_or_else(bad)?;
            out.push(Err(Error::Corrupt {
                shard,
                cause: CorruptCause::WrongType { found },
            }));
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
        out.push(super::decode_watermark(shard, &fields));
    }
    Ok(out)
}

// ---- fence_epoch.lua ----

pub(super) fn parse_fence(shard: u32, new: u64, v: &Value) -> Result<Fence> {
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

// ---- materialize_fresh_single_recipient.lua ----

/// The reply of one run of `n` records
/// ([`MailboxStore::materialize_batch`](super::MailboxStore::materialize_batch)): one outcome per record, in order; `None` when
/// the watermark is missing. `W` alone: every record applied; `{1|2, W, replayed, applied}`:
/// the first `replayed` replays, then `applied` applied, then (status 2) a gap for the record
/// after them and, as the run stopped there, for every later one; the other statuses are
/// about the watermark and so the same for every record.
pub(super) fn parse_materialized(v: &Value, offsets: &[u64]) -> Result<Option<Vec<Materialized>>> {
    let n = offsets.len();
    // every record applied is a bare integer (W): the cheapest reply for the hot path
    if let Value::Int(w) = v {
        if offsets.last().copied() != u64::try_from(*w).ok() {
            return Err(Error::UnexpectedReply {
                script: "materialize_fresh_single_recipient",
                detail: format!("applied up to {w}, the run ends at {:?}", offsets.last()),
            });
        }
        return Ok(Some(
            offsets
                .iter()
                .map(|&offset| Materialized::Applied { offset })
                .collect(),
        ));
    }
    let r = Reply::new("materialize_fresh_single_recipient", v)?;
    let same = |m: Materialized| Ok(Some(vec![m; n]));
    match r.status()? {
        s @ (ScriptStatus::Replay | ScriptStatus::Gap) => {
            let w = r.u64_at(1)?;
            let replayed = usize::try_from(r.u64_at(2)?).map_err(|_| r.bad())?;
            let applied = usize::try_from(r.u64_at(3)?).map_err(|_| r.bad())?;
            let taken = replayed.checked_add(applied).ok_or_else(|| r.bad())?;
            let whole = s == ScriptStatus::Replay;
            if taken > n || (whole && taken != n) || (!whole && taken == n) {
                return Err(r.bad());
            }
            let mut out = Vec::with_capacity(n);
            out.extend((0..replayed).map(|_| Materialized::Replay { w }));
            out.extend(
                offsets[replayed..taken]
                    .iter()
                    .map(|&offset| Materialized::Applied { offset }),
            );
            out.extend((taken..n).map(|_| Materialized::Gap { w }));
            Ok(Some(out))
        }
        ScriptStatus::Fenced => same(Materialized::Fenced {
            current_epoch: r.epoch(),
        }),
        ScriptStatus::NotUniform => same(Materialized::NotUniform),
        ScriptStatus::Missing => Ok(None),
        ScriptStatus::Corrupt => same(Materialized::Corrupt(r.verdict()?)),
        _ => Err(r.bad()),
    }
}

// ---- write_lane_chunk.lua ----

pub(super) fn parse_chunk_written(shard: u32, v: &Value) -> Result<ChunkWritten> {
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

// ---- advance_log_watermark(s).lua ----

pub(super) fn parse_advance(shard: u32, script: &'static str, v: &Value) -> Result<Advance> {
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

// ---- gc_completed_dispatch.lua ----

pub(super) fn parse_gc(shard: u32, v: &Value) -> Result<Gc> {
    let r = Reply::new("gc_completed_dispatch", v)?;
    match r.status()? {
        ScriptStatus::Applied => Ok(Gc::Done {
            min_w: r.opt_w(1),
            deleted: r.u64_at(2)? as u32,
            epoch: r.epoch_at(3),
        }),
        ScriptStatus::Missing => Err(Error::NoWatermark { shard }),
        ScriptStatus::Corrupt => Ok(Gc::Corrupt(r.verdict()?)),
        _ => Err(r.bad()),
    }
}

// ---- ack_mailbox.lua ----

/// The answers of one call of `acks` (`(shard, user)` of each, in the call's order): two
/// values per ack, `{0, acked}` (the acked seq after it) or `{1, error}` (that ack failed).
/// A reply of another length or shape fails every ack of the call.
pub(super) fn parse_acks(acks: &[(u32, &str)], v: &Value) -> Vec<Result<u64>> {
    let bad = || Error::UnexpectedReply {
        script: "ack_mailbox",
        detail: format!("{v:?}"),
    };
    let Value::Array(items) = v else {
        return acks.iter().map(|_| Err(bad())).collect();
    };
    if items.len() != 2 * acks.len() {
        return acks.iter().map(|_| Err(bad())).collect();
    }
    acks.iter()
        .zip(items.chunks(2))
        .map(|(&(shard, user), pair)| match (&pair[0], &pair[1]) {
            (Value::Int(0), Value::Int(acked)) if *acked >= 0 => Ok(*acked as u64),
            (Value::Int(1), e) => Err(Error::AckFailed {
                shard,
                user: user.to_string(),
                detail: as_string(e).unwrap_or_else(|| format!("{e:?}")),
            }),
            _ => Err(bad()),
        })
        .collect()
}
