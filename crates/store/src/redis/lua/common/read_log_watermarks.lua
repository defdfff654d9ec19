-- read_log_watermarks.lua — returns the raw fields of the shards asked for, for Rust to
-- decode with redis/watermark.rs::decode_lane_watermarks [ADR-0015]. It validates nothing
-- itself, so that exactly one decoder (Rust's) judges what it returns.
--
-- KEYS[i]  wm:{s_i}  hash  watermarks of the shards asked for (standalone: any shards;
--                          Redis Cluster: shards of one slot only)
-- ARGV     none
--
-- Returns an array with, per key, the flat HGETALL reply (empty when the key is missing), or
-- for a key that is not a hash {-1, 'wrong_type', TYPE} (ADR-0123: the one key's reply says
-- so and the other keys are still read; a flat HGETALL reply holds strings only, never the
-- number -1). Before, HGETALL's WRONGTYPE aborted the script and failed every shard asked.
-- Writes nothing. Publishes nothing.
local out = {}
for i = 1, #KEYS do
  local r = redis.pcall('HGETALL', KEYS[i])
  if type(r) == 'table' and r.err then
    local t = redis.call('TYPE', KEYS[i]).ok
    -- any other error (none is known for a read) fails the call, as before
    if t == 'hash' or t == 'none' then return r end
    out[i] = {-1, 'wrong_type', t}
  else
    out[i] = r
  end
end
return out
