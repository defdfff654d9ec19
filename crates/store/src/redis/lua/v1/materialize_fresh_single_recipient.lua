-- materialize_fresh_single_recipient.lua (packed-v1, pre-ADR-0015 "old code").
-- Same contract as the packed-v2 script; the blob is always 1216 bytes, uniformity is
-- ADR-0011's two-sub compare and the write-back is string.rep(record, 64).
--
-- KEYS[1]  wm:{s}              hash  the shard's watermark (layout must be packed-v1)
-- KEYS[2]  mb:{s}:<recipient>  zset  the recipient's mailbox (score = MailboxSeq)
-- ARGV[1]  epoch               decimal u64, must equal wm_epoch
-- ARGV[2]  offset              decimal u48, the record's log offset (= MailboxSeq)
-- ARGV[3]  expected_previous   decimal u48, CAS against W
-- ARGV[4]  entry               bytes, the mailbox member
--
-- Returns {0, offset} | {1, W} | {2, W} | {3, epoch} | {4} | {5} | {-1, cause, lane}.
-- Writes nothing unless it returns {0, ...}. Publishes nothing.
local layout, epoch, blob = wm_read(KEYS[1])
if not layout then return epoch end
if not stored_uniform(blob) then
  local P, W = lanes_decode(blob)
  if not P then return W end
  if epoch ~= ARGV[1] then return {3, epoch} end
  return {4}
end
-- uniform: every lane equals lane 0, so validating lane 0 validates them all
local p, w = lane_at(blob, 0)
if not p then return corrupt(w, 0) end
if epoch ~= ARGV[1] then return {3, epoch} end
if p == 0 then return {4} end
local off = tonumber(ARGV[2])
if off <= w then return {1, w} end
if tonumber(ARGV[3]) ~= w then return {2, w} end
redis.call('ZADD', KEYS[2], off, ARGV[4])
local os = u48s(off)
redis.call('HSET', KEYS[1], 'wm_blob', srep('\1' .. os .. ssub(blob, 8, 13) .. os, LANES))
return {0, off}
