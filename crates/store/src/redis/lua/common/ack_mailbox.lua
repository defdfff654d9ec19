-- ack_mailbox.lua — records users' acknowledged seqs (monotonic) and trims the mailbox
-- entries at or below them: n acks in one call (ADR-0053; one ack is n = 1). The gateway
-- caps each seq at what it has delivered.
--
-- Ack i (1-based), in the call's order:
-- KEYS[2i-1]  ack:{s}          hash  user -> acked seq
-- KEYS[2i]    mb:{s}:<user>    zset  the user's mailbox
-- ARGV[2i-1]  user             string, the mailbox owner
-- ARGV[2i]    seq              decimal u48
-- On a Redis Cluster every key of a call is in one slot: a call holds acks of one shard.
--
-- Returns a flat array, two values per ack, in the call's order:
--   {0, acked}   acked is the (possibly unchanged) acked seq after the ack
-- | {1, error}   this ack failed with an error of Redis or Lua (a key of another type, an
--                acked seq that is not a number; error: the message, a string). The acks
--                before and after it are not affected; what this one wrote before its error
--                stays written (as for a failed call of one ack).
-- Each ack stands alone, as if it were its own call: a later ack of the same mailbox in the
-- call sees what an earlier one wrote. Publishes nothing.
local out = {}
local nout = 0

-- ack i: returns the acked seq after it
local function ack(i)
  local a, mb, user, s = KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1], ARGV[2 * i]
  local cur = tonumber(redis.call('HGET', a, user) or '0')
  local seq = tonumber(s)
  if seq > cur then
    redis.call('HSET', a, user, s)
    redis.call('ZREMRANGEBYSCORE', mb, '-inf', seq)
    cur = seq
  end
  return cur
end

for i = 1, #KEYS / 2 do
  local ok, v = pcall(ack, i)
  if ok then
    out[nout + 1], out[nout + 2] = 0, v
  else
    out[nout + 1], out[nout + 2] = 1, type(v) == 'table' and v.err or tostring(v)
  end
  nout = nout + 2
end
return out
