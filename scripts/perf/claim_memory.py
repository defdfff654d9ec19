#!/usr/bin/env python3
"""Bytes of core Redis memory per id claim: writes N keys shaped like the gateway's claims
(`msgid:{h}:<n>:<sender><client id>` -> "<offset>:<32 hex digest>", `EX 86400`, the 24 h
dedupe window) to an empty redis-server and prints the growth of INFO's `used_memory` per key.
Each committed send leaves one such key for 24 h (ADR-0040/0043), so this sizes core Redis.

usage: claim_memory.py PORT [N=200000]
"""
import socket, sys, time

port = int(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 200000
s = socket.create_connection(("127.0.0.1", port))


def used_memory():
    s.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nmemory\r\n")
    d = b""
    while True:
        d += s.recv(65536)
        if d.startswith(b"$") and b"\r\n" in d:
            size = int(d[1:d.index(b"\r\n")])
            if len(d) >= d.index(b"\r\n") + 2 + size:
                break
    for line in d.split(b"\r\n"):
        if line.startswith(b"used_memory:"):
            return int(line.split(b":")[1])


m0 = used_memory()
for b in range(0, n, 1000):
    out = b""
    for i in range(b, min(b + 1000, n)):
        k = b"msgid:{%d}:8:user%04dclient-%08d" % (i % 64, i % 1000, i)
        v = b"%d:%032x" % (i + 1000000, i * 7919)
        out += b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$2\r\nEX\r\n$5\r\n86400\r\n" % (
            len(k), k, len(v), v)
    s.sendall(out)
    want, got = min(b + 1000, n) - b, 0
    while got < want:
        got += s.recv(65536).count(b"+OK")
time.sleep(0.2)
print("%d claims: %.1f bytes of used_memory each" % (n, (used_memory() - m0) / n))
