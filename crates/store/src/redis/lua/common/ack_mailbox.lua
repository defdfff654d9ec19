-- ack_mailbox.lua — records a user's acknowledged seq (monotonic) and trims the mailbox
-- entries at or below it. The gateway caps the seq at what it has delivered.
--
-- KEYS[1]  ack:{s}          hash  user -> acked seq
-- KEYS[2]  mb:{s}:<user>    zset  the user's mailbox
-- ARGV[1]  user             string, the mailbox owner
-- ARGV[2]  seq              decimal u48
--
-- Returns {0, acked} where acked is the (possibly unchanged) acked seq. Publishes nothing.
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local seq = tonumber(ARGV[2])
if seq > cur then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', seq)
  cur = seq
end
return {0, cur}
