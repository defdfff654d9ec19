#!/usr/bin/env python3
"""Bytes of core Redis memory per id claim: writes N keys shaped like the gateway's claims
(`msgid:{h}:<n>:<sender><client id>` -> "<offset>:<32 hex digest>", `EX 86400`, the 24 h
dedupe window) to an empty redis-server and prints the growth of INFO's `used_memory` per key.
Each committed send leaves one such key for 24 h (ADR-0040/0043), so this sizes core Redis.

usage: claim_memory.py PORT [N=200000]
"""

import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R

port = int(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200000
r = R(port)


def used_memory():
    for line in r.cmd("INFO", "memory").split(b"\r\n"):
        if line.startswith(b"used_memory:"):
            return int(line.split(b":")[1])


m0 = used_memory()
for b in range(0, n, 1000):
    r.pipe([("SET", b"msgid:{%d}:8:user%04dclient-%08d" % (i % 64, i % 1000, i),
             b"%d:%032x" % (i + 1000000, i * 7919), "EX", 86400)
            for i in range(b, min(b + 1000, n))])
time.sleep(0.2)
print("%d claims: %.1f bytes of used_memory each" % (n, (used_memory() - m0) / n))
