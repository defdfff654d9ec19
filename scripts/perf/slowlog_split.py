#!/usr/bin/env python3
"""Where a Redis instance's script time goes, by script, sampled directly: turns SLOWLOG on for
every command (slowlog-log-slower-than 0) for SECONDS, reads it back, restores the settings,
and prints per script (named from crates/store/src/redis/lua/**.lua by SHA-1) its calls, mean
µs per call, keys per call and share of all EVALSHA time; plus the commands the scripts call
(Redis 7 logs them too). The log holds at most MAXLEN entries: at a high rate it covers less
than SECONDS (the printed window says how much). Run it against an instance under load (e.g.
the mailbox instance of `scripts/perf/profile_server.sh 5000 40 OUT`).

usage: slowlog_split.py PORT [PASSWORD] [SECONDS=3] [MAXLEN=20000]
"""
import collections, glob, hashlib, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R

port = int(sys.argv[1])
password = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
maxlen = int(sys.argv[4]) if len(sys.argv) > 4 else 20000
here = os.path.dirname(os.path.abspath(__file__))
# a script's SHA-1 as loaded: the file alone, or (redis/scripts.rs) the lanes prelude, a
# layout's prelude and the file, joined by newlines
lua = os.path.join(here, "../../crates/store/src/redis/lua")
read = lambda rel: open(os.path.join(lua, rel), "rb").read()
names = {}
for f in glob.glob(os.path.join(lua, "*/*.lua")):
    rel = os.path.relpath(f, lua)
    body = read(rel)
    names[hashlib.sha1(body).hexdigest()] = rel
    for layout in ("v1", "v2"):
        composed = b"\n".join([read("common/_lanes.lua"), read(layout + "/_layout.lua"), body])
        names[hashlib.sha1(composed).hexdigest()] = f"{rel} ({layout})"

r = R(port)
if password:
    r.cmd("AUTH", password)
old_slower = r.cmd("CONFIG", "GET", "slowlog-log-slower-than")[1]
old_len = r.cmd("CONFIG", "GET", "slowlog-max-len")[1]
r.cmd("CONFIG", "SET", "slowlog-max-len", maxlen)
r.cmd("SLOWLOG", "RESET")
r.cmd("CONFIG", "SET", "slowlog-log-slower-than", 0)
time.sleep(seconds)
r.cmd("CONFIG", "SET", "slowlog-log-slower-than", old_slower)
entries = r.cmd("SLOWLOG", "GET", maxlen)
r.cmd("CONFIG", "SET", "slowlog-max-len", old_len)

scripts = collections.defaultdict(lambda: [0, 0, 0])
inner = collections.defaultdict(lambda: [0, 0])
ts = []
for e in entries:
    t, dur, args = int(e[1]), int(e[2]), e[3]
    ts.append(t)
    cmd = args[0].decode().upper()
    if cmd in ("EVALSHA", "EVAL"):
        sha = args[1].decode()
        k = scripts[names.get(sha, sha[:8])]
        k[0] += 1
        k[1] += dur
        k[2] += int(args[2])
    elif cmd not in ("SLOWLOG", "CONFIG", "AUTH"):
        k = inner[cmd]
        k[0] += 1
        k[1] += dur
total = sum(v[1] for v in scripts.values()) or 1
print(f"{len(entries)} entries over {max(ts) - min(ts) if ts else 0} s of Redis time stamps")
print("script | calls | mean µs per call | keys per call | share of EVALSHA µs")
for name, (n, d, keys) in sorted(scripts.items(), key=lambda kv: -kv[1][1]):
    print(f"{name} | {n} | {d / n:.1f} | {keys / n:.1f} | {100 * d / total:.1f} %")
print("command (inside scripts or alone) | calls | mean µs per call")
for name, (n, d) in sorted(inner.items(), key=lambda kv: -kv[1][1]):
    print(f"{name} | {n} | {d / n:.2f}")
