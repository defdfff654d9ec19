-- advance_log_watermarks.lua — advance_log_watermark for many records of one shard in one
-- call (catch-up after a restart, batching) [ADR-0015]. Records are applied in the order
-- given, which must be log order; the blob is read once and written once.
--
-- KEYS[1]    wm:{s}       hash  the shard's watermark
-- KEYS[1+i]  stg:{s}:<o_i> hash staging state of record i (i = 1..n)
-- ARGV[1]    epoch        decimal u64, must equal wm_epoch
-- ARGV[2+3(i-1)]  offset o_i             decimal u48
-- ARGV[3+3(i-1)]  expected_previous of i decimal u48
-- ARGV[4+3(i-1)]  needed lanes of i      64 chars '0'/'1' or ''
--
-- Returns {status, advanced, held, gaps, min_present_W, max_present_W} summed over records
--   (status 0 advanced | 1 replay | 2 gap | 6 held); or {7, advanced, held, gaps, min_W, max_W,
--   lane, offset} when record `offset` needs the empty lane `lane`: it and every later record
--   are left untaken (earlier records may have moved); or {3, epoch} | {5} | {-1, cause, lane}.
-- Writes wm_blob (canonical form) once, only when a lane moved. Publishes nothing.
local layout, epoch, blob = wm_read(KEYS[1])
if not layout then return epoch end
local P, W, F = lanes_decode(blob)
if not P then return W end
if epoch ~= ARGV[1] then return {3, epoch} end
local adv, held, gap = 0, 0, 0
local empty
for i = 1, #KEYS - 1 do
  local b = 2 + 3 * (i - 1)
  local off = tonumber(ARGV[b])
  local a, h, g, e = apply_record(P, W, off, tonumber(ARGV[b + 1]), ARGV[b + 2],
    staged(KEYS[1 + i]))
  adv, held, gap = adv + a, held + h, gap + g
  if e >= 0 then empty = {e, off}; break end
end
if adv > 0 then write_back(KEYS[1], layout, blob, P, W, F) end
return advance_reply(adv, held, gap, P, W, empty)
