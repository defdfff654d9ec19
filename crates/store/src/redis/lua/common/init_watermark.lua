-- init_watermark.lua — creates wm:{s} in one atomic step (`tidemark wm init`, `serve`
-- initialising missing shards). Refuses an existing watermark unless forced, so a running
-- deployment's watermark is never overwritten by accident. The blob is encoded by Rust
-- (redis/watermark.rs, canonical form).
--
-- A forced overwrite never moves the shard's epoch back (ADR-0110): the epoch written is the
-- larger of ARGV[2] and the existing wm_epoch + 1, so every owner of the old watermark is
-- fenced. An existing wm_epoch that is not a canonical decimal u64 (a corrupt watermark, or
-- a key that is not a hash) is not compared: ARGV[2] is written.
--
-- KEYS[1]  wm:{s}   hash  the shard's watermark
-- ARGV[1]  layout   "packed-v1" | "packed-v2"
-- ARGV[2]  epoch    decimal u64 (canonical: no sign, no leading zero)
-- ARGV[3]  blob     bytes, 19 or 1216
-- ARGV[4]  force    "1" to overwrite, else "0"
--
-- Returns the epoch written (a decimal string) | 0 refused (a watermark exists). Publishes
-- nothing.
local function canonical(e)
  return type(e) == 'string' and #e >= 1 and #e <= 20
    and (e == '0' or string.match(e, '^[1-9][0-9]*$') ~= nil)
    and (#e < 20 or e <= '18446744073709551615')
end
-- a < b for canonical decimals of any length (no float rounding)
local function less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
-- a + 1 for a canonical decimal, as a string
local function plus_one(a)
  local out, carry = {}, 1
  for i = #a, 1, -1 do
    local d = string.byte(a, i) - 48 + carry
    if d == 10 then d, carry = 0, 1 else carry = 0 end
    out[i] = string.char(48 + d)
  end
  local s = table.concat(out)
  if carry == 1 then s = '1' .. s end
  return s
end

local epoch = ARGV[2]
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[4] ~= '1' then return 0 end
  local current = false
  if redis.call('TYPE', KEYS[1]).ok == 'hash' then
    current = redis.call('HGET', KEYS[1], 'wm_epoch')
  end
  if canonical(current) then
    local next_epoch = plus_one(current)
    if less(epoch, next_epoch) then epoch = next_epoch end
    if not canonical(epoch) then
      return redis.error_reply('ERR epoch of ' .. KEYS[1] .. ' cannot be raised above u64')
    end
  end
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'wm_layout', ARGV[1], 'wm_epoch', epoch, 'wm_blob', ARGV[3])
return epoch
