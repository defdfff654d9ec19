#!/usr/bin/env python3
"""Gateway memory with clients that never read (issue 9, item 7).

Starts `tidemark up` (its own redis-servers, a temporary data dir, dev auth), fills one
mailbox with ENTRIES messages of BODY bytes, then opens SOCKETS WebSocket connections of that
user that never read a byte, and samples the gateway process's VmRSS (/proc/<pid>/status).
Then the same with PAGES never-read `GET /v1/mailbox?limit=1000`, and the time until
SOCKETS half-sent requests are closed (part "halfsent", waiting at most 30 s).

    scripts/measure-slow-clients.py BIN [extra `up` flags…]
    e.g. scripts/measure-slow-clients.py target/debug/tidemark --max-connections-per-user 200

Environment: SOCKETS (200), PAGES (20), ENTRIES (300), BODY (16000), HOLD (15 s), PARTS
("ws,pages,halfsent": which measurements to run; run them one at a time for figures that do not
include memory the allocator kept from the other).
Only the standard library is used (the WebSocket handshake is written by hand).
"""

import base64
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

SOCKETS = int(os.environ.get("SOCKETS", "200"))
PAGES = int(os.environ.get("PAGES", "20"))
ENTRIES = int(os.environ.get("ENTRIES", "300"))
BODY = int(os.environ.get("BODY", "16000"))
HOLD = float(os.environ.get("HOLD", "15"))
PARTS = os.environ.get("PARTS", "ws,pages,halfsent").split(",")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def request(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    c.request(method, path, body=body, headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def count_entries(port):
    """Entries visible in the mailbox of `slow` (pages may be capped by bytes)."""
    after, n = 0, 0
    while True:
        status, page = request(port, "GET", f"/v1/mailbox?user=slow&after={after}&limit=1000")
        if status != 200:
            return n
        page = json.loads(page)
        if not page["entries"]:
            return n
        n += len(page["entries"])
        after = page["next_after"]


def hold(pid, what):
    peak = 0
    t0 = time.time()
    while time.time() - t0 < HOLD:
        peak = max(peak, rss_kb(pid))
        time.sleep(0.5)
    now = rss_kb(pid)
    print(f"{what}: peak {peak / 1024:.0f} MB, after {HOLD:.0f} s {now / 1024:.0f} MB")
    return peak, now


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary, extra = sys.argv[1], sys.argv[2:]
    port = free_port()
    data = tempfile.mkdtemp(prefix="tidemark-rss-")
    cmd = [binary, "up", "--shards", "4", "--data-dir", data, "--listen",
           f"127.0.0.1:{port}", "--dev-auth", "--appendfsync", "everysec", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if request(port, "GET", "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or proc.poll() is not None:
                sys.exit("tidemark up did not become healthy")
            time.sleep(0.2)

        body = "z" * BODY
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for i in range(ENTRIES):
            req = json.dumps({"id": f"m{i}", "to": ["slow"], "body": body})
            conn.request("POST", "/v1/messages?user=filler", body=req,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                sys.exit(f"send failed: {r.status}")
        conn.close()
        deadline = time.time() + 60
        while count_entries(port) < ENTRIES:
            if time.time() > deadline:
                sys.exit("mailbox never filled")
            time.sleep(0.2)

        pid = proc.pid
        base = rss_kb(pid)
        print(f"command: {' '.join(cmd)}")
        print(f"{ENTRIES} entries of {BODY} bytes in the mailbox of `slow`")
        print(f"baseline: {base / 1024:.0f} MB")

        socks = []
        for _ in range(SOCKETS if "ws" in PARTS else 0):
            s = socket.create_connection(("127.0.0.1", port))
            key = base64.b64encode(os.urandom(16)).decode()
            s.sendall((f"GET /v1/ws?user=slow HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                       "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                       f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                       ).encode())
            socks.append(s)  # never read
        if socks:
            hold(pid, f"{SOCKETS} never-reading WebSockets of one user")
            for s in socks:
                s.close()
            time.sleep(3)
            print(f"after closing them: {rss_kb(pid) / 1024:.0f} MB")

        pages = []
        for _ in range(PAGES if "pages" in PARTS else 0):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall((f"GET /v1/mailbox?user=slow&after=0&limit=1000 HTTP/1.1\r\n"
                       f"Host: 127.0.0.1:{port}\r\n\r\n").encode())
            pages.append(s)  # never read
        if pages:
            hold(pid, f"{PAGES} never-read GET /v1/mailbox?limit=1000")
        for s in pages:
            s.close()

        if "halfsent" in PARTS:
            half = []
            for _ in range(SOCKETS):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                s.setblocking(False)
                half.append(s)
            t0 = time.time()
            closed = {}
            while len(closed) < len(half) and time.time() - t0 < 30:
                for i, s in enumerate(half):
                    if i in closed:
                        continue
                    try:
                        if s.recv(4096) == b"":
                            closed[i] = time.time() - t0
                    except BlockingIOError:
                        pass
                    except OSError:
                        closed[i] = time.time() - t0
                time.sleep(0.05)
            if closed:
                print(f"{SOCKETS} half-sent requests: {len(closed)} closed, after "
                      f"{min(closed.values()):.2f} to {max(closed.values()):.2f} s; "
                      f"{len(half) - len(closed)} still open after 30 s")
            else:
                print(f"{SOCKETS} half-sent requests: none closed within 30 s")
            for s in half:
                s.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
