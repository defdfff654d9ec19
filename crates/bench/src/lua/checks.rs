//! The Lua the benchmark writes itself, next to the watermark scripts it measures: the no-op
//! `EVALSHA` (the fixed cost of calling any script) and the four uniform checks ADR-0015
//! compares, each as `HGET` + check, with the HGET-only baseline their cost is taken against.
//! Also the two blobs the checks read ([`write_blobs`]): a 1216-byte uniform packed-v1
//! `wm_blob` and its 19-byte packed-v2 record, under keys outside any shard.

use redis::aio::MultiplexedConnection;
use tidemark_store::redis::watermark::{
    encode_packed_v1, encode_packed_v2, LaneRecord, LaneWatermarks, FULL_BLOB_BYTES, LANE_BYTES,
};

use super::items::BASE;

/// Keys of the uniform-check blobs (one slot, outside any shard's keys).
pub(super) const BLOB_FULL_KEY: &str = "lua-bench:{blob}:1216";
pub(super) const BLOB_SHORT_KEY: &str = "lua-bench:{blob}:19";

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
pub(super) const CHECKS: [(&str, &str, &str); 4] = [
    ("two_sub", TWO_SUB_LUA, BLOB_FULL_KEY),
    ("rep", REP_LUA, BLOB_FULL_KEY),
    ("byte_loop", BYTE_LOOP_LUA, BLOB_FULL_KEY),
    ("length", LENGTH_LUA, BLOB_SHORT_KEY),
];

/// Writes the uniform-check blobs: a 1216-byte uniform packed-v1 blob and its 19-byte record.
pub(super) async fn write_blobs(conn: &mut MultiplexedConnection) -> redis::RedisResult<()> {
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
        .query_async::<()>(conn)
        .await
}
