-- node_list.lua — the live nodes (core Redis, instance 0), as of Redis time.
--
-- KEYS[1]  {tidemark}:nodes   zset  node id -> Redis ms at which its record expires
-- ARGV[1]  key prefix         string, "{tidemark}:node:" (the record of id is prefix .. id)
--
-- Returns {now_ms, id1, url1, role1, beat1, layout1, reads1, unreached1, ownership1, owns1, id2,
-- …}: every node whose record has not expired, by id; beat is the Redis ms of its last
-- heartbeat; layout is "" for a record written without one (a build before ADR-0033), reads ""
-- for one written without the newest identity version its code reads (a build before
-- ADR-0056), unreached "" for a node that reaches every core instance or a build before
-- ADR-0113, ownership and owns "" for a record whose last heartbeat did not write them (a
-- build before ADR-0131: ownership_beat differs from beat). A member whose record is gone is
-- skipped.
-- Writes nothing (the heartbeat removes expired members). Publishes nothing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
table.sort(ids)
local out = {now}
for _, id in ipairs(ids) do
  local r = redis.call('HMGET', ARGV[1] .. id, 'url', 'role', 'beat', 'layout', 'reads',
    'unreached', 'ownership', 'owns', 'ownership_beat')
  if r[1] and r[2] and r[3] then
    local said = r[9] == r[3]
    out[#out + 1] = id
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
    out[#out + 1] = tonumber(r[3])
    out[#out + 1] = r[4] or ''
    out[#out + 1] = r[5] or ''
    out[#out + 1] = r[6] or ''
    out[#out + 1] = said and r[7] or ''
    out[#out + 1] = said and r[8] or ''
  end
end
return out
