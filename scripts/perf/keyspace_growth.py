#!/usr/bin/env python3
"""Latency and CPU of a lone redis-server while its keyspace grows through its dict doublings
(2^17, 2^18, 2^19 keys), as core Redis's does under load: one id claim per message (`SET k v
NX EX 86400`, keys shaped like the claims), in pipelined batches of 50 at RATE keys/s. Prints,
per second: keys so far, batch round-trip P50/P99/max and the server's CPU % (utime + stime
from /proc/PID/stat). Start the server as `tidemark up` does (AOF, `auto-aof-rewrite-min-size
1gb`), with or without `--activerehashing no`.

usage: keyspace_growth.py PORT PID TOTAL RATE     (e.g. 39999 "$(cat pidfile)" 700000 10000)
"""

import os, socket, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resp import R

port, pid, total, rate = (int(a) for a in sys.argv[1:5])
r = R(port)
r.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def ticks():
    f = open("/proc/%d/stat" % pid).read().split()
    return int(f[13]) + int(f[14])


B = 50
val = b"x" * 40
t0, i, sec, lat, c0 = time.time(), 0, 0, [], ticks()
while i < total:
    due = t0 + i / rate
    now = time.time()
    if now < due:
        time.sleep(due - now)
    st = time.time()
    r.pipe([("SET", b"msgid:{7}:5:alice%d" % j, val, "NX", "EX", 86400) for j in range(i, i + B)])
    lat.append(time.time() - st)
    i += B
    if time.time() - t0 >= sec + 1:
        lat.sort()
        c1 = ticks()
        print("t=%2d keys=%7d batches=%4d p50=%.2fms p99=%.2fms max=%.2fms redis_cpu=%d%%" % (
            sec, i, len(lat), lat[len(lat) // 2] * 1e3, lat[int(len(lat) * .99)] * 1e3,
            lat[-1] * 1e3, c1 - c0), flush=True)
        c0, lat, sec = c1, [], sec + 1
