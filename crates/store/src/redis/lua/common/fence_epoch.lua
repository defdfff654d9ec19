-- fence_epoch.lua — compare-and-set of wm_epoch: a new owner (or `tidemark shard fence`)
-- raises the shard's epoch so that every script called with the old one fails closed.
-- Reads wm_epoch only, never wm_blob.
--
-- KEYS[1]  wm:{s}   hash  the shard's watermark
-- ARGV[1]  expected  decimal u64, the epoch the caller read
-- ARGV[2]  new       decimal u64, the epoch to set (> expected, chosen by Rust)
--
-- Returns {0, new} | {3, current} when wm_epoch is not `expected` | {5} missing.
-- Publishes nothing.
local epoch = redis.call('HGET', KEYS[1], 'wm_epoch')
if not epoch then return {5} end
if epoch ~= ARGV[1] then return {3, epoch} end
redis.call('HSET', KEYS[1], 'wm_epoch', ARGV[2])
return {0, ARGV[2]}
