#!/usr/bin/env bash
# The floor under the gateway's CPU per message: `bench load --target` against
#   - `tidemark bench relay` (a WebSocket relay of the client protocol with no Redis: the
#     socket work alone), and
#   - `tidemark up --dev-auth ${UP_ARGS}` (the service: the same socket work plus the
#     durable path),
# alternated ROUNDS times in one sitting, the generator in its own process each time. Prints
# one line per run with the generator's figures for the target process ("server: CPU" is
# Δ process_cpu_seconds_total of its /metrics over the messages sent, the same method for
# both) and writes each run's report to OUT-<kind>-<round>.json, then the target's user-space and
# kernel CPU seconds over its whole life (connecting included: /proc/<pid>/stat's utime and
# stime), the split of its CPU between its own work and the kernel's.
#   scripts/perf/relay_floor.sh RATE SECONDS OUT [CLIENTS=1000] [ROUNDS=3] [TIDEMARK_BIN]
set -euo pipefail
RATE=${1:?rate} SECS=${2:?seconds} OUT=${3:?output prefix} CLIENTS=${4:-1000} ROUNDS=${5:-3}
BIN=$(readlink -f "${6:-$(dirname "$0")/../../target/release/tidemark}")
here=$(cd "$(dirname "$0")" && pwd)
figures() { # the target's CPU and RSS rows, and the latencies, of a bench load report
  grep -E '^\| (server: CPU|server: RSS at end|end-to-end P50|end-to-end P99|SEND_ACK P99|delivered within window|generator: CPU) \|' "$1" |
    sed -E 's/^\| ([^|]+) \| ([^|]+) \|.*/\1 \2/' | paste -sd';' -
}
split_of() { # user and system CPU seconds of pid $1 so far
  awk -v hz="$(getconf CLK_TCK)" '{ printf "user %.2f s, system %.2f s (%.0f%% system)", $14 / hz, $15 / hz, 100 * $15 / ($14 + $15) }' "/proc/$1/stat"
}
relay_run() {
  local port=$((8100 + RANDOM % 500)) log
  log=$(mktemp)
  "$BIN" bench relay --listen "127.0.0.1:$port" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 50); do grep -q '^relay ' "$log" && break; sleep 0.1; done
  "$BIN" bench load --target "ws://127.0.0.1:$port/v1/ws" --clients "$CLIENTS" --rate "$RATE" \
    --duration "$SECS" --no-progress --json "$OUT-relay-$1.json" >"$OUT-relay-$1.txt" 2>&1 || true
  local split
  split=$(split_of "$pid")
  kill "$pid"; wait "$pid" 2>/dev/null || true; rm -f "$log"
  echo "relay-$1: $(figures "$OUT-relay-$1.txt"); $split"
}
up_run() {
  ( # up.sh's EXIT trap stops the service when this subshell ends
    # shellcheck source=up.sh
    . "$here/up.sh"
    "$BIN" bench load --target "ws://127.0.0.1:$PORT/v1/ws" --core-urls "$CORE" --mailbox-urls "$MAILBOX" \
      --clients "$CLIENTS" --rate "$RATE" --duration "$SECS" --no-progress --json "$OUT-up-$1.json" \
      >"$OUT-up-$1.txt" 2>&1 || true
    split_of "$UP" >"$OUT-up-$1.split"
  )
  echo "up-$1: $(figures "$OUT-up-$1.txt"); $(cat "$OUT-up-$1.split")"
}
for r in $(seq "$ROUNDS"); do
  relay_run "$r"
  up_run "$r"
done
