-- write_lane_chunk.lua — writes one lane's chunk of a many-recipient record and marks it
-- durable in the record's staging state. Idempotent: an entry is its MailboxSeq-prefixed
-- member, so a retried chunk adds nothing. Not one of ADR-0015's five scripts: it reads only
-- wm_epoch (to fence), never wm_blob.
--
-- KEYS[1]    wm:{s}        hash  the shard's watermark (wm_epoch read only)
-- KEYS[2]    stg:{s}:<o>   hash  staging state of record o (field = lane number)
-- KEYS[3]    stgidx:{s}    zset  offsets that have staging state
-- KEYS[3+j]  mb:{s}:<r_j>  zset  mailbox of recipient j of this lane
-- ARGV[1]    epoch         decimal u64, must equal wm_epoch
-- ARGV[2]    offset        decimal u48, the record's offset o (score of every entry)
-- ARGV[3]    lane          decimal 0..63
-- ARGV[3+j]  entry of recipient j   bytes
--
-- Returns {0, entries} | {3, epoch} fenced | {5} missing. Writes nothing when fenced.
-- Publishes nothing.
local epoch = redis.call('HGET', KEYS[1], 'wm_epoch')
if not epoch then return {5} end
if epoch ~= ARGV[1] then return {3, epoch} end
local off = ARGV[2]
for j = 4, #KEYS do
  redis.call('ZADD', KEYS[j], off, ARGV[j])
end
redis.call('HSET', KEYS[2], ARGV[3], '1')
redis.call('ZADD', KEYS[3], off, off)
return {0, #KEYS - 3}
