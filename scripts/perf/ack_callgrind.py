#!/usr/bin/env python3
"""Drives one redis-server with acks (ack_mailbox.lua) as the gateway's ack rounds write them
(ADR-0038, ADR-0053), for scripts/perf/ack_callgrind.sh.

usage: ack_callgrind.py PORT {single|multi} ROUNDS [--wait]
  1,000 mailboxes of 64 shards; each round puts one entry in every mailbox, then acks it in
  batches of 72 (a 10 ms round at about 7,000 acks/s): `single` sends each batch as a
  pipeline of one-ack calls (before ADR-0053), `multi` as one call of 72 acks. Each ack
  trims one entry. With --wait it runs 5 warm-up rounds, prints "ready" and waits for a line
  on stdin before the measured rounds. Prints the acks it made.
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
port, mode, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
B = 72
r = R(port)
# SCRIPT=path: another ack_mailbox.lua (the one before ADR-0053 takes one ack per call: `single`)
src = os.environ.get("SCRIPT") or os.path.join(ROOT, "crates/store/src/redis/lua/common/ack_mailbox.lua")
sha = r.cmd("SCRIPT", "LOAD", open(src).read()).decode()
users = ["user-%04d" % u for u in range(1000)]


def one_round(rnd):
    r.pipe([["ZADD", "mb:{%d}:%s" % (u % 64, users[u]), rnd, "e%d" % rnd] for u in range(1000)])
    for start in range(0, 1000 - B + 1, B):
        batch = [(u % 64, users[u]) for u in range(start, start + B)]
        if mode == "single":
            r.pipe([["EVALSHA", sha, 2, "ack:{%d}" % s, "mb:{%d}:%s" % (s, u), u, rnd] for s, u in batch])
        else:
            keys, args = [], []
            for s, u in batch:
                keys += ["ack:{%d}" % s, "mb:{%d}:%s" % (s, u)]
                args += [u, rnd]
            r.cmd("EVALSHA", sha, len(keys), *keys, *args)


for rnd in range(1, 6):
    one_round(rnd)
if "--wait" in sys.argv:
    print("ready", flush=True)
    sys.stdin.readline()
for rnd in range(6, 6 + rounds):
    one_round(rnd)
print("%s acks=%d" % (mode, rounds * (1000 // B) * B), flush=True)
