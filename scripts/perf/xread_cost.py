#!/usr/bin/env python3
"""Server-side cost of one XREAD over S dispatch logs (INFO commandstats usec_per_call), as
the materializer's log reader makes it: each round appends PER records (the commit script's
fields, a 64-byte body) spread round-robin over the first NSHARD logs, then reads all S logs
after the last ids seen (COUNT 512, no BLOCK). 2,000 rounds. Flushes the instance first.

usage: xread_cost.py PORT S PER NSHARD
  e.g. 64 12 64 (12 records in 12 logs of 64), 64 12 1 (the same 12 in one log), 1 12 1
"""
import os, re, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R

port, S, per, nshard = (int(a) for a in sys.argv[1:5])
r = R(port)
r.cmd("FLUSHALL")
ids = ["0-0"] * S
off = 1
r.cmd("CONFIG", "RESETSTAT")
for it in range(2000):
    for k in range(per):
        s = (it * per + k) % nshard
        r.cmd("XADD", "dlog:{%d}" % s, "%d-0" % off, "p", str(off - 1), "f", "user-042",
              "c", "cli-%016d" % off, "r", "\x05bob01", "b", "x" * 64, "t", "1796000000000000")
        off += 1
    v = r.cmd(*(["XREAD", "COUNT", "512", "STREAMS"] + ["dlog:{%d}" % s for s in range(S)] + ids))
    for st in v or []:
        s = int(st[0].decode()[len("dlog:{"):-1])
        ids[s] = st[1][-1][0].decode()
info = r.cmd("INFO", "commandstats").decode()
m = re.search(r"cmdstat_xread:calls=(\d+),usec=(\d+),usec_per_call=([\d.]+)", info)
print(f"streams={S} records_per_read={per} logs_with_records={min(per, nshard)} "
      f"xread_usec_per_call={m.group(3)}")
