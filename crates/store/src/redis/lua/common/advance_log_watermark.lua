-- advance_log_watermark.lua — advances the lanes of one record once its chunks are durable
-- [ADR-0015]. Body shared by packed-v1 and packed-v2; the layout prelude decides how the blob
-- is read and written back.
--
-- KEYS[1]  wm:{s}        hash  the shard's watermark
-- KEYS[2]  stg:{s}:<o>   hash  staging state of record o: one field per lane whose chunk is durable
-- ARGV[1]  epoch              decimal u64, must equal wm_epoch
-- ARGV[2]  offset             decimal u48, the record's offset o
-- ARGV[3]  expected_previous  decimal u48, the record's prev; per-lane CAS against W
-- ARGV[4]  needed             64 chars '0'/'1': lanes that have recipients in this record
--                             ('' = none; such lanes advance on the CAS alone)
--
-- A lane moves to o only when it is present, W == expected_previous and (if needed) its chunk
-- is in KEYS[2]. Lanes at or above o are replays; lanes below expected_previous are gaps.
-- A record with recipients in an empty lane (presence 0) moves no lane at all (an empty lane
-- has no W to cover it; see apply_record in _lanes.lua).
-- Returns {status, advanced, held, gaps, min_present_W, max_present_W} with status
--   0 advanced | 1 replay | 2 gap | 6 held;  or {7, advanced, held, gaps, min_present_W,
--   max_present_W, lane, offset} when the record needs an empty lane (nothing moved);
--   or {3, epoch} | {5} | {-1, cause, lane}.
-- Writes wm_blob (canonical form) only when a lane moved. Publishes nothing.
local layout, epoch, blob = wm_read(KEYS[1])
if not layout then return epoch end
local P, W, F = lanes_decode(blob)
if not P then return W end
if epoch ~= ARGV[1] then return {3, epoch} end
local off = tonumber(ARGV[2])
local adv, held, gap, empty = apply_record(P, W, off, tonumber(ARGV[3]), ARGV[4],
  staged(KEYS[2]))
if adv > 0 then write_back(KEYS[1], layout, blob, P, W, F) end
if empty >= 0 then return advance_reply(adv, held, gap, P, W, {empty, off}) end
return advance_reply(adv, held, gap, P, W)
