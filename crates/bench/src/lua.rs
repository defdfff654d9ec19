//! The Lua micro-benchmark of ADR-0015: server-side µs per `EVALSHA` call.
//!
//! What is measured, each item in isolation on one `redis-server`:
//!
//! 1. a no-op `EVALSHA` (`return 0`): the fixed cost of calling any script;
//! 2. each of the five watermark scripts, in its packed-v1 and its packed-v2 form, on its
//!    common path (uniform watermark, every call applied);
//! 3. the four uniform checks the ADR compares (`two_sub`, `rep`, `byte_loop` on a 1216-byte
//!    uniform blob, `length` on the 19-byte blob), each as `HGET` + check, minus an otherwise
//!    identical script that only does the `HGET`.
//!
//! How: for one measurement, `CONFIG RESETSTAT`, then `calls_per_round` calls pipelined
//! [`PIPELINE`] at a time, then `INFO commandstats` gives `cmdstat_evalsha:calls=…,usec=…`;
//! `usec / calls` is the µs per call as timed by Redis itself (the whole script, nested
//! `redis.call`s included; no network, no client). Nothing else may run `EVALSHA` on the server
//! meanwhile: the call count must match exactly, else the run fails. Every reply is checked
//! against the expected common-path outcome (e.g. status 0, all 64 lanes advanced), so a figure
//! is never the cost of an early exit. One warm-up round of every item runs first; then rounds
//! are interleaved (round r of every item before round r+1 of any), so slow drift on a busy
//! machine hits v1 and v2 alike; each figure is the median of its rounds.
//!
//! State: before each round of a watermark item its `wm:{s}` is re-created uniform at
//! [`BASE`] (`MailboxStore::init_watermark`, forced) and, for the hot path, the benchmark mailboxes are
//! deleted, so every round starts from identical state and memory stays bounded. packed-v1
//! items use shard [`SHARD_V1`], packed-v2 items shard [`SHARD_V2`].
//!
//! With `redis_url` the benchmark runs against that server instead of its own: it resets the
//! server's statistics, writes the keys of shards [`SHARD_V1`] and [`SHARD_V2`] and deletes
//! them at the end. It refuses to start if any key it would write already exists (never
//! point it at a Redis that holds real shards), and fails if another client runs `EVALSHA`
//! meanwhile (the call counts would not match).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{Cmd, RedisResult, Value};
use serde::Serialize;
use tidemark_redis_proc::RedisProcess;
use tidemark_store::keys;
use tidemark_store::redis::scripts::{self, Script};
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::{
    encode_packed_v1, encode_packed_v2, LaneRecord, LaneWatermarks, Layout, FULL_BLOB_BYTES, LANES,
    LANE_BYTES,
};

/// Commands per pipeline.
pub const PIPELINE: usize = 500;
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

/// Layout names, as used in the report.
const V1: &str = "packed-v1";
const V2: &str = "packed-v2";

/// Keys of the uniform-check blobs (one slot, outside any shard's keys).
const BLOB_FULL_KEY: &str = "lua-bench:{blob}:1216";
const BLOB_SHORT_KEY: &str = "lua-bench:{blob}:19";

/// No-op script: the fixed cost of an `EVALSHA`.
pub const NOOP_LUA: &str = "return 0";

/// Baseline of the uniform checks: only the `HGET`, otherwise identical to the checks.
pub const HGET_ONLY_LUA: &str = "local blob = redis.call('HGET', KEYS[1], 'wm_blob')
local ok = true
if ok then return 1 end
return 0";

/// ADR-0011's check: two ~1197-byte substrings compared.
pub const TWO_SUB_LUA: &str = "local blob = redis.call('HGET', KEYS[1], 'wm_blob')
local ok = string.sub(blob, 20) == string.sub(blob, 1, -20)
if ok then return 1 end
return 0";

/// The first record repeated 64 times, compared.
pub const REP_LUA: &str = "local blob = redis.call('HGET', KEYS[1], 'wm_blob')
local ok = string.rep(string.sub(blob, 1, 19), 64) == blob
if ok then return 1 end
return 0";

/// Byte by byte, each byte against the one a lane earlier.
pub const BYTE_LOOP_LUA: &str = "local blob = redis.call('HGET', KEYS[1], 'wm_blob')
local ok = true
for i = 20, 1216 do
  if string.byte(blob, i) ~= string.byte(blob, i - 19) then ok = false break end
end
if ok then return 1 end
return 0";

/// packed-v2's check: the length alone.
pub const LENGTH_LUA: &str = "local blob = redis.call('HGET', KEYS[1], 'wm_blob')
local ok = #blob == 19
if ok then return 1 end
return 0";

/// The four uniform checks, in report order: (name, source, blob key).
const CHECKS: [(&str, &str, &str); 4] = [
    ("two_sub", TWO_SUB_LUA, BLOB_FULL_KEY),
    ("rep", REP_LUA, BLOB_FULL_KEY),
    ("byte_loop", BYTE_LOOP_LUA, BLOB_FULL_KEY),
    ("length", LENGTH_LUA, BLOB_SHORT_KEY),
];

/// Errors of the Lua benchmark; [`Error::code`] is stable.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `calls_per_round` or `rounds` is zero.
    #[error("invalid options: {0}")]
    InvalidOptions(String),
    /// The private redis-server could not be started.
    #[error("redis-server: {0}")]
    RedisProcess(#[from] tidemark_redis_proc::Error),
    /// A Redis command failed (connection, protocol, script error).
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Setting up a watermark through the store failed.
    #[error("store: {0}")]
    Store(#[from] tidemark_store::Error),
    /// The server already holds keys the benchmark would overwrite.
    #[error("refusing to overwrite existing keys {keys:?}: run the benchmark against a scratch Redis (or without --redis)")]
    KeysExist { keys: Vec<String> },
    /// A call did not take the path being measured (e.g. not applied): the figure would lie.
    #[error(
        "{item}: call {call} did not take the measured path: expected {expected}, got {reply}"
    )]
    NotApplied {
        item: String,
        call: usize,
        expected: String,
        reply: String,
    },
    /// `INFO commandstats` was missing, unparsable, or counted other calls than ours.
    #[error("{item}: INFO commandstats: {detail}")]
    Stats { item: String, detail: String },
    /// `SCRIPT LOAD` answered another SHA1 than the script's.
    #[error("{item}: SCRIPT LOAD returned {got}, expected {expected}")]
    ScriptLoad {
        item: String,
        got: String,
        expected: String,
    },
    /// `NOSCRIPT` came back even right after `SCRIPT LOAD`.
    #[error("{item}: NOSCRIPT persisted after SCRIPT LOAD")]
    NoScript { item: String },
}

impl Error {
    /// A stable, machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Error::InvalidOptions(_) => "invalid_options",
            Error::RedisProcess(_) => "redis_process",
            Error::Redis(_) => "redis",
            Error::Store(_) => "store",
            Error::KeysExist { .. } => "keys_exist",
            Error::NotApplied { .. } => "not_applied",
            Error::Stats { .. } => "stats",
            Error::ScriptLoad { .. } => "script_load",
            Error::NoScript { .. } => "noscript",
        }
    }
}

/// How to run the benchmark.
#[derive(Debug, Clone)]
pub struct LuaBenchOptions {
    /// Redis to measure; `None` (default) starts a private `redis-server`.
    pub redis_url: Option<String>,
    /// Calls per measured round of each item (default 20000).
    pub calls_per_round: usize,
    /// Measured rounds per item, after one warm-up round (default 7); figures are medians.
    pub rounds: usize,
}

impl Default for LuaBenchOptions {
    fn default() -> Self {
        LuaBenchOptions {
            redis_url: None,
            calls_per_round: 20_000,
            rounds: 7,
        }
    }
}

/// Result of one run: medians of server-side µs per `EVALSHA` call.
#[derive(Debug, Clone, Serialize)]
pub struct LuaBenchReport {
    /// `redis_version` of the measured server.
    pub redis_version: String,
    /// `return 0`.
    pub noop_evalsha_us: f64,
    /// Script name (file name without `.lua`) → `{"packed-v1": µs, "packed-v2": µs}`.
    /// `advance_log_watermarks` is per call of [`BATCH_RECORDS`] records.
    pub scripts: BTreeMap<String, BTreeMap<String, f64>>,
    /// `two_sub`, `rep`, `byte_loop`, `length`: µs of the check itself (HGET + check minus
    /// HGET only; may be slightly negative when the check costs less than the noise).
    pub uniform_checks_us: BTreeMap<String, f64>,
    /// Measured rounds per item.
    pub rounds: usize,
    /// Calls per round.
    pub calls_per_round: usize,
    /// Raw µs of the uniform-check scripts and their baselines (`hget_1216`, `hget_19`).
    #[serde(skip)]
    uniform_raw_us: BTreeMap<String, f64>,
}

// ---------------------------------------------------------------------------------------
// items

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

struct Item {
    /// Label used in errors and as the result key (`<script>/<layout>` or a check name).
    label: String,
    sha: String,
    source: String,
    kind: Kind,
    shard: u32,
    layout: Layout,
    /// Pre-formatted keys of the shard.
    wm: String,
    mailboxes: Vec<String>,
    epoch: String,
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
            (0..MAILBOXES)
                .map(|i| keys::mailbox(shard, &format!("u{i}")))
                .collect()
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

    /// Puts the server in this item's start state (not measured).
    async fn prepare(
        &self,
        store: &mut MailboxStore,
        conn: &mut MultiplexedConnection,
    ) -> Result<(), Error> {
        match self.kind {
            Kind::Noop | Kind::Uniform { .. } => {}
            Kind::Materialize => {
                store
                    .init_watermark(self.shard, self.layout, EPOCH, BASE, true)
                    .await?;
                redis::cmd("DEL")
                    .arg(&self.mailboxes)
                    .query_async::<()>(conn)
                    .await?;
            }
            Kind::Advance | Kind::AdvanceMany | Kind::Read => {
                store
                    .init_watermark(self.shard, self.layout, EPOCH, BASE, true)
                    .await?;
            }
            Kind::Gc => {
                store
                    .init_watermark(self.shard, self.layout, EPOCH, BASE, true)
                    .await?;
                redis::cmd("DEL")
                    .arg(keys::staging_index(self.shard))
                    .query_async::<()>(conn)
                    .await?;
            }
        }
        Ok(())
    }

    /// The `i`-th call of a round.
    fn cmd(&self, i: usize) -> Cmd {
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
    fn check(&self, i: usize, v: &Value) -> Result<(), Error> {
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
                ints(v) == Some(vec![0, BASE as i64, 0]),
                format!("{{0, {BASE}, 0}} (validated, nothing staged)"),
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
fn entry(off: u64) -> Vec<u8> {
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

// ---------------------------------------------------------------------------------------
// measurement

/// `cmdstat_evalsha` of `INFO commandstats`: (calls, usec, failed + rejected calls).
fn parse_evalsha_stats(info: &str) -> Option<(u64, u64, u64)> {
    let line = info
        .lines()
        .find_map(|l| l.trim().strip_prefix("cmdstat_evalsha:"))?;
    let mut calls = None;
    let mut usec = None;
    let mut errors = 0;
    for kv in line.split(',') {
        let (k, v) = kv.split_once('=')?;
        match k {
            "calls" => calls = v.parse().ok(),
            "usec" => usec = v.parse().ok(),
            "failed_calls" | "rejected_calls" => errors += v.parse::<u64>().ok()?,
            _ => {}
        }
    }
    Some((calls?, usec?, errors))
}

/// A field of `INFO server`.
fn info_field(info: &str, field: &str) -> Option<String> {
    info.lines().find_map(|l| {
        l.trim()
            .strip_prefix(field)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::to_string)
    })
}

/// Median; the mean of the two middle values for an even count.
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

struct Bench {
    conn: MultiplexedConnection,
    store: MailboxStore,
    calls: usize,
}

enum RoundEnd {
    Done,
    NoScript,
}

impl Bench {
    async fn load(&mut self, item: &Item) -> Result<(), Error> {
        let sha: String = redis::cmd("SCRIPT")
            .arg("LOAD")
            .arg(&item.source)
            .query_async(&mut self.conn)
            .await?;
        if sha != item.sha {
            return Err(Error::ScriptLoad {
                item: item.label.clone(),
                got: sha,
                expected: item.sha.clone(),
            });
        }
        Ok(())
    }

    /// Runs the round's calls pipelined and checks every reply.
    async fn calls(&mut self, item: &Item) -> Result<RoundEnd, Error> {
        let mut i = 0;
        while i < self.calls {
            let end = (i + PIPELINE).min(self.calls);
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for k in i..end {
                pipe.add_command(item.cmd(k));
            }
            let replies: Vec<RedisResult<Value>> = pipe.query_async(&mut self.conn).await?;
            for (k, r) in (i..end).zip(&replies) {
                match r {
                    Ok(v) => item.check(k, v)?,
                    Err(e) if e.code() == Some("NOSCRIPT") => return Ok(RoundEnd::NoScript),
                    Err(e) => {
                        return Err(Error::NotApplied {
                            item: item.label.clone(),
                            call: k,
                            expected: "a reply".into(),
                            reply: e.to_string(),
                        })
                    }
                }
            }
            i = end;
        }
        Ok(RoundEnd::Done)
    }

    /// One isolated round: prepare, reset stats, run, read µs per call.
    async fn round(&mut self, item: &Item) -> Result<f64, Error> {
        for _attempt in 0..2 {
            item.prepare(&mut self.store, &mut self.conn).await?;
            redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .query_async::<()>(&mut self.conn)
                .await?;
            if let RoundEnd::NoScript = self.calls(item).await? {
                // The script cache was emptied (restart, SCRIPT FLUSH): load and redo the round.
                self.load(item).await?;
                continue;
            }
            let info: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut self.conn)
                .await?;
            let stats_err = |detail: String| Error::Stats {
                item: item.label.clone(),
                detail,
            };
            let (calls, usec, errors) = parse_evalsha_stats(&info)
                .ok_or_else(|| stats_err("no parsable cmdstat_evalsha line".into()))?;
            if calls != self.calls as u64 || errors != 0 {
                return Err(stats_err(format!(
                    "counted {calls} EVALSHA calls ({errors} failed/rejected), made {}: \
                     another client is using the server",
                    self.calls
                )));
            }
            return Ok(usec as f64 / calls as f64);
        }
        Err(Error::NoScript {
            item: item.label.clone(),
        })
    }
}

fn items() -> Vec<Item> {
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
fn written_keys() -> Vec<String> {
    let mut k = vec![
        keys::wm(SHARD_V1),
        keys::wm(SHARD_V2),
        BLOB_FULL_KEY.to_string(),
        BLOB_SHORT_KEY.to_string(),
    ];
    for shard in [SHARD_V1, SHARD_V2] {
        k.push(keys::staging_index(shard));
        k.extend((0..MAILBOXES).map(|i| keys::mailbox(shard, &format!("u{i}"))));
    }
    k
}

/// Runs the benchmark (see the module documentation).
pub async fn run(opts: &LuaBenchOptions) -> Result<LuaBenchReport, Error> {
    if opts.calls_per_round == 0 || opts.rounds == 0 {
        return Err(Error::InvalidOptions(format!(
            "calls_per_round ({}) and rounds ({}) must be at least 1",
            opts.calls_per_round, opts.rounds
        )));
    }
    let (_own, url) = match &opts.redis_url {
        Some(u) => (None, u.clone()),
        None => {
            let p = RedisProcess::start()?;
            let url = p.url();
            (Some(p), url)
        }
    };
    let client = redis::Client::open(url.as_str())?;
    let cfg = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(Duration::from_secs(120)))
        .set_connection_timeout(Some(Duration::from_secs(5)));
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&cfg)
        .await?;

    let written = written_keys();
    let mut pipe = redis::pipe();
    for k in &written {
        pipe.cmd("EXISTS").arg(k);
    }
    let exists: Vec<i64> = pipe.query_async(&mut conn).await?;
    let present: Vec<String> = written
        .iter()
        .zip(exists)
        .filter(|(_, n)| *n > 0)
        .map(|(k, _)| k.clone())
        .collect();
    if !present.is_empty() {
        return Err(Error::KeysExist { keys: present });
    }

    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await?;
    let redis_version = info_field(&info, "redis_version").unwrap_or_else(|| "unknown".into());

    let store = MailboxStore::connect(&url, Layout::PackedV2).await?;
    let mut bench = Bench {
        conn,
        store,
        calls: opts.calls_per_round,
    };
    let result = measure(&mut bench, opts.rounds).await;
    // Leave nothing behind, also after a failure.
    let cleanup = redis::cmd("DEL")
        .arg(&written)
        .query_async::<()>(&mut bench.conn)
        .await;
    let measured = result?;
    cleanup?;
    Ok(build_report(
        redis_version,
        &measured,
        opts.rounds,
        opts.calls_per_round,
    ))
}

/// Sets up, warms up, and measures every item; label → median µs per call.
async fn measure(bench: &mut Bench, rounds: usize) -> Result<BTreeMap<String, f64>, Error> {
    let items = items();
    // The uniform-check blobs: a 1216-byte uniform packed-v1 blob and its 19-byte record.
    let lanes = LaneWatermarks::uniform(LaneRecord::at(BASE, BASE));
    let full = encode_packed_v1(&lanes);
    let short = encode_packed_v2(&lanes);
    debug_assert_eq!((full.len(), short.len()), (FULL_BLOB_BYTES, LANE_BYTES));
    redis::pipe()
        .cmd("HSET")
        .arg(BLOB_FULL_KEY)
        .arg("wm_blob")
        .arg(full)
        .ignore()
        .cmd("HSET")
        .arg(BLOB_SHORT_KEY)
        .arg("wm_blob")
        .arg(short)
        .ignore()
        .query_async::<()>(&mut bench.conn)
        .await?;

    for item in &items {
        bench.load(item).await?;
    }
    // Warm-up round of every item, discarded.
    for item in &items {
        bench.round(item).await?;
    }
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); items.len()];
    for _ in 0..rounds {
        for (item, s) in items.iter().zip(samples.iter_mut()) {
            s.push(bench.round(item).await?);
        }
    }
    Ok(items
        .iter()
        .zip(&samples)
        .map(|(item, s)| (item.label.clone(), median(s)))
        .collect())
}

fn build_report(
    redis_version: String,
    m: &BTreeMap<String, f64>,
    rounds: usize,
    calls_per_round: usize,
) -> LuaBenchReport {
    let mut scripts: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for (label, &us) in m {
        if let Some((script, layout)) = label.split_once('/') {
            scripts
                .entry(script.to_string())
                .or_default()
                .insert(layout.to_string(), us);
        }
    }
    let mut uniform_checks_us = BTreeMap::new();
    let mut uniform_raw_us = BTreeMap::new();
    for name in ["hget_1216", "hget_19"] {
        uniform_raw_us.insert(name.to_string(), m[name]);
    }
    for (name, _, key) in CHECKS {
        let base = if key == BLOB_FULL_KEY {
            m["hget_1216"]
        } else {
            m["hget_19"]
        };
        uniform_raw_us.insert(name.to_string(), m[name]);
        uniform_checks_us.insert(name.to_string(), m[name] - base);
    }
    LuaBenchReport {
        redis_version,
        noop_evalsha_us: m["noop"],
        scripts,
        uniform_checks_us,
        rounds,
        calls_per_round,
        uniform_raw_us,
    }
}

// ---------------------------------------------------------------------------------------
// output

/// Script order of the table (the ADR's order).
const SCRIPT_ORDER: [&str; 5] = [
    "materialize_fresh_single_recipient",
    "advance_log_watermark",
    "advance_log_watermarks",
    "read_log_watermarks",
    "gc_completed_dispatch",
];

impl LuaBenchReport {
    /// Raw µs of the uniform-check scripts (HGET + check) and of their HGET-only baselines
    /// (`hget_1216`, `hget_19`); `uniform_checks_us` is the difference.
    pub fn uniform_raw_us(&self) -> &BTreeMap<String, f64> {
        &self.uniform_raw_us
    }

    /// A human-readable table of the report.
    pub fn to_table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "Lua micro-benchmark — redis {}, {} calls/round, median of {} rounds,\n\
             server-side µs per EVALSHA call (INFO commandstats)\n",
            self.redis_version, self.calls_per_round, self.rounds
        );
        let w = SCRIPT_ORDER.iter().map(|s| s.len()).max().unwrap_or(0) + 2;
        let _ = writeln!(
            t,
            "{:<w$} {:>13} {:>13} {:>9}",
            "script", "packed-v1 µs", "packed-v2 µs", "v2/v1"
        );
        let _ = writeln!(t, "{}", "-".repeat(w + 38));
        let get = |s: &str, l: &str| self.scripts.get(s).and_then(|m| m.get(l)).copied();
        let names = SCRIPT_ORDER
            .iter()
            .map(|s| s.to_string())
            .chain(
                self.scripts
                    .keys()
                    .filter(|k| !SCRIPT_ORDER.contains(&k.as_str()))
                    .cloned(),
            )
            .collect::<Vec<_>>();
        for name in &names {
            let (v1, v2) = (get(name, V1), get(name, V2));
            let _ = writeln!(
                t,
                "{:<w$} {:>13} {:>13} {:>9}",
                name,
                fmt_us(v1),
                fmt_us(v2),
                fmt_ratio(v1, v2)
            );
            if name == "advance_log_watermarks" {
                let per = |x: Option<f64>| x.map(|v| v / BATCH_RECORDS as f64);
                let _ = writeln!(
                    t,
                    "{:<w$} {:>13} {:>13}",
                    format!("  per record ({BATCH_RECORDS}/call)"),
                    fmt_us(per(v1)),
                    fmt_us(per(v2)),
                );
            }
        }
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "no-op EVALSHA (return 0): {:.2} µs",
            self.noop_evalsha_us
        );
        let hot = SCRIPT_ORDER[0];
        let ratio = |x: Option<f64>| match x {
            Some(v) if self.noop_evalsha_us > 0.0 => format!("{:.1}×", v / self.noop_evalsha_us),
            _ => "-".into(),
        };
        let net = |x: Option<f64>| match x {
            Some(v) => format!("{:.2}", v - self.noop_evalsha_us),
            None => "-".into(),
        };
        let _ = writeln!(
            t,
            "hot path ({hot}) / no-op: packed-v1 {}, packed-v2 {}; \
             above no-op: packed-v1 {} µs, packed-v2 {} µs",
            ratio(get(hot, V1)),
            ratio(get(hot, V2)),
            net(get(hot, V1)),
            net(get(hot, V2)),
        );
        let _ = writeln!(t);
        let _ = writeln!(
            t,
            "uniform checks (HGET + check; check = raw − HGET-only baseline)"
        );
        let _ = writeln!(
            t,
            "{:<28} {:>10} {:>12} {:>10}",
            "check", "raw µs", "baseline µs", "check µs"
        );
        let _ = writeln!(t, "{}", "-".repeat(63));
        for (name, _, key) in CHECKS {
            let (label, base) = if key == BLOB_FULL_KEY {
                (format!("{name} (1216-byte blob)"), "hget_1216")
            } else {
                (format!("{name} (19-byte blob)"), "hget_19")
            };
            let _ = writeln!(
                t,
                "{:<28} {:>10} {:>12} {:>10}",
                label,
                fmt_us(self.uniform_raw_us.get(name).copied()),
                fmt_us(self.uniform_raw_us.get(base).copied()),
                fmt_us(self.uniform_checks_us.get(name).copied()),
            );
        }
        t
    }

    /// The report as JSON:
    /// `{"redis_version", "calls_per_round", "rounds", "noop_evalsha_us",
    /// "scripts": {name: {"packed-v1", "packed-v2"}},
    /// "uniform_checks_us": {"two_sub", "rep", "byte_loop", "length"}}`
    /// (`calls_per_round` and `rounds` are missing from reports written before they were added,
    /// e.g. `docs/perf/lua.json`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "redis_version": self.redis_version,
            "calls_per_round": self.calls_per_round,
            "rounds": self.rounds,
            "noop_evalsha_us": self.noop_evalsha_us,
            "scripts": self.scripts,
            "uniform_checks_us": self.uniform_checks_us,
        })
    }
}

fn fmt_us(x: Option<f64>) -> String {
    match x {
        Some(v) => format!("{v:.2}"),
        None => "-".into(),
    }
}

fn fmt_ratio(v1: Option<f64>, v2: Option<f64>) -> String {
    match (v1, v2) {
        (Some(a), Some(b)) if a > 0.0 => format!("{:.2}", b / a),
        _ => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commandstats() {
        let info = "# Commandstats\r\n\
            cmdstat_config:calls=1,usec=10,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_evalsha:calls=500,usec=2750,usec_per_call=5.50,rejected_calls=0,failed_calls=2\r\n";
        assert_eq!(parse_evalsha_stats(info), Some((500, 2750, 2)));
        assert_eq!(parse_evalsha_stats("# Commandstats\r\n"), None);
    }

    #[test]
    fn reads_info_field() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:0\r\n";
        assert_eq!(info_field(info, "redis_version").as_deref(), Some("7.0.15"));
        assert_eq!(info_field(info, "redis_mode"), None);
    }

    #[test]
    fn median_odd_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn entries_are_64_bytes_and_unique() {
        assert_eq!(entry(BASE + 1).len(), ENTRY_BYTES);
        assert_ne!(entry(BASE + 1), entry(BASE + 2));
    }

    #[test]
    fn error_codes_are_stable() {
        let e = Error::InvalidOptions("x".into());
        assert_eq!(e.code(), "invalid_options");
        let e = Error::NotApplied {
            item: "a".into(),
            call: 1,
            expected: "b".into(),
            reply: "c".into(),
        };
        assert_eq!(e.code(), "not_applied");
        assert_eq!(Error::KeysExist { keys: vec![] }.code(), "keys_exist");
    }

    #[test]
    fn replies_not_on_the_common_path_are_refused() {
        let items = items();
        let hot = items
            .iter()
            .find(|i| i.label == "materialize_fresh_single_recipient/packed-v2")
            .unwrap();
        let applied = Value::Int((BASE + 1) as i64);
        assert!(hot.check(0, &applied).is_ok());
        let not_uniform = Value::Array(vec![Value::Int(4)]);
        let e = hot.check(0, &not_uniform).unwrap_err();
        assert_eq!(e.code(), "not_applied");
        let gap = Value::Array(vec![Value::Int(2), Value::Int(BASE as i64)]);
        assert!(hot.check(0, &gap).is_err());
    }

    #[test]
    fn every_item_has_a_distinct_label_and_the_ten_scripts() {
        let items = items();
        let mut labels: Vec<_> = items.iter().map(|i| i.label.clone()).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), items.len());
        let scripts = labels.iter().filter(|l| l.contains('/')).count();
        assert_eq!(scripts, 10);
    }
}
