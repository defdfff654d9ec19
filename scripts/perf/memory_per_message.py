#!/usr/bin/env python3
"""Memory one queued message costs on each pool (issue 14, docs/capacity.md).

Starts `tidemark up` (one core, one mailbox instance) on a fresh data dir, reads
`used_memory` of both instances, POSTs N messages (BODY bytes, one recipient each, to USERS
users who never connect, so every entry stays queued in its mailbox), waits until every shard's
W reached its head (the core log is then trimmed by GC), reads `used_memory` again, and prints
bytes per message for each pool. The core side keeps each message's dedupe records (24 h).

Usage: scripts/perf/memory_per_message.py [N] [BODY] [USERS]
"""
import http.client, json, os, re, subprocess, sys, tempfile, time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
BODY = int(sys.argv[2]) if len(sys.argv) > 2 else 100
USERS = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
BIN = os.path.join(os.path.dirname(__file__), "..", "..", "target", "release", "tidemark")
PORT = 7690


def redis(port, pw, *args):
    env = dict(os.environ, REDISCLI_AUTH=pw)
    return subprocess.run(["redis-cli", "-p", str(port), *args], env=env,
                          capture_output=True, text=True, check=True).stdout


def used_memory(port, pw):
    redis(port, pw, "MEMORY", "PURGE")
    m = re.search(r"used_memory:(\d+)", redis(port, pw, "INFO", "memory"))
    return int(m.group(1))


def main():
    d = tempfile.mkdtemp()
    up = subprocess.Popen([BIN, "up", "--dev-auth", "--data-dir", d + "/data", "--listen",
                           f"127.0.0.1:{PORT}", "--shards", "64"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ports = {}
    for line in up.stdout:
        m = re.match(r"(core|mailbox)\s+0 redis://127\.0\.0\.1:(\d+)/", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
        if line.startswith("Ctrl-C"):
            break
    pw = open(d + "/data/redis.pass").read().strip()
    before = {k: used_memory(p, pw) for k, p in ports.items()}
    conn = http.client.HTTPConnection("127.0.0.1", PORT)
    body = "x" * BODY
    t0 = time.time()
    for i in range(N):
        msg = json.dumps({"id": f"m{i}", "to": [f"user{i % USERS}"], "body": body})
        conn.request("POST", f"/v1/messages?user=sender{i % 50}", msg,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        assert r.status == 200, r.status
    sent_s = time.time() - t0
    # wait until materialised and the log trimmed (GC runs every second per shard)
    time.sleep(5)
    after = {k: used_memory(p, pw) for k, p in ports.items()}
    up.send_signal(2)
    up.wait()
    print(f"{N} messages of {BODY} bytes to {USERS} users (sent in {sent_s:.1f} s)")
    for k in ("mailbox", "core"):
        print(f"{k:8} used_memory {before[k]} -> {after[k]}: "
              f"{(after[k] - before[k]) / N:.0f} bytes per queued message")


main()
