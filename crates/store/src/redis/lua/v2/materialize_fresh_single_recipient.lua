-- materialize_fresh_single_recipient.lua (packed-v2) — the hot path [ADR-0015].
-- One log record, one recipient, uniform watermark: writes the mailbox entry and advances all
-- 64 lanes to the record's offset in one atomic step (19 bytes written).
--
-- KEYS[1]  wm:{s}              hash  the shard's watermark
-- KEYS[2]  mb:{s}:<recipient>  zset  the recipient's mailbox (score = MailboxSeq)
-- ARGV[1]  epoch               decimal u64, must equal wm_epoch
-- ARGV[2]  offset              decimal u48, the record's log offset (= MailboxSeq)
-- ARGV[3]  expected_previous   decimal u48, the record's prev offset; CAS against W
-- ARGV[4]  entry               bytes, the mailbox member (starts with the seq, so unique)
--
-- Returns {0, offset} applied | {1, W} replay | {2, W} gap | {3, epoch} fenced
--         | {4} not uniform (use the chunked path) | {5} missing | {-1, cause, lane} corrupt.
-- Writes nothing unless it returns {0, ...}. Publishes nothing (the materializer publishes
-- one wake-up per batch).
local layout, epoch, blob = wm_read(KEYS[1])
if not layout then return epoch end
if not stored_uniform(blob) or layout ~= 'packed-v2' then
  -- diverged or packed-v1 data: validate it all, then hand over to the chunked path
  local P, W = lanes_decode(blob)
  if not P then return W end
  if epoch ~= ARGV[1] then return {3, epoch} end
  return {4}
end
local p, w = lane_at(blob, 0)
if not p then return corrupt(w, 0) end
if epoch ~= ARGV[1] then return {3, epoch} end
if p == 0 then return {4} end
local off = tonumber(ARGV[2])
if off <= w then return {1, w} end
if tonumber(ARGV[3]) ~= w then return {2, w} end
redis.call('ZADD', KEYS[2], off, ARGV[4])
local os = u48s(off)
redis.call('HSET', KEYS[1], 'wm_blob', '\1' .. os .. ssub(blob, 8, 13) .. os)
return {0, off}
