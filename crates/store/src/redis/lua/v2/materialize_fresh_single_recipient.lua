-- materialize_fresh_single_recipient.lua (packed-v2) — the hot path [ADR-0015].
-- A run of one-recipient log records of one shard, in log order, on a uniform watermark:
-- writes each record's mailbox entry and advances all 64 lanes past it, in one atomic step
-- (ADR-0039: a run of n records reads the watermark once and writes its 19 bytes once; a
-- run of one record is the call ADR-0015 describes, with the same arguments and replies).
--
-- Self-contained (no shared prelude): straight-line code, no closures built per call. Rules
-- and codes are those of common/_lanes.lua and redis/watermark.rs.
--
-- n = #KEYS - 1 >= 1 records; record i (1..n):
-- KEYS[1]      wm:{s}              hash  the shard's watermark
-- KEYS[1+i]    mb:{s}:<recipient>  zset  record i's recipient's mailbox (score = MailboxSeq)
-- ARGV[1]      epoch               decimal u64 (canonical), must equal wm_epoch
-- ARGV[3i-1]   offset              decimal u48, record i's log offset (= MailboxSeq);
--                                  strictly increasing along the run (the caller checks)
-- ARGV[3i]     expected_previous   decimal u48, record i's prev offset; CAS against W
-- ARGV[3i+1]   entry               bytes, the mailbox member (starts with the seq, so unique)
--
-- The many-recipient form (ADR-0048), told apart by ARGV[2] == 'm' (an offset is never 'm'):
-- n = (#ARGV - 2) / 4 >= 1 records, record i (1..n) with k_i >= 1 recipients:
-- KEYS[2..]    mb:{s}:<recipient>  zset  the k_1 mailboxes of record 1, then record 2's, ...
--                                        (#KEYS == 1 + the sum of the k_i)
-- ARGV[2]      'm'
-- ARGV[4i-1]   offset              decimal u48, as above
-- ARGV[4i]     expected_previous   decimal u48, as above
-- ARGV[4i+1]   k_i                 decimal, how many of the KEYS are record i's
-- ARGV[4i+2]   entry               bytes, the member written to each of its k_i mailboxes
-- A record is applied whole (every entry and W in this one atomic step), so no staging
-- state is written: nothing of it is ever half durable. The caller bounds a call's entries.
-- A k_i that is not a whole number >= 1, or counts that do not add up to #KEYS - 1, are an
-- error reply 'ERR bad_arguments' (after the watermark's checks, before any write). Only
-- this packed-v2 script has the form: packed-v1 code sends such records to the chunked path.
--
-- Records are taken in order, each as its own call would: at or below W it is a replay
-- (nothing written), with expected_previous == W it is applied (its entry written, W = its
-- offset), otherwise it is a gap and the run stops there (it and the records after it are
-- not looked at).
--
-- Returns W (integer): every record applied, W = the last one's offset
--   | {1, W, replayed, applied}: every record taken, the first `replayed` were replays
--   | {2, W, replayed, applied}: record replayed + applied + 1 is a gap (W: after the
--     records taken before it, which stay written)
--   | {3, epoch} fenced | {4} not uniform: the blob is 1216 bytes or packed-v1, or the lane
--     is empty (the chunked path, which validates every lane, takes over) | {5} missing
--   | {-1, cause, lane} corrupt: header checks (field count, fields, layout, length, epoch)
--     always; lane checks on the 19-byte record.
-- The checks of the watermark come before any record, so {3}, {4}, {5} and {-1} write
-- nothing. Publishes nothing (the materializer publishes one wake-up per batch).
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
local len = #blob
if layout == 'packed-v2' then
  if len ~= 19 and len ~= 1216 then return {-1, 'bad_length', -1} end
elseif layout == 'packed-v1' then
  if len ~= 1216 then return {-1, 'bad_length', -1} end
else
  return {-1, 'unknown_layout', -1}
end
-- ARGV[1] is canonical, so equality proves wm_epoch valid; otherwise check its syntax.
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
-- uniform is decided by the length alone
if len ~= 19 or layout ~= 'packed-v2' then
  if not same_epoch then return {3, epoch} end
  return {4}
end
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
local replayed, applied, status = 0, 0, 1
local records
if ARGV[2] ~= 'm' then
  records = #KEYS - 1
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
else
  records = (#ARGV - 2) / 4
  if records < 1 or records % 1 ~= 0 then return redis.error_reply('ERR bad_arguments') end
  local sum = 0
  for i = 1, records do
    local k = tonumber(ARGV[4 * i + 1])
    if not k or k < 1 or k % 1 ~= 0 then return redis.error_reply('ERR bad_arguments') end
    sum = sum + k
  end
  if sum ~= #KEYS - 1 then return redis.error_reply('ERR bad_arguments') end
  local key = 2
  for i = 1, records do
    local a = 4 * i - 1
    local off = tonumber(ARGV[a])
    local k = tonumber(ARGV[a + 2])
    if off <= w then
      replayed = replayed + 1
    elseif tonumber(ARGV[a + 1]) ~= w then
      status = 2
      break
    else
      local entry = ARGV[a + 3]
      for j = key, key + k - 1 do
        redis.call('ZADD', KEYS[j], ARGV[a], entry)
      end
      w = off
      applied = applied + 1
    end
    key = key + k
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
  redis.call('HSET', KEYS[1], 'wm_blob', '\1' .. os .. string.sub(blob, 8, 13) .. os)
  if applied == records then return w end
end
return {status, w, replayed, applied}
