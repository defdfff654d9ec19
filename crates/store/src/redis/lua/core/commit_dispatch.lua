-- commit_dispatch.lua — commits one message to one shard's dispatch log (core Redis).
-- Dedupes on (sender, client id): a retried send returns the offset first assigned and adds
-- nothing. Offsets are contiguous u48 from 1; the stream id of offset o is "o-0". A log whose
-- head is already 2^48-1 takes no more records: the commit is refused before INCR, so no
-- offset above u48 is ever assigned (the mailbox entry keeps only 48 bits of it).
--
-- The dedupe key is length-prefixed (KEYS[3]). KEYS[4] is its earlier, ambiguous form: read
-- so that records written before the change still dedupe for their 24 h, never written. A hit
-- on either is the duplicate (safe: NUL cannot appear in a valid sender or client id).
--
-- The dedupe record also holds a digest of the whole request (every recipient of every
-- shard, and the body): a resend with the same id but another request is refused (id
-- reused) instead of being answered with the first one's offset. Records without a digest
-- (written before digests, and legacy keys) are plain duplicates.
--
-- KEYS[1]  dlog:{s}                          stream  the dispatch log
-- KEYS[2]  head:{s}                          string  last assigned offset
-- KEYS[3]  dd:{s}:<n>:<sender><client id>    string  dedupe record "<offset>:<digest>";
--                                                    n = #ARGV[1]
-- KEYS[4]  dd:{s}:<sender>\0<client id>      string  legacy dedupe record -> offset (read only)
-- ARGV[1]  sender        string
-- ARGV[2]  client id     string
-- ARGV[3]  recipients    bytes, recipients of this shard (u8 length + bytes, repeated)
-- ARGV[4]  body          bytes
-- ARGV[5]  sent_at_us    decimal u64
-- ARGV[6]  dedupe_ttl_s  decimal, seconds the dedupe record (KEYS[3]) lives
-- ARGV[7]  digest        hex string, digest of the whole request (no ':')
-- ARGV[8]  wake channel  optional; on a Redis Cluster `dlogwake:{s}` (same slot as KEYS[1])
--
-- Returns {0, offset} committed
--       | {1, offset} duplicate (nothing written)
--       | {2, head}   log exhausted: head is already 2^48-1 (nothing written)
--       | {3, offset} id reused: the id was committed with another request (nothing written)
-- Publishes, only when ARGV[8] is given and something was committed: SPUBLISH ARGV[8] <offset>,
-- a hint for materializers on a Redis Cluster, where one blocking XREAD cannot wait on the logs
-- of several shards (several slots). On one instance nothing is published: the materializer
-- waits with XREAD BLOCK.
local dup = redis.call('GET', KEYS[3])
if dup then
  local off, digest = string.match(dup, '^(%d+):(.*)$')
  if not off then return {1, tonumber(dup)} end
  if digest ~= ARGV[7] then return {3, tonumber(off)} end
  return {1, tonumber(off)}
end
dup = redis.call('GET', KEYS[4])
if dup then return {1, tonumber(dup)} end
local head = tonumber(redis.call('GET', KEYS[2]) or '0')
if head >= 281474976710655 then return {2, head} end
local off = redis.call('INCR', KEYS[2])
local o = string.format('%d', off)
redis.call('XADD', KEYS[1], o .. '-0', 'p', string.format('%d', off - 1), 'f', ARGV[1],
  'c', ARGV[2], 'r', ARGV[3], 'b', ARGV[4], 't', ARGV[5])
redis.call('SET', KEYS[3], o .. ':' .. ARGV[7], 'EX', ARGV[6])
if ARGV[8] then redis.call('SPUBLISH', ARGV[8], o) end
return {0, off}
