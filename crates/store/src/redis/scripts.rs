//! The Lua scripts, embedded at build time.
//!
//! Each watermark script is one file. The hot path (`materialize_fresh_single_recipient`) is
//! self-contained straight-line code, since building the prelude's closures on every call
//! cost about a quarter of its instructions (callgrind). The others are seen by Redis
//! prefixed by the shared lane prelude
//! (`lua/common/_lanes.lua`) and the layout prelude (`lua/v2/_layout.lua` or
//! `lua/v1/_layout.lua`). Only the hot path has a body per layout; the other bodies are shared
//! and differ through the prelude (how a blob is read, checked for uniformity and written back).
//!
//! | script                                  | reads wm_blob | writes wm |
//! |-----------------------------------------|---------------|-----------|
//! | materialize_fresh_single_recipient.lua  | yes           | yes       |
//! | advance_log_watermark.lua               | yes           | yes       |
//! | advance_log_watermarks.lua              | yes           | yes       |
//! | read_log_watermarks.lua                 | yes (raw)     | no        |
//! | gc_completed_dispatch.lua               | yes           | no        |
//! | write_lane_chunk.lua (not ADR)          | epoch only    | no        |
//! | fence_epoch.lua (not ADR)               | epoch only    | epoch     |
//! | commit_dispatch.lua (core Redis)        | —             | —         |
//! | ack_mailbox.lua (mailbox Redis)         | —             | —         |
//! | shard_lease.lua, node_heartbeat.lua, node_list.lua (core Redis; [`super::lease`]) | — | — |

use std::sync::LazyLock;

use ::redis::{FromRedisValue, RedisResult, ToRedisArgs};

use super::watermark::Layout;
use crate::endpoint::Conn;

macro_rules! lua {
    ($path:literal) => {
        include_str!(concat!("lua/", $path))
    };
}

/// One script: its name (the file name without `.lua`), full source, and SHA1.
#[derive(Debug)]
pub struct Script {
    /// File name without `.lua`, e.g. `materialize_fresh_single_recipient`.
    pub name: &'static str,
    /// Source exactly as sent to `SCRIPT LOAD`.
    pub source: String,
    /// SHA1 of `source`, used by EVALSHA.
    pub sha: String,
}

impl Script {
    pub(crate) fn new(name: &'static str, source: String) -> Script {
        let sha = ::redis::Script::new(&source).get_hash().to_string();
        Script { name, source, sha }
    }

    /// A call of this script on its own (outside a [`ScriptSet`]), to which keys and then
    /// arguments are added; [`ScriptCall::invoke`] runs it with the NOSCRIPT recovery of
    /// [`Conn::load_scripts_for`] (where the call runs; `redis::Script`'s `SCRIPT LOAD` goes
    /// to every node of a cluster and waits for the slowest, ADR-0057).
    pub(crate) fn key<T: ToRedisArgs>(&self, key: T) -> ScriptCall<'_> {
        ScriptCall {
            script: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
        .key(key)
    }
}

/// One call of a [`Script`]: its keys and arguments.
pub(crate) struct ScriptCall<'a> {
    script: &'a Script,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl ScriptCall<'_> {
    /// Adds a key (`KEYS[i]`).
    pub(crate) fn key<T: ToRedisArgs>(mut self, key: T) -> Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    /// Adds an argument (`ARGV[i]`).
    pub(crate) fn arg<T: ToRedisArgs>(mut self, arg: T) -> Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// `EVALSHA`; on NOSCRIPT, `SCRIPT LOAD` where the call runs, then the call again as
    /// `EVAL` ([`as_eval`], ADR-0059).
    pub(crate) async fn invoke<T: FromRedisValue>(&self, conn: &mut Conn) -> RedisResult<T> {
        let mut cmd = ::redis::cmd("EVALSHA");
        cmd.arg(&self.script.sha).arg(self.keys.len());
        for k in &self.keys {
            cmd.arg(k);
        }
        for a in &self.args {
            cmd.arg(a);
        }
        match cmd.query_async(conn).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                conn.load_scripts_for(Some(&cmd), &[&self.script.source])
                    .await?;
                as_eval(&cmd, &self.script.source).query_async(conn).await
            }
            other => other,
        }
    }
}

/// The `EVAL` form of an `EVALSHA` call (`source` in place of the SHA-1, the same keys and
/// arguments): the retry after NOSCRIPT (ADR-0059). It runs wherever the key is served now,
/// MOVED followed, and leaves the script in that node's cache; an `EVALSHA` again could
/// meet the same empty cache when the `SCRIPT LOAD` before it went by a stale slot map to
/// the old primary. Any other command is returned as it is.
pub(crate) fn as_eval(cmd: &::redis::Cmd, source: &str) -> ::redis::Cmd {
    let mut args = cmd.args_iter();
    match args.next() {
        Some(::redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"EVALSHA") => {}
        _ => return cmd.clone(),
    }
    let mut eval = ::redis::cmd("EVAL");
    eval.arg(source);
    for a in args.skip(1) {
        if let ::redis::Arg::Simple(a) = a {
            eval.arg(a);
        }
    }
    eval
}

/// The SHA-1 an `EVALSHA` call names (`None`: another command).
pub(crate) fn evalsha_sha(cmd: &::redis::Cmd) -> Option<&[u8]> {
    let mut args = cmd.args_iter();
    match (args.next(), args.next()) {
        (Some(::redis::Arg::Simple(name)), Some(::redis::Arg::Simple(sha)))
            if name.eq_ignore_ascii_case(b"EVALSHA") =>
        {
            Some(sha)
        }
        _ => None,
    }
}

/// The five ADR scripts of one layout, plus the layout-independent helpers.
#[derive(Debug)]
pub struct ScriptSet {
    /// Layout these scripts read and write.
    pub layout: Layout,
    /// Hot path: one record, one recipient, uniform watermark.
    pub materialize_fresh_single_recipient: Script,
    /// Advance the lanes of one record.
    pub advance_log_watermark: Script,
    /// Advance the lanes of many records.
    pub advance_log_watermarks: Script,
    /// Raw fields of the shards asked for.
    pub read_log_watermarks: Script,
    /// Drop staging state at or below the lowest present W.
    pub gc_completed_dispatch: Script,
    /// One lane's chunk of a many-recipient record.
    pub write_lane_chunk: Script,
    /// Compare-and-set of the epoch.
    pub fence_epoch: Script,
    /// Acknowledge (and trim) a mailbox.
    pub ack_mailbox: Script,
}

impl ScriptSet {
    /// Every script of the set, for `SCRIPT LOAD`.
    pub fn all(&self) -> [&Script; 8] {
        [
            &self.materialize_fresh_single_recipient,
            &self.advance_log_watermark,
            &self.advance_log_watermarks,
            &self.read_log_watermarks,
            &self.gc_completed_dispatch,
            &self.write_lane_chunk,
            &self.fence_epoch,
            &self.ack_mailbox,
        ]
    }

    /// The five ADR scripts (name, script), in the ADR's order.
    pub fn adr_five(&self) -> [&Script; 5] {
        [
            &self.materialize_fresh_single_recipient,
            &self.advance_log_watermark,
            &self.advance_log_watermarks,
            &self.read_log_watermarks,
            &self.gc_completed_dispatch,
        ]
    }
}

const LANES_PRELUDE: &str = lua!("common/_lanes.lua");

fn build(layout: Layout) -> ScriptSet {
    let (layout_prelude, hot) = match layout {
        Layout::PackedV2 => (
            lua!("v2/_layout.lua"),
            lua!("v2/materialize_fresh_single_recipient.lua"),
        ),
        Layout::PackedV1 => (
            lua!("v1/_layout.lua"),
            lua!("v1/materialize_fresh_single_recipient.lua"),
        ),
    };
    let wm = |name: &'static str, body: &str| {
        Script::new(name, format!("{LANES_PRELUDE}\n{layout_prelude}\n{body}"))
    };
    ScriptSet {
        layout,
        // the hot path is self-contained: no prelude, no closures built per call
        materialize_fresh_single_recipient: Script::new(
            "materialize_fresh_single_recipient",
            hot.to_string(),
        ),
        advance_log_watermark: wm(
            "advance_log_watermark",
            lua!("common/advance_log_watermark.lua"),
        ),
        advance_log_watermarks: wm(
            "advance_log_watermarks",
            lua!("common/advance_log_watermarks.lua"),
        ),
        read_log_watermarks: Script::new(
            "read_log_watermarks",
            lua!("common/read_log_watermarks.lua").to_string(),
        ),
        gc_completed_dispatch: wm(
            "gc_completed_dispatch",
            lua!("common/gc_completed_dispatch.lua"),
        ),
        write_lane_chunk: Script::new(
            "write_lane_chunk",
            lua!("common/write_lane_chunk.lua").to_string(),
        ),
        fence_epoch: Script::new("fence_epoch", lua!("common/fence_epoch.lua").to_string()),
        ack_mailbox: Script::new("ack_mailbox", lua!("common/ack_mailbox.lua").to_string()),
    }
}

static PACKED_V1: LazyLock<ScriptSet> = LazyLock::new(|| build(Layout::PackedV1));
static PACKED_V2: LazyLock<ScriptSet> = LazyLock::new(|| build(Layout::PackedV2));

/// The script set that reads and writes `layout`.
pub fn for_layout(layout: Layout) -> &'static ScriptSet {
    match layout {
        Layout::PackedV1 => &PACKED_V1,
        Layout::PackedV2 => &PACKED_V2,
    }
}

/// The core-Redis commit script.
pub static COMMIT_DISPATCH: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        "commit_dispatch",
        lua!("core/commit_dispatch.lua").to_string(),
    )
});
