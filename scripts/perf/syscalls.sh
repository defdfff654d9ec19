#!/usr/bin/env bash
# Syscalls per message of the server and of each Redis instance under load:
#   scripts/perf/syscalls.sh [TIDEMARK_BIN] [OUT_PREFIX]
# Starts `tidemark up --dev-auth` (appendfsync always, as `up` defaults) under a temporary data
# dir, runs `tidemark bench load --target` against it in its own process (1,000 clients,
# RATE msg/s, default 5000, 20 s), and 8 s in counts for 6 s with `perf stat`:
#   - the server: all syscalls, context switches, sendto/recvfrom/writev/epoll_wait/futex;
#   - core and mailbox Redis: fdatasync, read, write, epoll_wait;
# then the commits in that window (`tidemark_commits_total` from /metrics). Writes
# OUT-server.stat, OUT-core.stat, OUT-mailbox.stat, OUT-commits.txt; divide by the commits for
# per-message figures (docs/perf/syscalls-5000.txt).
# REDIS_PROFILE=1: instead, `perf record -g` both redis-servers for 6 s and write
# OUT-core.folded and OUT-mailbox.folded (needs inferno-collapse-perf: `cargo install inferno`).
set -euo pipefail
BIN=$(readlink -f "${1:-$(dirname "$0")/../../target/release/tidemark}")
OUT=${2:-/tmp/tm-syscalls}; RATE=${RATE:-5000}
# shellcheck source=up.sh
. "$(dirname "$0")/up.sh"
port_of() { echo "$1" | sed -E 's#.*:([0-9]+)/?$#\1#'; }
cpid=$(pgrep -f "redis-server.*:$(port_of "$CORE")" | head -1)
mpid=$(pgrep -f "redis-server.*:$(port_of "$MAILBOX")" | head -1)
commits() { curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^tidemark_commits_total/ {print $2}'; }
"$BIN" bench load --target "ws://127.0.0.1:$PORT/v1/ws" --core-urls "$CORE" --mailbox-urls "$MAILBOX" \
  --clients 1000 --rate "$RATE" --duration 20 --no-progress --json "$OUT.json" >"$OUT.txt" 2>&1 &
LOAD=$!
sleep 8
if [ "${REDIS_PROFILE:-0}" = 1 ]; then
  perf record -F 499 -g -p "$cpid" -o "$DIR/c.data" -- sleep 6 >/dev/null 2>&1 & P1=$!
  perf record -F 499 -g -p "$mpid" -o "$DIR/m.data" -- sleep 6 >/dev/null 2>&1
  wait $P1
  perf script -i "$DIR/c.data" 2>/dev/null | inferno-collapse-perf >"$OUT-core.folded"
  perf script -i "$DIR/m.data" 2>/dev/null | inferno-collapse-perf >"$OUT-mailbox.folded"
else
  EV=syscalls:sys_enter_fdatasync,syscalls:sys_enter_write,syscalls:sys_enter_read,syscalls:sys_enter_epoll_wait
  SEV=raw_syscalls:sys_enter,context-switches,syscalls:sys_enter_sendto,syscalls:sys_enter_recvfrom,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,syscalls:sys_enter_writev
  C0=$(commits)
  perf stat -e "$EV" -p "$cpid" -o "$OUT-core.stat" -- sleep 6 & P1=$!
  perf stat -e "$EV" -p "$mpid" -o "$OUT-mailbox.stat" -- sleep 6 & P2=$!
  perf stat -e "$SEV" -p "$UP" -o "$OUT-server.stat" -- sleep 6
  wait $P1 $P2
  C1=$(commits)
  echo "commits in window: $((C1 - C0))" | tee "$OUT-commits.txt"
  grep -h -E "syscalls|switches" "$OUT-server.stat" "$OUT-core.stat" "$OUT-mailbox.stat"
fi
wait $LOAD || true
