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
//!
//! Layout: `checks.rs` holds the Lua the benchmark writes itself (the no-op and the uniform
//! checks), `items.rs` the workload (what each item calls, its start state, the reply it must
//! get), `measure.rs` the rounds and the `INFO commandstats` arithmetic, `report.rs` the
//! result and its table and JSON; [`run`] (here) sets up the server, measures and cleans up.

mod checks;
mod items;
mod measure;
mod report;
#[cfg(test)]
mod tests;

use std::time::Duration;

use tidemark_redis_proc::RedisProcess;
use tidemark_store::redis::store::MailboxStore;
use tidemark_store::redis::watermark::Layout;

pub use checks::{BYTE_LOOP_LUA, HGET_ONLY_LUA, LENGTH_LUA, NOOP_LUA, REP_LUA, TWO_SUB_LUA};
pub use items::{BASE, BATCH_RECORDS, ENTRY_BYTES, MAILBOXES, SHARD_V1, SHARD_V2};
pub use measure::PIPELINE;
pub use report::LuaBenchReport;

use items::written_keys;
use measure::{info_field, measure, Bench};
use report::build_report;

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
