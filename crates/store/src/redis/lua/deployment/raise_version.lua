-- raise_version.lua — raises the version of a deployment identity (`tidemark upgrade`,
-- ADR-0056): the only rewrite of an identity. A compare-and-set, so a second run, or two
-- operators at once, change nothing more.
--
-- KEYS[1]  tidemark:deployment (or tidemark:deployment:<role> on a cluster)  hash  the identity
-- ARGV[1]  from   decimal u32, the version the caller found (and checked may be raised)
-- ARGV[2]  to     decimal u32, the version to record
--
-- Returns {1, to}        raised: the version was `from`, it is `to` now
--       | {0, version}   nothing written: the version is not `from` (`version` is what it is,
--                        "" when the identity or its version is absent)
-- Publishes nothing.
local v = redis.call('HGET', KEYS[1], 'version')
if v ~= ARGV[1] then
  return {0, v or ''}
end
redis.call('HSET', KEYS[1], 'version', ARGV[2])
return {1, ARGV[2]}
