-- node_heartbeat.lua — a node says it is alive (core Redis, instance 0). Its record expires on
-- the Redis side; the live list is read by node_list.lua. Redis time only (TIME), never the
-- node's clock.
--
-- KEYS[1]  {tidemark}:nodes        zset  node id -> Redis ms at which its record expires
-- KEYS[2]  {tidemark}:node:<id>    hash  url, role, layout, reads, unreached, incarnation,
--                                        ownership, owns, ownership_beat, beat (Redis ms of the
--                                        last heartbeat)
-- ARGV[1]  node id     string, 1..=128 bytes
-- ARGV[2]  ttl_ms      decimal u64 > 0: how long the record lives without another heartbeat
-- ARGV[3]  url         string, the node's advertised client URL
-- ARGV[4]  role        "all" | "gateway" | "materializer"
-- ARGV[5]  layout      the watermark layout the node writes ("packed-v1" | "packed-v2"); the
--                      shards go to the nodes of the newest layout (ADR-0033)
-- ARGV[6]  reads       decimal u32, the newest deployment identity version the node's code
--                      reads (`tidemark upgrade` raises a deployment's version only when every
--                      live node reads the new one, ADR-0056; a record without it is a build
--                      from before ADR-0056, which reads at most version 3)
-- ARGV[7]  unreached   the core instances the node has not reached for a lease TTL, decimal
--                      indices joined by ',' ("" for none; absent from a build before
--                      ADR-0113): the shards of those instances are assigned to the nodes
--                      that reach them
-- ARGV[8]  incarnation a random string per process ("" or absent: not checked): a record of
--                      this id written by another incarnation, still live, refuses the
--                      heartbeat (ADR-0114: two processes with one id would share leases)
-- ARGV[9]  ownership   "leases" | "static" ("" or absent: not said, a build before ADR-0131):
--                      how the node obtains its shards. Only leases nodes share the balanced
--                      assignment; the shards a static node owns are left to it
-- ARGV[10] owns        the shards a static node owns, as ranges ("0-3,7"; "" for none)
--
-- ownership_beat is set to the heartbeat's time with ownership and owns: node_list.lua counts
-- them only while it equals beat, so a record beaten since by a build that does not write them
-- (a downgrade under the same id) does not go on claiming shards for a static owner.
--
-- Returns now_ms (Redis time of the heartbeat). Expired members are removed from KEYS[1].
-- Errors: "ERR bad_ttl" for a ttl that is not > 0; "ERR node_id_in_use" when a live record of the
-- id has another incarnation (nothing written).
-- Publishes nothing.
local ttl = tonumber(ARGV[2])
if not ttl or ttl <= 0 then return redis.error_reply('bad_ttl') end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local inc = ARGV[8] or ''
if inc ~= '' then
  local cur = redis.call('HGET', KEYS[2], 'incarnation')
  if cur and cur ~= '' and cur ~= inc then return redis.error_reply('node_id_in_use') end
end
redis.call('HSET', KEYS[2], 'url', ARGV[3], 'role', ARGV[4], 'layout', ARGV[5], 'reads', ARGV[6],
  'unreached', ARGV[7] or '', 'incarnation', inc, 'ownership', ARGV[9] or '', 'owns',
  ARGV[10] or '', 'ownership_beat', now, 'beat', now)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return now
