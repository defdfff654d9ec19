-- materialize_fresh_single_recipient.lua (packed-v1, pre-ADR-0015 "old code").
-- The same straight-line code as the packed-v2 script except for exactly what ADR-0015
-- removed: the layout must be packed-v1 and the blob 1216 bytes; uniformity is ADR-0011's
-- two-sub compare (two ~1197-byte strings built and interned); the write-back is
-- string.rep(record, 64) (1216 bytes written). Kept to prove old code fails closed on v2 data
-- and for side-by-side benchmarks.
--
-- Takes the same run of records as the packed-v2 script (ADR-0039), so that the two are
-- compared on the same calls; the write-back happens once per run in both.
--
-- KEYS[1]      wm:{s}              hash  the shard's watermark (layout must be packed-v1)
-- KEYS[1+i]    mb:{s}:<recipient>  zset  record i's recipient's mailbox (i = 1..#KEYS-1)
-- ARGV[1]      epoch               decimal u64 (canonical), must equal wm_epoch
-- ARGV[3i-1]   offset              decimal u48, record i's log offset (= MailboxSeq)
-- ARGV[3i]     expected_previous   decimal u48, CAS against W
-- ARGV[3i+1]   entry               bytes, the mailbox member
--
-- Returns W (integer) | {1, W, replayed, applied} | {2, W, replayed, applied} | {3, epoch}
--   | {4} | {5} | {-1, cause, lane}, as the packed-v2 script. Publishes nothing.
local raw = redis.call('HGETALL', KEYS[1])
local n = #raw
if n == 0 then return {5} end
if n ~= 6 then return {-1, 'field_count', -1} end
local layout, epoch, blob
for i = 1, 5, 2 do
  local f = raw[i]
  if f == 'wm_layout' then layout = raw[i + 1]
  elseif f == 'wm_epoch' then epoch = raw[i + 1]
  elseif f == 'wm_blob' then blob = raw[i + 1] end
end
if not layout or not epoch or not blob then return {-1, 'missing_field', -1} end
if layout ~= 'packed-v1' then return {-1, 'unknown_layout', -1} end
if #blob ~= 1216 then return {-1, 'bad_length', -1} end
local same_epoch = epoch == ARGV[1]
if not same_epoch then
  local e = #epoch
  local bad = e == 0 or e > 20 or not string.find(epoch, '^[0-9]+$')
    or (e > 1 and string.byte(epoch, 1) == 48)
  if not bad and e == 20 then
    local max = '18446744073709551615'
    for i = 1, 20 do
      local a, b = string.byte(epoch, i), string.byte(max, i)
      if a ~= b then bad = a > b; break end
    end
  end
  if bad then return {-1, 'bad_epoch', -1} end
end
-- ADR-0011's uniform check
if string.sub(blob, 20) ~= string.sub(blob, 1, -20) then
  if not same_epoch then return {3, epoch} end
  return {4}
end
-- uniform: every lane equals lane 0, so validating lane 0 validates them all
local p, a1, a2, a3, a4, a5, a6, f1, f2, f3, f4, f5, f6, r1, r2, r3, r4, r5, r6 =
  string.byte(blob, 1, 19)
if p ~= 1 then
  if p ~= 0 then return {-1, 'bad_presence', 0} end
  if a1 + a2 + a3 + a4 + a5 + a6 + f1 + f2 + f3 + f4 + f5 + f6 + r1 + r2 + r3 + r4 + r5 + r6 ~= 0
  then return {-1, 'nonzero_empty_lane', 0} end
  if not same_epoch then return {3, epoch} end
  return {4}
end
local w = ((((a1 * 256 + a2) * 256 + a3) * 256 + a4) * 256 + a5) * 256 + a6
if w ~= ((((r1 * 256 + r2) * 256 + r3) * 256 + r4) * 256 + r5) * 256 + r6 then
  return {-1, 'w_mismatch', 0}
end
if w < ((((f1 * 256 + f2) * 256 + f3) * 256 + f4) * 256 + f5) * 256 + f6 then
  return {-1, 'w_below_floor', 0}
end
if not same_epoch then return {3, epoch} end
local records = #KEYS - 1
local replayed, applied, status = 0, 0, 1
for i = 1, records do
  local a = 3 * i - 1
  local off = tonumber(ARGV[a])
  if off <= w then
    replayed = replayed + 1
  elseif tonumber(ARGV[a + 1]) ~= w then
    status = 2
    break
  else
    redis.call('ZADD', KEYS[i + 1], ARGV[a], ARGV[a + 2])
    w = off
    applied = applied + 1
  end
end
if applied > 0 then
  local x = w
  local b6 = x % 256; x = (x - b6) / 256
  local b5 = x % 256; x = (x - b5) / 256
  local b4 = x % 256; x = (x - b4) / 256
  local b3 = x % 256; x = (x - b3) / 256
  local b2 = x % 256; x = (x - b2) / 256
  local os = string.char(x, b2, b3, b4, b5, b6)
  redis.call('HSET', KEYS[1], 'wm_blob',
    string.rep('\1' .. os .. string.sub(blob, 8, 13) .. os, 64))
  if applied == records then return w end
end
return {status, w, replayed, applied}
