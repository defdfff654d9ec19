#!lua flags=allow-oom
-- mark_log_read.lua — the write a log reader's replica wait covers (ADR-0064; core Redis, the
-- shard's own slot). A log reader with `--core-wait-replicas` pipelines this script between
-- its read of `dlog:{s}` and `WAIT`: `WAIT` confirms only what its connection wrote, and since
-- replication is in order, confirming this write confirms every record the primary held when
-- the read ran.
--
-- It runs as EVAL (no NOSCRIPT: it is a few bytes, sent only by reads that found records) and
-- is flagged allow-oom: a core instance at `maxmemory` (with `noeviction`, as
-- docs/operations.md advises) refuses a plain `SET`, which would stop delivery of records
-- already acknowledged, and so the log trims that free memory. The write overwrites one small
-- string per shard: it does not grow.
--
-- KEYS[1]  dlogsync:{s}  string  overwritten with ARGV[1]
-- ARGV[1]  offset        decimal u64: the last record offset the reader found (informational)
--
-- Returns "OK". Errors: none of its own. Publishes nothing.
return redis.call('SET', KEYS[1], ARGV[1])
