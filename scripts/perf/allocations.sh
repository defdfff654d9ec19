#!/usr/bin/env bash
# Heap allocations per message of the tidemark server under load, the load generator in its
# own process, several binaries alternated:
#   scripts/perf/allocations.sh OUTDIR ROUNDS RATE BIN [BIN ...]
# Each BIN must be built with the counting allocator:
#   cargo build --release -p tidemark --features alloc-count
# (it exports tidemark_allocations_total and tidemark_reallocations_total on /metrics; a
# normal build does not). For each round and binary: `PERF=0 scripts/perf/profile_server.sh
# RATE 20 OUTDIR/NAME-rN 1000 BIN` in the background, then the counters and
# tidemark_commits_total read 5 s after the first commit and 8 s later; prints allocations
# and reallocations per message over that window (also appended to OUTDIR/summary.txt), with
# the server's CPU line. The counting itself costs an uncontended atomic add per allocation.
# (Uprobes on the allocator are no substitute: they slowed the server to about a third of the
# offered rate here, so "per message at RATE" was wrong; see docs/performance.md.)
set -euo pipefail
OUT=${1:?outdir} R=${2:?rounds} RATE=${3:?rate}
shift 3
[ $# -ge 1 ] || { echo "usage: $0 OUTDIR ROUNDS RATE BIN [BIN ...]" >&2; exit 2; }
mkdir -p "$OUT"
m() { curl -s "http://127.0.0.1:$PORT/metrics" | awk -v k="^$1 " '$0 ~ k {print $2}'; }
for r in $(seq "$R"); do
  for b in "$@"; do
    n=$(basename "$b")
    PERF=0 "$(dirname "$0")/profile_server.sh" "$RATE" 20 "$OUT/$n-r$r" 1000 "$b" >/dev/null 2>&1 &
    JOB=$!
    sleep 2
    D=$(ls -dt /tmp/tm-perf.* | head -1)
    for _ in $(seq 100); do grep -q '^gateway ' "$D/up.log" 2>/dev/null && break; sleep 0.2; done
    PORT=$(grep '^gateway ' "$D/up.log" | grep -oE ':[0-9]+/' | tr -d :/)
    for _ in $(seq 300); do [ -n "$(m tidemark_commits_total)" ] && break; sleep 0.1; done
    if [ -z "$(m tidemark_allocations_total)" ]; then
      echo "$b does not count allocations: build it with --features alloc-count" >&2
      kill "$JOB" 2>/dev/null; wait "$JOB" 2>/dev/null || true; exit 1
    fi
    sleep 5
    C0=$(m tidemark_commits_total); A0=$(m tidemark_allocations_total); R0=$(m tidemark_reallocations_total)
    sleep 8
    C1=$(m tidemark_commits_total); A1=$(m tidemark_allocations_total); R1=$(m tidemark_reallocations_total)
    wait "$JOB" || true
    awk -v n="$n r$r" -v c="$((${C1%.*} - ${C0%.*}))" -v a="$((${A1%.*} - ${A0%.*}))" -v re="$((${R1%.*} - ${R0%.*}))" \
      'BEGIN { printf "%s: %d commits, %.2f allocations and %.2f reallocations per message\n", n, c, a / c, re / c }' | tee -a "$OUT/summary.txt"
    echo "   $(grep '^server:' "$OUT/$n-r$r.txt" | head -1)" | tee -a "$OUT/summary.txt"
  done
done
