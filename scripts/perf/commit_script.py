#!/usr/bin/env python3
"""Drives one redis-server with EVALSHA calls of the commit script (or a comparison script)
and prints the server-side usec_per_call from INFO commandstats.

usage: commit_script.py PORT {commit|group:K|spread:K|plain|noop} N [FIRST_ID] [--wait]
  commit  crates/store/src/redis/lua/core/commit_dispatch.lua, real arguments, one message
          per call
  group:K the same script with K messages per call (group commit, ADR-0036): N calls of K
          messages each; also prints the server-side usec per message
  plain   SET NX EX + INCR + XADD with the same fields (the issue's comparison script)
  noop    `return 1`
Environment: SCRIPT=path runs that file instead of commit_dispatch.lua (a variant of it, to
time one change of the script); FLAG=0|1|2|3 is the claim flag of every message (default 1;
2 is ADR-0040's one-key claim, 3 the same with only the claim's key passed, ADR-0043);
PACKED=1 passes each message as one packed record (the record form 'm', ADR-0055), which a
deployment of identity version 3 writes; otherwise the six-field form 'f'.
With --wait, it warms up with 1000 calls, prints "ready", then waits for a line on stdin before the measured
calls (used by commit_callgrind.sh to zero callgrind's counters in between).
"""
import os, re, struct, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
port, variant, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
group, spread = 1, False
if variant.startswith("group:") or variant.startswith("spread:"):
    spread = variant.startswith("spread:")
    variant, group = "commit", int(variant.split(":", 1)[1])
first = int(sys.argv[4]) if len(sys.argv) > 4 and not sys.argv[4].startswith("--") else 0
wait = "--wait" in sys.argv
# PACKED=1: each message as one packed record (the record form 'm', ADR-0055), else six
# fields (the form 'f')
PACKED = os.environ.get("PACKED") == "1"
r = R(port)
src = {
    "commit": open(os.environ.get("SCRIPT") or os.path.join(ROOT, "crates/store/src/redis/lua/core/commit_dispatch.lua")).read(),
    "plain": """
local ok = redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[6])
local off = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], off .. '-0', 'p', off - 1, 'f', ARGV[1], 'c', ARGV[2], 'r', ARGV[3],
  'b', ARGV[4], 't', ARGV[5])
return {0, off}
""",
    "noop": "return 1",
}[variant]
sha = r.cmd("SCRIPT", "LOAD", src).decode()
rec = bytes([8]) + b"user-042"
body = "x" * 64


def call(i):
    s = i % 64
    if variant != "commit":
        return ["EVALSHA", sha, 4, "dlog:{%d}" % s, "head:{%d}" % s,
                "dd:{%d}:8:user-007cli-%016d" % (s, i), "dd:{%d}:user-007\0cli-%016d" % (s, i),
                "user-007", "cli-%016d" % i, rec, body, "1796000000000000", 86400,
                "0123456789abcdef0123456789abcdef"]
    # commit_dispatch.lua (ADR-0051): ARGV ttl, parts; per part KEYS dlog, head, then
    # (dedupe, legacy dedupe, id claim) per message, ARGV n, wake channel ('' = none), then 7
    # per message (the last: claim the id in the call, ADR-0037: the gateway does for a
    # one-shard send on one instance)
    ids = ["cli-%016d-%03d" % (i, k) for k in range(group)]
    parts = [(s + k) % 64 for k in range(group)] if spread else [s]
    per_part = 1 if spread else group
    keys, args = [], [86400, len(parts), "m" if PACKED else "f"]
    for j, sh in enumerate(parts):
        keys += ["dlog:{%d}" % sh, "head:{%d}" % sh]
        args += [per_part, ""]
        for c in ids[j * per_part:(j + 1) * per_part]:
            if os.environ.get("FLAG") == "3":
                # ADR-0043's one-key form: only the claim's key
                keys += ["msgid:{%d}:8:user-007%s" % (sh, c)]
            else:
                keys += ["dd:{%d}:8:user-007%s" % (sh, c), "dd:{%d}:user-007\0%s" % (sh, c),
                         "msgid:{%d}:8:user-007%s" % (sh, c)]
            if PACKED:
                # the packed record form (ADR-0055; redis/dlog.rs's layout)
                args += [b"\x01\x08user-007" + struct.pack(">I", len(c)) + c.encode()
                         + struct.pack(">I", len(rec)) + rec + struct.pack(">Q", 1796000000000000)
                         + body.encode(),
                         "0123456789abcdef0123456789abcdef", os.environ.get("FLAG", "1")]
            else:
                args += ["user-007", c, rec, body, "1796000000000000",
                         "0123456789abcdef0123456789abcdef", os.environ.get("FLAG", "1")]
    return ["EVALSHA", sha, len(keys)] + keys + args

if wait:
    r.pipe([call(i) for i in range(first, first + 1000)])
    first += 1000
    print("ready", flush=True)
    sys.stdin.readline()
r.cmd("CONFIG", "RESETSTAT")
for k in range(first, first + n, 200):
    r.pipe([call(i) for i in range(k, min(k + 200, first + n))])
info = r.cmd("INFO", "commandstats").decode()
m = re.search(r"cmdstat_evalsha:calls=(\d+),usec=(\d+),usec_per_call=([\d.]+)", info)
per_msg = f" usec_per_message={int(m.group(2)) / (int(m.group(1)) * group):.2f}" if group > 1 else ""
print(f"{variant} calls={m.group(1)} usec_per_call={m.group(3)}{per_msg} "
      f"keys={r.cmd('DBSIZE').decode()}", flush=True)
