-- commit_dispatch.lua — commits groups of messages to shards' dispatch logs (core Redis): one
-- part per shard, each part's messages in the order given (group commit, ADR-0036; several
-- shards in one call, ADR-0051): message i is decided, and when committed written, before
-- message i + 1 is looked at, so a part gives the same answers and the same log as the same
-- messages committed one call each, in that order. Parts run in the order given, each with
-- its own log and head, independent of each other except that a message answered {4, 0}
-- defers the later messages of its log, in later parts too (ADR-0091, below).
--
-- Per message: dedupes on (sender, client id): a retried send returns the offset first
-- assigned and adds nothing (also when the first send is earlier in the same group).
-- Offsets are contiguous u48 from 1; the stream id of offset o is "o-0". A log whose head is
-- already 2^48-1 takes no more records: the message is refused before an offset is taken, so
-- no offset above u48 is ever assigned (the mailbox entry keeps only 48 bits of it); the
-- messages after it in the group are refused too (a duplicate among them is still answered).
--
-- The dedupe key is length-prefixed (the first key of a message). The second is its earlier,
-- ambiguous form: read so that records written before the change still dedupe for their
-- 24 h, never written. A hit on either is the duplicate (safe: NUL cannot appear in a valid
-- sender or client id).
--
-- The dedupe record also holds a digest of the whole request (every recipient of every
-- shard, and the body): a resend with the same id but another request is refused (id
-- reused) instead of being answered with the first one's offset. Records without a digest
-- (written before digests, and legacy keys) are plain duplicates.
--
-- A message may carry its id claim (ADR-0037; ADR-0026's binding of (sender, id) to the
-- request digest, otherwise one `SET NX GET EX` the gateway sends before the commits): when
-- its claim flag is '1', the script makes that SET first, on KEYS[k+2] (the sender's home
-- shard's key: the caller passes it only where the key is on this instance, and on a Redis
-- Cluster only in this slot); a claim holding another digest refuses the message (id
-- reused, nothing written); a claim holding this digest is a resend (the dedupe answers).
-- With the flag '0' KEYS[k+2] is not touched (callers pass the dedupe key again).
--
-- With the flag '2' (ADR-0040, deployments of identity version 2 only) the claim is also
-- the message's only dedupe record: a fresh claim is written once the message is
-- committed, as "<offset>:<digest>" (the dedupe record's form), and no dedupe record is
-- written or read. A claim found as "<offset>:<digest>" answers the message (duplicate, or
-- id reused with that offset); a bare digest (the claim of a send to several shards, or of
-- one committed without the flag) is compared as with '1' and, when it is this message's,
-- the dedupe records decide as with '1'. Such deployments were created by code that claims
-- every id, so no dedupe record without a claim, and no legacy record, can exist in them.
--
-- A fresh one-key claim is written before its message's XADD, as it will stand once the
-- message is committed ("<head + 1>:<digest>"), by the same `SET NX GET` that reads it
-- (ADR-0052: one command less per message); if that XADD fails, the claim is deleted again,
-- so that nothing is written for a refused message. At the end of the offset space (head
-- already 2^48-1) the claim is only read.
--
-- With the flag '3' (ADR-0043) a message is the same as with '2' but passes only its claim's
-- key: the dedupe keys of a one-key claim are read only when the claim is a bare digest
-- equal to this message's (one committed by a gateway before ADR-0040, or a claim left by
-- the two-step claim of ADR-0026). Such a message is answered {4, 0} and nothing is written
-- for it; the caller sends it again with the flag '2' and its three keys.
--
-- A log's messages are committed in the order given, also across that second call
-- (ADR-0091): after a {4, 0}, every later message of the same log in this call (the rest of
-- the part, and of any later part naming the same log) is answered {7, 0} without being
-- looked at, and nothing is written for it; the caller sends it again after the message
-- answered {4, 0}, in the same order. Without this, a later send of the same connection
-- would take an offset below that message's.
--
-- Layout: ARGV[1] is the TTL, ARGV[2] the number of parts m, ARGV[3] the record form; then
-- each part in turn. A part has two keys (its log, its head) followed by its messages' keys,
-- and two arguments (its message count n, its wake channel) followed by w per message: seven
-- with the form 'f', three with the form 'm'. A message's keys follow
-- those of the message before it: three (k = the first) for the flags '0', '1' and '2', one
-- (its claim: KEYS[k+2] below is that key) for the flag '3'. Below, indices are relative:
-- KEYS[1] is the part's first key, ARGV[a] its first argument (ARGV[4] for the first part),
-- message i's arguments are ARGV[a+2+w(i-1)] ..; the next part starts after the last.
--
-- The record form (ADR-0055): 'f' writes a log entry of six fields (p f c r b t: the
-- sender, client id, recipients, body and sent_at each its own field and argument); 'm'
-- writes two (p, and m: the message packed by the caller, `redis/dlog.rs`'s layout), which
-- is what a deployment of identity version 3 writes. The script never looks inside either:
-- it passes them to XADD. Readers of the log take both forms.
--
-- On a Redis Cluster every key of a call must be in one slot: a call there has one part
-- (and a claim key only of that shard). On one instance a call may hold any shards.
--
-- Per part:
-- KEYS[1]      dlog:{s}                          stream  the dispatch log
-- KEYS[2]      head:{s}                          string  last assigned offset
-- KEYS[k]      dd:{s}:<n>:<sender><client id>    string  dedupe record "<offset>:<digest>";
--                                                        n = #sender (not with flag '3')
-- KEYS[k+1]    dd:{s}:<sender>\0<client id>      string  legacy dedupe record -> offset
--                                                        (read only; not with flag '3')
-- KEYS[k+2]    msgid:{h}:<n>:<sender><client id> string  id claim -> digest (h: the sender's
--                                                        home shard); with flag '1', '2' or
--                                                        '3' (then the message's only key)
-- Per call:
-- ARGV[1]      dedupe_ttl_s  decimal, seconds the dedupe records (and claims) live
-- ARGV[2]      m             decimal, parts in the call (>= 1)
-- ARGV[3]      form          'f': six-field records, 7 arguments per message; 'm': packed
--                            records, 3 arguments per message (ADR-0055); either followed
--                            by 'w' when the caller confirms the call with `WAIT`
--                            (ADR-0116): a part that answers a duplicate and commits
--                            nothing writes its head again (the same value), so that the
--                            `WAIT` on this connection covers the first commit too
-- Per part (relative to its first argument a):
-- ARGV[a]      n             decimal, messages in the part (>= 1)
-- ARGV[a+1]    wake channel  '' for none; on a Redis Cluster `dlogwake:{s}` (same slot as
--                            its KEYS[1])
-- Per message with the form 'f' (relative to its first argument b = a + 2 + 7(i-1)):
-- ARGV[b]      sender        string
-- ARGV[b+1]    client id     string
-- ARGV[b+2]    recipients    bytes, recipients of this shard (u8 length + bytes, repeated)
-- ARGV[b+3]    body          bytes
-- ARGV[b+4]    sent_at_us    decimal u64
-- ARGV[b+5]    digest        hex string, digest of the whole request (no ':')
-- ARGV[b+6]    claim         '1': claim the id on KEYS[k+2] first; '2': the same as one key
--                            (ADR-0040); '3': '2' with one key (ADR-0043); '0': no claim
-- Per message with the form 'm' (b = a + 2 + 3(i-1)):
-- ARGV[b]      record        bytes, the message packed (sender, client id, recipients of
--                            this shard, sent_at_us, body: `redis/dlog.rs`), stored as is
-- ARGV[b+1]    digest        as ARGV[b+5] above
-- ARGV[b+2]    claim         as ARGV[b+6] above
--
-- An XADD that fails (a log whose last id is at or above head + 1: a damaged instance; or
-- the instance refusing the write: OOM, READONLY, NOREPLICAS, MISCONF, which the caller
-- tells apart by the message) ends its part: what the part committed before it stays
-- committed and counted in the head, and that message and the part's later ones are
-- answered {5, error} without anything written for them (the callers retry; their dedupe
-- holds). Any other error inside a part ends that part alone the same way ({6, error},
-- below; before ADR-0051 it failed the call). The other parts are not affected.
--
-- Returns a flat array, two values per message, parts in the call's order, each part's
-- messages in its order:
--   {0, offset} committed
-- | {1, offset} duplicate (nothing written, but the head's rewrite of a 'w' call)
-- | {2, head}   log exhausted: head is already 2^48-1 (nothing written)
-- | {3, offset} id reused: the id was committed with another request (nothing written);
--               offset 0 when the claim (ARGV[b+6]) named another request (a bare
--               digest)
-- | {4, 0}      flag '3' only: this message needs its dedupe keys; send it again with the
--               flag '2' (nothing written for it)
-- | {5, error}  its part's XADD failed at or before it (error: Redis's message, a string);
--               nothing written for it
-- | {7, 0}      deferred (ADR-0091): an earlier message of the same log in this call was
--               answered {4, 0}; nothing written for it; send it again after that one
-- | {6, error}  its part failed with an error of Redis or Lua (a head that is not a number,
--               a key of another type; error: the message, a string) at this message or
--               before it: answered for the message it failed at and the part's later ones;
--               the part's earlier messages keep their answers, and what they committed is
--               counted in the head (ADR-0099). Nothing is written for a message after the
--               one the part failed at; for that one, nothing the caller can rely on
-- Publishes, per part, only when its wake channel is not empty and something was committed
-- to it: one SPUBLISH <wake channel> <last offset>, a hint for materializers on a Redis
-- Cluster, where one blocking XREAD cannot wait on the logs of several shards (several
-- slots). On one instance nothing is published: the materializer waits with XREAD BLOCK.
local ttl = ARGV[1]
local m = tonumber(ARGV[2])
-- packed records (ADR-0055): 3 arguments per message, else 7
-- (short strings are interned: each comparison is a pointer's)
local form = ARGV[3]
local packed = form == 'm' or form == 'mw'
-- the caller waits for replicas after the call (ADR-0116)
local waited = form == 'mw' or form == 'fw'
local w = packed and 3 or 7
-- a message's digest and claim flag, relative to its first argument
local di, fi = w - 2, w - 1
local out = {}
-- the values in `out` (kept, not taken with #out, which searches the table)
local nout = 0
-- the logs whose later messages are deferred (answered {7, 0}, ADR-0091): nil until a
-- message is answered {4, 0}, then a set of log keys
local deferred = nil
-- the part being committed, where its error handler can see it (ADR-0099): its head key,
-- its wake channel, its head before the part and as it stands (committed records)
local p_head_key, p_wake, p_first, p_head, p_head_s = nil, nil, 0, 0, nil
-- and whether it answered a duplicate (ADR-0116; set where a message is answered {1, …})
local p_dup = false

-- Commits the part whose first key is KEYS[kb] and first argument ARGV[ab] (n messages),
-- appends its answers to `out`; returns the first key of the next part.
local function commit_part(kb, ab, n)
  local wake = ARGV[ab + 1]
  local log_key, head_key = KEYS[kb], KEYS[kb + 1]
  -- this log's messages from here on are deferred (ADR-0091)
  local defer = deferred ~= nil and deferred[log_key] == true
  local head = tonumber(redis.call('GET', head_key) or '0')
  local first = head
  p_head_key, p_wake, p_first, p_head = head_key, wake, head, head
  -- head and head + 1 as decimal strings, each formatted once (string.format is sprintf,
  -- a tenth of the script's instructions when it ran three times per message): the offset
  -- of a committed message is the next one's previous offset, and the head written at the
  -- end; nil until first needed
  local head_s, next_s = nil, nil
  -- the XADD error that ended this part's commits (its remaining messages answer {5, err})
  local failed = nil
  -- the first key of the next message
  local next_key = kb + 2
  for i = 1, n do
    local a = ab + 2 + w * (i - 1)
    local digest = ARGV[a + di]
    local st, v
    local claimed = nil
    local flag = ARGV[a + fi]
    local k = next_key
    local one_key = flag == '3'
    if one_key then
      -- its only key is read as KEYS[k + 2], like the claim of the other forms
      k, next_key, flag = next_key - 2, next_key + 1, '2'
    else
      next_key = next_key + 3
    end
    if failed then flag = 'failed' elseif defer then flag = 'deferred' end
    -- a fresh one-key claim written before the XADD, as it will stand once committed
    -- (ADR-0052); removed again if the XADD fails
    local written = false
    if flag == '1' then
      claimed = redis.call('SET', KEYS[k + 2], digest, 'NX', 'GET', 'EX', ttl)
    elseif flag == '2' then
      if head < 281474976710655 then
        next_s = next_s or string.format('%d', head + 1)
        claimed = redis.call('SET', KEYS[k + 2], next_s .. ':' .. digest, 'NX', 'GET', 'EX', ttl)
        written = not claimed
      else
        claimed = redis.call('GET', KEYS[k + 2])
      end
    end
    -- the key the message's dedupe record goes to when it is committed; nil: answered
    local record = nil
    local off, d
    if claimed then off, d = string.match(claimed, '^(%d+):(.*)$') end
    if failed then
      st, v = 5, failed
    elseif defer then
      st, v = 7, 0
    elseif off then
      -- a one-key claim (ADR-0040) answers the message
      if d == digest then st, v, p_dup = 1, tonumber(off), true else st, v = 3, tonumber(off) end
    elseif claimed and claimed ~= digest then
      st, v = 3, 0
    elseif flag == '2' and not claimed then
      record = KEYS[k + 2] -- a fresh one-key claim: the claim is the dedupe record
    elseif one_key then
      st, v = 4, 0 -- a bare digest of this message: its dedupe records decide; not passed
      -- the log's later messages in this call wait for this one (ADR-0091)
      defer = true
      deferred = deferred or {}
      deferred[log_key] = true
    else
      local dup = redis.call('GET', KEYS[k])
      if dup then
        off, d = string.match(dup, '^(%d+):(.*)$')
        if not off then st, v, p_dup = 1, tonumber(dup), true
        elseif d ~= digest then st, v = 3, tonumber(off)
        else st, v, p_dup = 1, tonumber(off), true end
      else
        dup = redis.call('GET', KEYS[k + 1])
        if dup then st, v, p_dup = 1, tonumber(dup), true else record = KEYS[k] end
      end
    end
    if record then
      if head >= 281474976710655 then st, v = 2, head
      else
        next_s = next_s or string.format('%d', head + 1)
        head_s = head_s or string.format('%d', head)
        local o = next_s
        local r
        if packed then
          r = redis.pcall('XADD', log_key, o .. '-0', 'p', head_s, 'm', ARGV[a])
        else
          r = redis.pcall('XADD', log_key, o .. '-0', 'p', head_s,
            'f', ARGV[a], 'c', ARGV[a + 1], 'r', ARGV[a + 2], 'b', ARGV[a + 3], 't', ARGV[a + 4])
        end
        if type(r) == 'table' and r.err then
          -- a log ahead of its head: this part commits nothing more (what it committed so
          -- far stays committed and counted in the head); the other parts go on
          if written then redis.call('DEL', record) end
          failed = r.err
          st, v = 5, failed
        else
          head, head_s, next_s = head + 1, o, nil
          p_head, p_head_s = head, head_s
          if not written then redis.call('SET', record, o .. ':' .. digest, 'EX', ttl) end
          st, v = 0, head
        end
      end
    end
    out[nout + 1], out[nout + 2] = st, v
    nout = nout + 2
  end
  if head ~= first then
    redis.call('SET', head_key, head_s)
    if wake ~= '' then redis.call('SPUBLISH', wake, head_s) end
  elseif p_dup and waited then
    -- A duplicate writes nothing, and `WAIT` confirms only what its connection wrote: a
    -- resend answered on another connection than its first commit's (another gateway, a
    -- reconnect) was confirmed at once, though no replica might have the record (ADR-0116).
    -- This write (the head as it stands) is replicated after the record, so the caller's
    -- `WAIT` on this connection covers it.
    redis.call('SET', head_key, string.format('%d', head))
  end
  return next_key
end

-- the first key and the first argument of the next part
local kb, ab = 1, 4
for _ = 1, m do
  local n = tonumber(ARGV[ab])
  local base = nout
  p_head_key, p_dup = nil, false
  local ok, e = pcall(commit_part, kb, ab, n)
  if ok then
    kb = e
  else
    -- an error inside the part (a head that is not a number, a key of another type): the
    -- part stops at the message it failed at; the other parts are not affected. What the
    -- part committed before it stays committed, answered, and counted in the head
    -- (ADR-0099: before, the head was left behind its log, and every later commit to the
    -- shard failed its XADD until the materializer's GC raised the head)
    local msg = type(e) == 'table' and e.err or tostring(e)
    if p_head_key and p_head ~= p_first then
      redis.call('SET', p_head_key, p_head_s)
      if p_wake ~= '' then redis.call('SPUBLISH', p_wake, p_head_s) end
    elseif p_head_key and p_dup and waited then
      -- a duplicate answered before the error keeps its answer: the write its WAIT needs
      redis.call('SET', p_head_key, string.format('%d', p_head))
    end
    -- the messages answered before the error (each appends its two values once decided)
    local done = (nout - base) / 2
    -- the part's keys: its log, its head, then 1 per one-key message and 3 per other
    kb = kb + 2
    for i = 1, n do
      if ARGV[ab + 2 + w * (i - 1) + fi] == '3' then kb = kb + 1 else kb = kb + 3 end
      if i > done then
        out[nout + 1], out[nout + 2] = 6, msg
        nout = nout + 2
      end
    end
  end
  ab = ab + 2 + w * n
end
return out
