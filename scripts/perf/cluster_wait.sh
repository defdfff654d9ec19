#!/usr/bin/env bash
# SEND_ACK latency with and without the replica wait on a local Redis Cluster (issue 14,
# ADR-0032): `tidemark up --cluster` in its own process, `tidemark bench load --target` in
# another, alternating --core-wait-replicas 0 and 1, ROUNDS times each, on a fresh data dir
# each run. JSON reports go to OUT (default docs/cluster/wait).
# Usage: scripts/perf/cluster_wait.sh [ROUNDS] [RATE] [DURATION] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-2}; RATE=${2:-1000}; DURATION=${3:-15}; CLIENTS=${4:-200}
OUT=${OUT:-docs/cluster/wait}
BIN=target/release/tidemark
cargo build --release --locked -p tidemark >/dev/null
mkdir -p "$OUT"
port=7601
for round in $(seq 1 "$ROUNDS"); do
  for wait in 0 1; do
    dir=$(mktemp -d)
    "$BIN" up --cluster --dev-auth --data-dir "$dir/data" --listen "127.0.0.1:$port" \
      --shards 64 --core-wait-replicas "$wait" --mailbox-wait-replicas "$wait" \
      >"$dir/up.log" 2>&1 &
    up_pid=$!
    for _ in $(seq 1 100); do
      curl -fs "127.0.0.1:$port/healthz" >/dev/null 2>&1 && break
      sleep 0.2
    done
    "$BIN" bench load --target "ws://127.0.0.1:$port/v1/ws" --rate "$RATE" \
      --duration "$DURATION" --clients "$CLIENTS" --no-progress \
      --json "$OUT/wait${wait}-round${round}.json" | grep -E "SEND_ACK|e2e|delivered" || true
    kill -INT "$up_pid"; wait "$up_pid" || true
    rm -rf "$dir"
    port=$((port + 1))
  done
done
