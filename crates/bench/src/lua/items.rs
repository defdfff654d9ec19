//! The workload: what each measured item calls, the state a round starts from, and the
//! reply that proves a call took the measured (common) path.
//!
//! An [`Item`] is one line of the report: the no-op, one watermark script in one layout
//! (packed-v1 items on shard [`SHARD_V1`], packed-v2 items on [`SHARD_V2`]), or a uniform
//! check or its baseline. Call `i` of a round carries offset `BASE + 1 + i` on a watermark
//! that [`Item::prepare`] re-created uniform at [`BASE`], so every call is applied and every
//! round starts from identical state. [`written_keys`] lists every key a run may write.

use redis::aio::MultiplexedConnection;
use redis::{Cmd, Value};
use tidemark_store::keys;
use tidemark_store::redis::scripts::{self, Script};
use tidemark_store::redis::watermark::{Layout, FULL_BLOB_BYTES, LANES, LANE_BYTES};

use super::checks::{BLOB_FULL_KEY, BLOB_SHORT_KEY, CHECKS, HGET_ONLY_LUA, NOOP_LUA};
use super::{Error, MailboxStore};

/// Shard of the packed-v1 items.
pub const SHARD_V1: u32 = 1;
/// Shard of the packed-v2 items.
pub const SHARD_V2: u32 = 2;
/// W every watermark is (re)initialised at before a round; call `i` carries offset
/// `BASE + 1 + i` (16 consecutive offsets per call for the batch script).
pub const BASE: u64 = 1_000_000;
/// Epoch of the benchmark watermarks.
const EPOCH: u64 = 7;
/// Mailboxes the hot path spreads its recipients over (`mb:{s}:u0` … `u999`).
pub const MAILBOXES: usize = 1000;
/// Bytes of one hot-path mailbox entry.
pub const ENTRY_BYTES: usize = 64;
/// Records per call of `advance_log_watermarks`.
pub const BATCH_RECORDS: usize = 16;
/// `limit` argument of `gc_completed_dispatch`.
const GC_LIMIT: &str = "100";

/// What one measured item calls and expects.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Noop,
    Materialize,
    Advance,
    AdvanceMany,
    Read,
    Gc,
    /// A uniform check or its baseline (reply 1).
    Uniform {
        key: &'static str,
    },
}

/// One measured item: the script it calls (by SHA1, with its source for `SCRIPT LOAD`) and
/// how it builds its calls and checks their replies.
pub(super) struct Item {
    /// Label used in errors and as the result key (`<script>/<layout>` or a check name).
    pub(super) label: String,
    pub(super) sha: String,
    pub(super) source: String,
    kind: Kind,
    shard: u32,
    layout: Layout,
    /// Pre-formatted keys of the shard.
    wm: String,
    mailboxes: Vec<String>,
    epoch: String,
}

/// The benchmark mailboxes of `shard`: `mb:{s}:u0` … `u999`.
fn mailboxes(shard: u32) -> Vec<String> {
    (0..MAILBOXES)
        .map(|i| keys::mailbox(shard, &format!("u{i}")))
        .collect()
}

fn sha_of(source: &str) -> String {
    redis::Script::new(source).get_hash().to_string()
}

impl Item {
    fn plain(label: &str, source: &str, kind: Kind) -> Item {
        Item {
            label: label.to_string(),
            sha: sha_of(source),
            source: source.to_string(),
            kind,
            shard: 0,
            layout: Layout::PackedV2,
            wm: String::new(),
            mailboxes: Vec::new(),
            epoch: EPOCH.to_string(),
        }
    }

    fn watermark(script: &Script, layout: Layout, kind: Kind) -> Item {
        let shard = match layout {
            Layout::PackedV1 => SHARD_V1,
            Layout::PackedV2 => SHARD_V2,
        };
        let mailboxes = if matches!(kind, Kind::Materialize) {
            mailboxes(shard)
        } else {
            Vec::new()
        };
        Item {
            label: format!("{}/{}", script.name, layout.as_str()),
            sha: script.sha.clone(),
            source: script.source.clone(),
            kind,
            shard,
            layout,
            wm: keys::wm(shard),
            mailboxes,
            epoch: EPOCH.to_string(),
        }
    }

    /// The shard's watermark made afresh at [`BASE`] in [`EPOCH`]: deleted first, since a
    /// forced init over an existing one raises its epoch (ADR-0110) and the item's calls
    /// name [`EPOCH`].
    async fn reset_watermark(
        &self,
        store: &mut MailboxStore,
        conn: &mut MultiplexedConnection,
    ) -> Result<(), Error> {
        redis::cmd("DEL")
            .arg(&self.wm)
            .query_async::<()>(conn)
            .await?;
        store
            .init_watermark(self.shard, self.layout, EPOCH, BASE, false)
            .await?;
        Ok(())
    }

    /// Puts the server in this item's start state (not measured).
    pub(super) async fn prepare(
        &self,
        store: &mut MailboxStore,
        conn: &mut MultiplexedConnection,
    ) -> Result<(), Error> {
        match self.kind {
            Kind::Noop | Kind::Uniform { .. } => {}
            Kind::Materialize => {
                self.reset_watermark(store, conn).await?;
                redis::cmd("DEL")
                    .arg(&self.mailboxes)
                    .query_async::<()>(conn)
                    .await?;
            }
            Kind::Advance | Kind::AdvanceMany | Kind::Read => {
                self.reset_watermark(store, conn).await?;
            }
            Kind::Gc => {
                self.reset_watermark(store, conn).await?;
                redis::cmd("DEL")
                    .arg(keys::staging_index(self.shard))
                    .query_async::<()>(conn)
                    .await?;
            }
        }
        Ok(())
    }

    /// The `i`-th call of a round.
    pub(super) fn cmd(&self, i: usize) -> Cmd {
        let mut c = redis::cmd("EVALSHA");
        c.arg(&self.sha);
        let n = i as u64;
        match self.kind {
            Kind::Noop => {
                c.arg(0);
            }
            Kind::Materialize => {
                let off = BASE + 1 + n;
                c.arg(2)
                    .arg(&self.wm)
                    .arg(&self.mailboxes[i % MAILBOXES])
                    .arg(&self.epoch)
                    .arg(off)
                    .arg(off - 1)
                    .arg(entry(off));
            }
            Kind::Advance => {
                let off = BASE + 1 + n;
                c.arg(2)
                    .arg(&self.wm)
                    .arg(keys::staging(self.shard, off))
                    .arg(&self.epoch)
                    .arg(off)
                    .arg(off - 1)
                    .arg("");
            }
            Kind::AdvanceMany => {
                let first = BASE + 1 + n * BATCH_RECORDS as u64;
                c.arg(1 + BATCH_RECORDS).arg(&self.wm);
                for j in 0..BATCH_RECORDS as u64 {
                    c.arg(keys::staging(self.shard, first + j));
                }
                c.arg(&self.epoch);
                for j in 0..BATCH_RECORDS as u64 {
                    let off = first + j;
                    c.arg(off).arg(off - 1).arg("");
                }
            }
            Kind::Read => {
                c.arg(1).arg(&self.wm);
            }
            Kind::Gc => {
                c.arg(2)
                    .arg(&self.wm)
                    .arg(keys::staging_index(self.shard))
                    .arg(keys::staging_prefix(self.shard))
                    .arg(GC_LIMIT);
            }
            Kind::Uniform { key } => {
                c.arg(1).arg(key);
            }
        }
        c
    }

    /// Checks the reply of call `i` is the common-path outcome; else a description of it.
    pub(super) fn check(&self, i: usize, v: &Value) -> Result<(), Error> {
        let n = i as u64;
        let (ok, expected) = match self.kind {
            Kind::Noop => (int(v) == Some(0), "0".to_string()),
            Kind::Uniform { .. } => (int(v) == Some(1), "1 (uniform)".to_string()),
            Kind::Materialize => {
                let off = BASE + 1 + n;
                (
                    int(v) == Some(off as i64),
                    format!("{off} (applied: the offset)"),
                )
            }
            Kind::Advance => {
                let off = (BASE + 1 + n) as i64;
                (
                    ints(v) == Some(vec![0, LANES as i64, 0, 0, off, off]),
                    format!("{{0, 64, 0, 0, {off}, {off}}} (all lanes advanced)"),
                )
            }
            Kind::AdvanceMany => {
                let last = (BASE + (n + 1) * BATCH_RECORDS as u64) as i64;
                let moves = (LANES * BATCH_RECORDS) as i64;
                (
                    ints(v) == Some(vec![0, moves, 0, 0, last, last]),
                    format!("{{0, {moves}, 0, 0, {last}, {last}}} (all lanes advanced)"),
                )
            }
            Kind::Read => {
                let want = match self.layout {
                    Layout::PackedV1 => FULL_BLOB_BYTES,
                    Layout::PackedV2 => LANE_BYTES,
                };
                (
                    read_blob_len(v) == Some(want),
                    format!("one HGETALL of 3 fields with a {want}-byte wm_blob"),
                )
            }
            Kind::Gc => (
                gc_reply(v) == Some((vec![0, BASE as i64, 0], EPOCH.to_string())),
                format!("{{0, {BASE}, 0, \"{EPOCH}\"}} (validated, nothing staged; the epoch)"),
            ),
        };
        if ok {
            Ok(())
        } else {
            Err(Error::NotApplied {
                item: self.label.clone(),
                call: i,
                expected,
                reply: short_debug(v),
            })
        }
    }
}

/// A 64-byte mailbox entry that starts with the seq (so members are unique).
pub(super) fn entry(off: u64) -> Vec<u8> {
    let mut e = format!("{off:016x}|lua-bench|").into_bytes();
    e.resize(ENTRY_BYTES, b'.');
    e
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

fn ints(v: &Value) -> Option<Vec<i64>> {
    match v {
        Value::Array(items) => items.iter().map(int).collect(),
        _ => None,
    }
}

/// `gc_completed_dispatch`'s `{0, W, deleted, epoch}`: the three integers and the epoch.
fn gc_reply(v: &Value) -> Option<(Vec<i64>, String)> {
    let Value::Array(items) = v else {
        return None;
    };
    let [status, w, deleted, Value::BulkString(epoch)] = items.as_slice() else {
        return None;
    };
    let nums = [status, w, deleted]
        .into_iter()
        .map(int)
        .collect::<Option<Vec<_>>>()?;
    Some((nums, String::from_utf8(epoch.clone()).ok()?))
}

/// `read_log_watermarks` of one key: `[[f, v, f, v, f, v]]`; the length of `wm_blob`.
fn read_blob_len(v: &Value) -> Option<usize> {
    let Value::Array(per_key) = v else {
        return None;
    };
    let [Value::Array(flat)] = per_key.as_slice() else {
        return None;
    };
    if flat.len() != 6 {
        return None;
    }
    flat.chunks(2).find_map(|pair| match pair {
        [Value::BulkString(k), Value::BulkString(b)] if k == b"wm_blob" => Some(b.len()),
        _ => None,
    })
}

fn short_debug(v: &Value) -> String {
    let mut s = format!("{v:?}");
    if s.len() > 300 {
        let mut cut = 300;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// Every item, in measurement order: the no-op, the five watermark scripts in packed-v1 then
/// packed-v2, the two HGET-only baselines, the four uniform checks.
pub(super) fn items() -> Vec<Item> {
    let mut items = vec![Item::plain("noop", NOOP_LUA, Kind::Noop)];
    for layout in [Layout::PackedV1, Layout::PackedV2] {
        let set = scripts::for_layout(layout);
        let kinds = [
            Kind::Materialize,
            Kind::Advance,
            Kind::AdvanceMany,
            Kind::Read,
            Kind::Gc,
        ];
        for (script, kind) in set.adr_five().into_iter().zip(kinds) {
            items.push(Item::watermark(script, layout, kind));
        }
    }
    items.push(Item::plain(
        "hget_1216",
        HGET_ONLY_LUA,
        Kind::Uniform { key: BLOB_FULL_KEY },
    ));
    items.push(Item::plain(
        "hget_19",
        HGET_ONLY_LUA,
        Kind::Uniform {
            key: BLOB_SHORT_KEY,
        },
    ));
    for (name, src, key) in CHECKS {
        items.push(Item::plain(name, src, Kind::Uniform { key }));
    }
    items
}

/// Every key the run writes (and deletes at the end). The run refuses to start when any of
/// them exists: it could be someone's data.
pub(super) fn written_keys() -> Vec<String> {
    let mut k = vec![
        keys::wm(SHARD_V1),
        keys::wm(SHARD_V2),
        BLOB_FULL_KEY.to_string(),
        BLOB_SHORT_KEY.to_string(),
    ];
    for shard in [SHARD_V1, SHARD_V2] {
        k.push(keys::staging_index(shard));
        k.extend(mailboxes(shard));
    }
    k
}
