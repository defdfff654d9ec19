#!/usr/bin/env python3
"""For scripts/perf/hot_callgrind.sh: drives one redis-server with hot-path steps (materialize_fresh_single_recipient.lua, packed-v2):
each step = K shards with one record each, one EVALSHA per shard in one pipeline (as the
materializer sends them at 5,000 msg/s over 64 shards). --wait: 200 warm-up steps, 'ready', a
line on stdin, then STEPS measured steps; prints records=N.
usage: hot_callgrind.py PORT K STEPS [--wait]   (SCRIPT=path: another script)"""
import os, random, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R
from hot_lib import init_watermarks
port, k, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
src = os.environ.get("SCRIPT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../crates/store/src/redis/lua/v2/materialize_fresh_single_recipient.lua")
r = R(port)
sha = r.cmd("SCRIPT", "LOAD", open(src).read()).decode()
w = init_watermarks(r, 7)
random.seed(1)
def entry(o):
    return b"%d" % o + b"\x00" * 8 + b"\x08user-042" + b"x" * 120
def step():
    cmds, applied = [], []
    for s in random.sample(range(64), k):
        o = w[s] + 1
        cmds.append(["EVALSHA", sha, 2, "wm:{%d}" % s, "mb:{%d}:u%d" % (s, random.randrange(1000)), "7", o, w[s], entry(o)])
        applied.append(b"%d" % o)
        w[s] = o
    # every record applied (the reply is the new W): an error reply would be counted as a cheap record
    rep = r.pipe(cmds)
    assert rep == applied, rep
for _ in range(200):
    step()
if "--wait" in sys.argv:
    print("ready", flush=True)
    sys.stdin.readline()
for _ in range(steps):
    step()
print("records=%d" % (steps * k), flush=True)
