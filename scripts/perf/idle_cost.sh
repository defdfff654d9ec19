#!/usr/bin/env bash
# The idle cost of connected clients, the generator in its own process:
#   scripts/perf/idle_cost.sh CLIENTS SECONDS [TIDEMARK_BIN]
# Starts `tidemark up --dev-auth` under a temporary data dir, connects CLIENTS WebSocket clients
# with `tidemark bench load --target … --rate 0.2` (one message every 5 s: all but idle), and
# over the middle SECONDS prints the server's CPU % (from /proc/<pid>/stat), its RSS, and the
# commands every Redis instance processed per second (INFO commandstats deltas, by command;
# `total` counts the commands Lua scripts ran too).
set -euo pipefail
CLIENTS=${1:?clients} SECS=${2:?seconds}
BIN=$(readlink -f "${3:-$(dirname "$0")/../../target/release/tidemark}")
# shellcheck source=up.sh
. "$(dirname "$0")/up.sh"
export REDISCLI_AUTH=$PASS
PORTS=$(grep -E '^(core|mailbox) ' "$DIR/up.log" | sed -E 's#.*:([0-9]+)/$#\1#')
"$BIN" bench load --target "ws://127.0.0.1:$PORT/v1/ws" --clients "$CLIENTS" --rate 0.2 \
  --duration $((SECS + 60)) --no-progress >"$DIR/load.log" 2>&1 &
LOAD=$!
# wait until every client is connected
for _ in $(seq 1200); do
  n=$(curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^tidemark_connected_clients/ {print $2}')
  [ "${n:-0}" -ge "$CLIENTS" ] && break
  sleep 0.1
done
sleep 5
for p in $PORTS; do redis-cli -p "$p" CONFIG RESETSTAT >/dev/null; done
T0=$(awk '{print $14+$15}' "/proc/$UP/stat"); W0=$(date +%s.%N)
sleep "$SECS"
T1=$(awk '{print $14+$15}' "/proc/$UP/stat"); W1=$(date +%s.%N)
RSS=$(awk '/VmRSS/ {print $2}' "/proc/$UP/status")
awk -v t0="$T0" -v t1="$T1" -v w0="$W0" -v w1="$W1" -v hz="$(getconf CLK_TCK)" -v n="$CLIENTS" -v rss="$RSS" \
  'BEGIN { printf "server: %d clients, %.2f%% of a core over %.1f s, RSS %.1f MiB\n", n, (t1-t0)/hz/(w1-w0)*100, w1-w0, rss/1024 }'
for p in $PORTS; do
  role=$(grep -E ":$p/\$" "$DIR/up.log" | awk '{print $1}')
  redis-cli -p "$p" INFO commandstats | tr -d '\r' | grep '^cmdstat_' | grep -v 'resetstat\|cmdstat_info' |
    sed -E 's/^cmdstat_([^:]+):calls=([0-9]+),.*/\1 \2/' |
    awk -v s="$SECS" -v r="$role" '{t+=$2; out = out sprintf(" %s %.1f/s", $1, $2/s)} END {printf "%s: total %.1f/s:%s\n", r, t/s, out}'
done
