-- init_watermark.lua — creates wm:{s} in one atomic step (`tidemark wm init`, `serve`
-- initialising missing shards). Refuses an existing watermark unless forced, so a running
-- deployment's watermark is never overwritten by accident. The blob is encoded by Rust
-- (redis/watermark.rs, canonical form).
--
-- KEYS[1]  wm:{s}   hash  the shard's watermark
-- ARGV[1]  layout   "packed-v1" | "packed-v2"
-- ARGV[2]  epoch    decimal u64
-- ARGV[3]  blob     bytes, 19 or 1216
-- ARGV[4]  force    "1" to overwrite, else "0"
--
-- Returns 1 created | 0 refused (a watermark exists). Publishes nothing.
if ARGV[4] ~= '1' and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'wm_layout', ARGV[1], 'wm_epoch', ARGV[2], 'wm_blob', ARGV[3])
return 1
