-- v2/_layout.lua — packed-v2 layout rules (ADR-0015), prepended after common/_lanes.lua.
-- Reads packed-v1 (1216 bytes) and packed-v2 (19 or 1216 bytes); always writes canonical
-- packed-v2: 19 bytes exactly when all 64 lanes are identical.

-- Returns layout, epoch, blob (header fully validated), or nil and a reply.
local function wm_read(key)
  local layout, epoch, blob = wm_fields(key)
  if not layout then return nil, epoch end
  local len = #blob
  if layout == 'packed-v2' then
    if len ~= LANE_BYTES and len ~= FULL then return nil, corrupt('bad_length') end
  elseif layout == 'packed-v1' then
    if len ~= FULL then return nil, corrupt('bad_length') end
  else
    return nil, corrupt('unknown_layout')
  end
  if bad_epoch(epoch) then return nil, corrupt('bad_epoch') end
  return layout, epoch, blob
end

-- Uniform check of the stored form: the length alone decides (O(1), no string built).
local function stored_uniform(blob)
  return #blob == LANE_BYTES
end

local function lanes_encode(P, W, F)
  if lanes_uniform(P, W, F) then return lane_bytes(P[1], W[1], F[1]) end
  return lanes_full(P, W, F)
end

-- Writes the canonical form back; packed-v1 data becomes packed-v2 on its first write.
local function write_back(key, layout, old, P, W, F)
  local blob = lanes_encode(P, W, F)
  if layout ~= 'packed-v2' then
    redis.call('HSET', key, 'wm_layout', 'packed-v2', 'wm_blob', blob)
  elseif blob ~= old then
    redis.call('HSET', key, 'wm_blob', blob)
  end
end
