-- v1/_layout.lua — packed-v1 layout rules as they were before ADR-0015 ("old code"), kept
-- to prove that old code fails closed on packed-v2 data and for side-by-side benchmarks.
-- The layout must be exactly packed-v1 and the blob exactly 1216 bytes; the uniform check is
-- ADR-0011's two-sub compare; a uniform write-back is string.rep(record, 64).

local function wm_read(key)
  local layout, epoch, blob = wm_fields(key)
  if not layout then return nil, epoch end
  if layout ~= 'packed-v1' then return nil, corrupt('unknown_layout') end
  if #blob ~= FULL then return nil, corrupt('bad_length') end
  if bad_epoch(epoch) then return nil, corrupt('bad_epoch') end
  return layout, epoch, blob
end

-- ADR-0011's check: builds two ~1197-byte strings and compares them.
local function stored_uniform(blob)
  return ssub(blob, LANE_BYTES + 1) == ssub(blob, 1, -(LANE_BYTES + 1))
end

local function lanes_encode(P, W, F)
  if lanes_uniform(P, W, F) then return srep(lane_bytes(P[1], W[1], F[1]), LANES) end
  return lanes_full(P, W, F)
end

local function write_back(key, layout, old, P, W, F)
  local blob = lanes_encode(P, W, F)
  if blob ~= old then redis.call('HSET', key, 'wm_blob', blob) end
end
