-- shard_lease.lua — the lease of shard s: which node may own it (core Redis, the shard's own
-- instance, so the key shares the shard's slot). The lease is changed only here, by
-- compare-and-set, and expires on the Redis side (PX): lease time is Redis time, never a node's
-- clock. Safety does not rest on the lease: the node that wins it then raises wm_epoch (the
-- claim), and every write of the materializer scripts is fenced by that epoch (ADR-0030).
--
-- KEYS[1]  lease:{s}   string  the owner's node id, with a PX expiry
-- ARGV[1]  op          "acquire" | "renew" | "release"
-- ARGV[2]  node id     string, 1..=128 bytes
-- ARGV[3]  ttl_ms      decimal u64 > 0 (acquire, renew; ignored by release)
--
-- acquire: taken when absent (or expired) or already held by ARGV[2]; the expiry is set anew.
-- renew:   the expiry is set anew only when held by ARGV[2].
-- release: deleted only when held by ARGV[2].
--
-- Returns {0, fresh}          held by ARGV[2] now (acquire: fresh 1 when it was free, 0 when it
--                             was already ours; renew: fresh 0) | released (release: fresh 0)
--       | {1, owner, pttl}    held by another node (nothing written)
--       | {2}                 renew or release of a lease that is absent (expired)
-- Errors: "ERR bad_op" for another ARGV[1]; "ERR bad_ttl" for a ttl that is not > 0.
-- Publishes nothing.
local op, node = ARGV[1], ARGV[2]
local owner = redis.call('GET', KEYS[1])
if op == 'release' then
  if not owner then return {2} end
  if owner ~= node then return {1, owner, redis.call('PTTL', KEYS[1])} end
  redis.call('DEL', KEYS[1])
  return {0, 0}
end
local ttl = tonumber(ARGV[3])
if not ttl or ttl <= 0 then return redis.error_reply('bad_ttl') end
if op == 'acquire' then
  if owner and owner ~= node then return {1, owner, redis.call('PTTL', KEYS[1])} end
  redis.call('SET', KEYS[1], node, 'PX', ttl)
  if owner then return {0, 0} end
  return {0, 1}
elseif op == 'renew' then
  if not owner then return {2} end
  if owner ~= node then return {1, owner, redis.call('PTTL', KEYS[1])} end
  redis.call('PEXPIRE', KEYS[1], ttl)
  return {0, 0}
end
return redis.error_reply('bad_op')
