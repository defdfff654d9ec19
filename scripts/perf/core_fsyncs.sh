#!/usr/bin/env bash
# Core Redis's fdatasyncs, commands and CPU per message under load (ADR-0088):
#   scripts/perf/core_fsyncs.sh [TIDEMARK_BIN] [RATE=5000] [SECONDS=5]
# Starts `tidemark up --dev-auth` (appendfsync always) and `bench load --target` (1,000 clients,
# 20 s, its own process); from second 2 of the load it counts, for SECONDS on the core
# redis-server, its fdatasync calls (perf stat on the syscall tracepoint), its CPU ticks
# (/proc/<pid>/stat) and its INFO commandstats delta, and divides by the messages committed
# (the server's tidemark_commits_total). Needs perf, curl and redis-cli.
set -euo pipefail
BIN=${1:-$(dirname "$0")/../../target/release/tidemark}
BIN=$(readlink -f "$BIN")
RATE=${2:-5000} SECS=${3:-5}
# shellcheck source=up.sh
. "$(dirname "$0")/up.sh"
"$BIN" bench load --target "ws://127.0.0.1:$PORT/v1/ws" --core-urls "$CORE" --mailbox-urls "$MAILBOX" \
  --clients 1000 --rate "$RATE" --duration 20 --no-progress >"$DIR/load.txt" 2>&1 &
LOAD=$!
commits() { curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^tidemark_commits_total/ {print $2}'; }
for _ in $(seq 600); do [ -n "$(commits)" ] && break; sleep 0.1; done
sleep 2
cport=$(echo "$CORE" | sed -E 's#.*:([0-9]+)/?.*#\1#')
cpid=$(pgrep -f "redis-server .*:$cport" | head -1)
stats() { redis-cli -p "$cport" -a "$PASS" --no-auth-warning info commandstats; }
stats >"$DIR/cs0"
K0=$(awk '{print $14+$15}' "/proc/$cpid/stat")
C0=$(commits)
perf stat -x, -e syscalls:sys_enter_fdatasync -p "$cpid" -- sleep "$SECS" 2>"$DIR/stat.txt"
C1=$(commits)
K1=$(awk '{print $14+$15}' "/proc/$cpid/stat")
stats >"$DIR/cs1"
wait $LOAD || true
N=$((C1 - C0))
F=$(awk -F, '/fdatasync/ {print $1}' "$DIR/stat.txt")
awk -v n="$N" -v f="$F" -v k=$((K1 - K0)) -v hz="$(getconf CLK_TCK)" -v s="$SECS" 'BEGIN {
  printf "messages %d in %d s; core fdatasync %d (%.3f per message); core CPU %.1f us per message\n",
    n, s, f, f / n, k / hz * 1e6 / n }'
# the commands of the window, by calls (a script's inner commands are counted too)
awk -F'[:=,]' 'FNR == NR && /^cmdstat_/ { c0[$1] = $3; u0[$1] = $5; next }
  /^cmdstat_/ && $3 - c0[$1] > 0 { printf "  %-22s %8d calls %9d usec\n", substr($1, 9), $3 - c0[$1], $5 - u0[$1] }' \
  "$DIR/cs0" "$DIR/cs1" | sort -k2 -n -r
