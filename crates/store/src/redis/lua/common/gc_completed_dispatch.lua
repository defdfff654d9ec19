-- gc_completed_dispatch.lua — deletes per-record staging state at or below the lowest
-- present W of the shard [ADR-0015]. Validates the whole watermark first: a corrupt
-- watermark deletes nothing.
--
-- KEYS[1]  wm:{s}         hash  the shard's watermark
-- KEYS[2]  stgidx:{s}     zset  offsets that have staging state (score = member = offset)
-- ARGV[1]  prefix         string, staging key prefix "stg:{s}:" (keys of the same slot)
-- ARGV[2]  limit          decimal, most records to delete in this call (1..5000)
--
-- Returns {0, min_present_W, deleted, wm_epoch} (min_present_W = -1 when no lane is present,
-- nothing deleted; wm_epoch: the watermark's epoch as stored, a decimal string, so that an
-- owner whose shard sees no traffic still learns it was fenced, ADR-0046) | {5} |
-- {-1, cause, lane}. Deletes stg:{s}:<o> and its index entry for o <= min_present_W only.
-- Publishes nothing.
local layout, epoch, blob = wm_read(KEYS[1])
if not layout then return epoch end
local P, W = lanes_decode(blob)
if not P then return W end
local lo = present_range(P, W)
if lo < 0 then return {0, -1, 0, epoch} end
local offs = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', lo, 'LIMIT', 0, tonumber(ARGV[2]))
local n = #offs
if n > 0 then
  local keys = {}
  for i = 1, n do keys[i] = ARGV[1] .. offs[i] end
  redis.call('DEL', unpack(keys))
  redis.call('ZREM', KEYS[2], unpack(offs))
end
return {0, lo, n, epoch}
