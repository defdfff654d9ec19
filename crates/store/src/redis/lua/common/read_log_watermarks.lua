-- read_log_watermarks.lua — returns the raw fields of the shards asked for, for Rust to
-- decode with redis/watermark.rs::decode_lane_watermarks [ADR-0015]. It validates nothing
-- itself, so that exactly one decoder (Rust's) judges what it returns.
--
-- KEYS[i]  wm:{s_i}  hash  watermarks of the shards asked for (standalone: any shards;
--                          Redis Cluster: shards of one slot only)
-- ARGV     none
--
-- Returns an array with, per key, the flat HGETALL reply (empty when the key is missing).
-- Writes nothing. Publishes nothing.
local out = {}
for i = 1, #KEYS do out[i] = redis.call('HGETALL', KEYS[i]) end
return out
