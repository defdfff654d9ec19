-- _lanes.lua — shared prelude of every watermark script (prepended at build time by
-- redis/scripts.rs; Redis sees one script). It decodes, validates and re-encodes lane records
-- with exactly the rules and check order of redis/watermark.rs, so Rust and Lua give the same
-- verdicts on the same bytes.
--
-- Reply conventions shared by all watermark scripts (decoded by redis/store.rs):
--   {0, ...}            applied / advanced
--   {1, W}              replay: the record is at or below W, nothing written
--   {2, W}              gap: expected_previous is above W, nothing advanced
--   {3, epoch}          fenced: ARGV epoch differs from wm_epoch, nothing written
--   {4}                 not uniform: hot path not applicable, nothing written
--   {5}                 missing: wm:{s} does not exist
--   {6, ...}            held: a lane's chunk is not durable yet, nothing advanced
--   {7, ..., lane, o}   empty lane: record o has recipients in lane `lane`, which is empty
--                       (presence 0); no lane takes o or anything after it (never dropped)
--   {-1, cause, lane}   corrupt: cause is a code of watermark.rs::CorruptCause, lane or -1
local LANES = 64
local LANE_BYTES = 19
local FULL = 1216
local sbyte, ssub, schar, srep = string.byte, string.sub, string.char, string.rep
local ZERO18 = srep('\0', 18)
local U64MAX = '18446744073709551615'

local function corrupt(cause, lane)
  return {-1, cause, lane or -1}
end

-- Canonical decimal u64: 0 | [1-9][0-9]*, at most U64MAX. Digit-wise compare (no strcoll).
local function bad_epoch(e)
  local n = #e
  if n == 0 or n > 20 then return true end
  if not string.find(e, '^[0-9]+$') then return true end
  if n > 1 and sbyte(e, 1) == 48 then return true end
  if n == 20 then
    for i = 1, 20 do
      local a, b = sbyte(e, i), sbyte(U64MAX, i)
      if a < b then return false end
      if a > b then return true end
    end
  end
  return false
end

-- HGETALL + HLEN/field checks. Returns layout, epoch, blob, or nil and a reply.
local function wm_fields(key)
  local raw = redis.call('HGETALL', key)
  local n = #raw
  if n == 0 then return nil, {5} end
  if n ~= 6 then return nil, corrupt('field_count') end
  local layout, epoch, blob
  for i = 1, 5, 2 do
    local f = raw[i]
    if f == 'wm_layout' then layout = raw[i + 1]
    elseif f == 'wm_epoch' then epoch = raw[i + 1]
    elseif f == 'wm_blob' then blob = raw[i + 1] end
  end
  if not layout or not epoch or not blob then return nil, corrupt('missing_field') end
  return layout, epoch, blob
end

local function u48(blob, p)
  local a, b, c, d, e, f = sbyte(blob, p, p + 5)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end

local function u48s(n)
  local f = n % 256; n = (n - f) / 256
  local e = n % 256; n = (n - e) / 256
  local d = n % 256; n = (n - d) / 256
  local c = n % 256; n = (n - c) / 256
  local b = n % 256; n = (n - b) / 256
  return schar(n, b, c, d, e, f)
end

-- Validates the lane record at byte offset base (0-based). Returns presence, W, W_floor,
-- or nil and a cause code.
local function lane_at(blob, base)
  local p = sbyte(blob, base + 1)
  if p == 0 then
    if ssub(blob, base + 2, base + 19) ~= ZERO18 then return nil, 'nonzero_empty_lane' end
    return 0, 0, 0
  end
  if p ~= 1 then return nil, 'bad_presence' end
  local w, fl, wr = u48(blob, base + 2), u48(blob, base + 8), u48(blob, base + 14)
  if w ~= wr then return nil, 'w_mismatch' end
  if w < fl then return nil, 'w_below_floor' end
  return 1, w, fl
end

-- Decodes a 19- or 1216-byte blob into arrays P, W, F indexed 1..64 (lane + 1),
-- validating every lane. Returns P, W, F or nil and a corrupt reply.
local function lanes_decode(blob)
  local P, W, F = {}, {}, {}
  if #blob == LANE_BYTES then
    local p, w, fl = lane_at(blob, 0)
    if not p then return nil, corrupt(w, 0) end
    for l = 1, LANES do P[l], W[l], F[l] = p, w, fl end
  else
    for l = 1, LANES do
      local p, w, fl = lane_at(blob, (l - 1) * LANE_BYTES)
      if not p then return nil, corrupt(w, l - 1) end
      P[l], W[l], F[l] = p, w, fl
    end
  end
  return P, W, F
end

local function lane_bytes(p, w, fl)
  if p == 0 then return '\0' .. ZERO18 end
  local ws = u48s(w)
  return '\1' .. ws .. u48s(fl) .. ws
end

local function lanes_uniform(P, W, F)
  local p1, w1, f1 = P[1], W[1], F[1]
  for l = 2, LANES do
    if P[l] ~= p1 or W[l] ~= w1 or F[l] ~= f1 then return false end
  end
  return true
end

local function lanes_full(P, W, F)
  local parts = {}
  for l = 1, LANES do parts[l] = lane_bytes(P[l], W[l], F[l]) end
  return table.concat(parts)
end

-- Lowest and highest W among present lanes (-1, -1 when none is present).
local function present_range(P, W)
  local lo, hi = -1, -1
  for l = 1, LANES do
    if P[l] == 1 then
      if lo < 0 or W[l] < lo then lo = W[l] end
      if W[l] > hi then hi = W[l] end
    end
  end
  return lo, hi
end

-- Lanes whose chunk of the record is durable, from the staging hash (fields: lane numbers).
local function staged(key)
  local done = {}
  local raw = redis.call('HKEYS', key)
  for i = 1, #raw do done[tonumber(raw[i])] = true end
  return done
end

-- Moves every present lane whose CAS holds (W == prev) and whose chunk, if the lane needs
-- one (needed: 64 chars '0'/'1', or '' for none), is durable. Returns advanced, held, gap,
-- and the first needed lane that is empty (-1 for none). A record that has recipients in an
-- empty lane is not taken by any lane: an empty lane has no W that could cover it, so moving
-- the others would let GC trim it and drop those recipients' messages. It stays held whole
-- (the caller stops and reports the shard) until an operator initialises the lane.
local function apply_record(P, W, off, prev, needed, done)
  local adv, held, gap = 0, 0, 0
  local check = #needed == LANES
  -- a replay when every present lane is at or past o (and at least one lane is present)
  local present, behind = false, false
  for l = 1, LANES do
    if P[l] == 1 then
      present = true
      if W[l] < off then behind = true; break end
    end
  end
  if present and not behind then return 0, 0, 0, -1 end
  if check then
    for l = 1, LANES do
      if P[l] == 0 and sbyte(needed, l) == 49 then return 0, 0, 0, l - 1 end
    end
  end
  for l = 1, LANES do
    if P[l] == 1 and W[l] < off then
      if W[l] ~= prev then
        gap = gap + 1
      elseif check and sbyte(needed, l) == 49 and not done[l - 1] then
        held = held + 1
      else
        W[l] = off
        adv = adv + 1
      end
    end
  end
  return adv, held, gap, -1
end

-- empty: {lane, offset} of a record held by an empty lane, or nil.
local function advance_reply(adv, held, gap, P, W, empty)
  local lo, hi = present_range(P, W)
  if empty then return {7, adv, held, gap, lo, hi, empty[1], empty[2]} end
  local status = 1
  if adv > 0 then status = 0 elseif gap > 0 then status = 2 elseif held > 0 then status = 6 end
  return {status, adv, held, gap, lo, hi}
end
