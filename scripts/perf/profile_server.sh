#!/usr/bin/env bash
# Profiles the tidemark server process under load, the load generator in its own process:
#   scripts/perf/profile_server.sh RATE SECONDS OUT [CLIENTS] [TIDEMARK_BIN]
# Starts `tidemark up --dev-auth` (appendfsync as `up` defaults: always) under a temporary data
# dir, runs `tidemark bench load --target` against it, records the server with
# `perf record --call-graph dwarf` for the middle of the load, and writes OUT.svg (a flamegraph, inferno:
# `cargo install inferno`), OUT.folded and OUT.txt (CPU µs per message of the server, from
# /proc/<pid>/stat, and the generator's report). Needs perf and a release build with debug info.
# LOAD_ARGS: more arguments for `bench load` (for example "--fanout 8").
# PERF=0: only the CPU figure (no perf attached), for side-by-side comparisons of two binaries.
# PERF_HZ: perf's sampling rate (default 199 per second).
set -euo pipefail
RATE=${1:?rate} SECS=${2:?seconds} OUT=${3:?output prefix} CLIENTS=${4:-1000}
BIN=${5:-$(dirname "$0")/../../target/release/tidemark}
BIN=$(readlink -f "$BIN")
# shellcheck source=up.sh
. "$(dirname "$0")/up.sh"
ticks() { awk '{print $14+$15}' "/proc/$UP/stat"; }
# user-space and kernel ticks apart (utime, stime)
uticks() { awk '{print $14}' "/proc/$UP/stat"; }
"$BIN" bench load --target "ws://127.0.0.1:$PORT/v1/ws" --core-urls "$CORE" --mailbox-urls "$MAILBOX" \
  --clients "$CLIENTS" --rate "$RATE" --duration "$SECS" --no-progress --json "$OUT.json" ${LOAD_ARGS:-} >"$OUT.txt" 2>&1 &
LOAD=$!
# connecting takes a while: wait for the first commit, then sample the middle of the window
for _ in $(seq 600); do
  [ "$(curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^tidemark_commits_total/ {print $2}')" != "" ] && break
  sleep 0.1
done
T0=$(ticks); U0=$(uticks); W0=$(date +%s.%N)
C0=$(curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^tidemark_commits_total/ {print $2}')
if [ "${PERF:-1}" = 1 ]; then
  perf record -F ${PERF_HZ:-199} --call-graph dwarf,32768 -p "$UP" -o "$DIR/perf.data" -- sleep $((SECS * 2 / 3)) 2>/dev/null >/dev/null
else
  sleep $((SECS * 2 / 3))
fi
T1=$(ticks); U1=$(uticks); W1=$(date +%s.%N)
C1=$(curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^tidemark_commits_total/ {print $2}')
wait $LOAD || true
# messages per commit call and per round of an instance (group commit), over the whole run
curl -s "http://127.0.0.1:$PORT/metrics" | awk '
  /^tidemark_commit_(group|round)_size_(sum|count)/ { split($1, k, "_size_"); v[k[1] "," k[2]] = $2 }
  END { for (n in v) if (n ~ /,count$/) { b = substr(n, 1, length(n) - 6);
          if (v[n] > 0) printf "%s: %.2f messages on average\n", b "_size", v[b ",sum"] / v[n] } }' \
  | sort | tee -a "$OUT.txt"
# the commit feed's counters (ADR-0049) and the local runs dropped (ADR-0111), if the binary has them
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^tidemark_commit_feed|^tidemark_local_runs_dropped_total' | tee -a "$OUT.txt" || true
HZ=$(getconf CLK_TCK)
awk -v t0="$T0" -v t1="$T1" -v u0="$U0" -v u1="$U1" -v c0="$C0" -v c1="$C1" -v w0="$W0" -v w1="$W1" -v hz="$HZ" 'BEGIN {
  cpu = (t1 - t0) / hz; usr = (u1 - u0) / hz; n = c1 - c0;
  printf "server: %.2f CPU s over %.1f s wall, %d commits: %.1f us CPU per message (%.0f%% of a core)\n",
    cpu, w1 - w0, n, cpu * 1e6 / n, cpu / (w1 - w0) * 100;
  printf "server: %.1f us user + %.1f us system per message\n", usr * 1e6 / n, (cpu - usr) * 1e6 / n }' | tee -a "$OUT.txt"
[ "${PERF:-1}" = 1 ] || exit 0
perf script -i "$DIR/perf.data" 2>/dev/null | inferno-collapse-perf >"$OUT.folded"
inferno-flamegraph --title "tidemark server, $RATE msg/s, $CLIENTS clients" <"$OUT.folded" >"$OUT.svg"
echo "wrote $OUT.svg $OUT.folded $OUT.txt $OUT.json"
