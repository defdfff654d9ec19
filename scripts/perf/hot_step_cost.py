#!/usr/bin/env python3
"""Mailbox Redis CPU per record for one materializer step of K shards with one record each,
as the hot path sends it: `calls` = one `materialize_fresh_single_recipient` call per shard
in one pipeline (what the materializer sends), `packed` = the runs of all K shards in one
call (a '*' form of the script that was tried and not kept: `git apply
docs/perf/hot-step-packed-tried.diff` first; results in docs/perf/hot-step-packed-tried.txt).
Each step is followed, as in the materializer, by a pipeline of K wake-hint PUBLISHes
(HINTS=with: in the step's pipeline; none: no hints); one `redis-cli psubscribe 'wake:*'`
listens. Redis CPU is read from /proc/PID/stat (utime + stime) around STEPS steps;
`evalsha_us` is INFO commandstats' usec per record. Run it against a redis-server started as
the mailbox instance is (AOF, appendfsync always), alternating the modes.

usage: hot_step_cost.py PORT PID MODE K STEPS    (MODE: calls | packed)
"""
import os, random, re, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R
from hot_lib import init_watermarks

port, pid, mode, k, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
assert mode in ("calls", "packed")
# HINTS=after (the default: a second pipeline, as the materializer sends them), with (in the
# step's pipeline), none
HINTS = os.environ.get("HINTS", "after")
here = os.path.dirname(os.path.abspath(__file__))
src = open(os.path.join(here, "../../crates/store/src/redis/lua/v2/materialize_fresh_single_recipient.lua")).read()
r = R(port)
sha = r.cmd("SCRIPT", "LOAD", src).decode()
r.cmd("FLUSHALL")

w = init_watermarks(r, 1)

def ticks():
    f = open("/proc/%d/stat" % pid).read().split()
    return int(f[13]) + int(f[14])

def entry(o):
    return b"%d" % o + b"\x00" * 8 + b"\x08user-042" + b"x" * 40

r.cmd("CONFIG", "RESETSTAT")
t0 = ticks()
for _ in range(steps):
    shards = random.sample(range(64), k)
    recs = []
    for s in shards:
        recs.append((s, "mb:{%d}:u%d" % (s, random.randrange(1000)), w[s] + 1, w[s]))
        w[s] += 1
    if mode == "calls":
        cmds = [["EVALSHA", sha, 2, "wm:{%d}" % s, mb, "1", o, p, entry(o)] for s, mb, o, p in recs]
    else:
        keys, args = [], ["*", k]
        for s, mb, o, p in recs:
            keys += ["wm:{%d}" % s, mb]
            args += ["1", 1, o, p, entry(o)]
        cmds = [["EVALSHA", sha, len(keys)] + keys + args]
    pubs = [["PUBLISH", "wake:%d" % s, b"hint:%d:%d" % (s, o) + b"x" * 20] for s, _, o, _ in recs]
    if HINTS == "after":
        r.pipe(cmds)
        r.pipe(pubs)
    elif HINTS == "with":
        r.pipe(cmds + pubs)
    else:
        r.pipe(cmds)
t1 = ticks()
info = r.cmd("INFO", "commandstats").decode()
usec = int(re.search(r"cmdstat_evalsha:calls=\d+,usec=(\d+)", info).group(1))
n = steps * k
print("mode=%s hints=%s k=%d records=%d redis_cpu_us_per_record=%.2f evalsha_us_per_record=%.2f"
      % (mode, HINTS, k, n, (t1 - t0) / os.sysconf("SC_CLK_TCK") * 1e6 / n, usec / n))
