#!/usr/bin/env bash
# Instructions per message of the tidemark server process, counted by valgrind's callgrind
# (instructions, not time: two binaries compared on a busy, noisy box give steady figures,
# which the CPU µs per message of profile_server.sh cannot for changes of a few per cent).
#   scripts/perf/server_callgrind.sh OUT [RATE=100] [SECONDS=20] [CLIENTS=100] [TIDEMARK_BIN]
# Starts `tidemark up --dev-auth` under callgrind (its redis-servers run natively: valgrind
# does not follow the children), runs `tidemark bench load --target` against it in its own
# process, zeroes the counters once the first commits are in, dumps them after SECONDS * 2/3,
# and prints instructions per commit over that window (all threads), with the top functions
# (inclusive) in OUT.txt. Under valgrind the server runs ~50× slower and on one thread at a
# time, so keep RATE low (100–200 msg/s): the figure is the per-message work at a low rate
# (little batching), not the 5,000 msg/s figure; compare binaries with the same arguments.
# LOAD_ARGS: more arguments for `bench load` (for example "--fanout 8").
# Needs valgrind (apt-get install valgrind) and a release build with debug info.
set -euo pipefail
OUT=${1:?output prefix} RATE=${2:-100} SECS=${3:-20} CLIENTS=${4:-100}
BIN=${5:-$(dirname "$0")/../../target/release/tidemark}
BIN=$(readlink -f "$BIN")
REAL_BIN=$BIN
# up.sh starts "$BIN up …": point it at a wrapper that runs the real binary under callgrind
WRAP=$(mktemp /tmp/tm-cg-wrap.XXXXXX)
cat >"$WRAP" <<EOF
#!/bin/sh
exec valgrind --tool=callgrind --callgrind-out-file="$OUT.callgrind" --dump-instr=no \
  "$REAL_BIN" "\$@"
EOF
chmod +x "$WRAP"
BIN=$WRAP
# valgrind starts slowly: up.sh waits up to 120 s for the gateway line
UP_WAIT=600
# shellcheck source=up.sh
. "$(dirname "$0")/up.sh"
trap 'kill $UP ${LOAD:-} 2>/dev/null; wait $UP 2>/dev/null; rm -rf "$DIR" "$WRAP"' EXIT
metric() { curl -s --max-time 10 "http://127.0.0.1:$PORT/metrics" | awk -v m="^$1" '$0 ~ m {print $2}'; }
"$REAL_BIN" bench load --target "ws://127.0.0.1:$PORT/v1/ws" --core-urls "$CORE" --mailbox-urls "$MAILBOX" \
  --clients "$CLIENTS" --rate "$RATE" --duration "$SECS" --no-progress --json "$OUT.json" ${LOAD_ARGS:-} >"$OUT.load.txt" 2>&1 &
LOAD=$!
for _ in $(seq 1200); do [ -n "$(metric tidemark_commits_total)" ] && break; sleep 0.1; done
# the connections are up and sending: count from here
sleep 2
callgrind_control -z "$UP" >/dev/null 2>&1
C0=$(metric tidemark_commits_total)
sleep $((SECS * 2 / 3))
C1=$(metric tidemark_commits_total)
callgrind_control -d "$UP" >/dev/null 2>&1
wait $LOAD || true
DUMP=$(ls -t "$OUT.callgrind".* 2>/dev/null | head -1)
TOTAL=$(callgrind_annotate "$DUMP" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
N=$((${C1%.*} - ${C0%.*}))
{
  echo "binary: $REAL_BIN; rate $RATE msg/s, $CLIENTS clients, window $((SECS * 2 / 3)) s"
  echo "server: $TOTAL instructions, $N commits: $((TOTAL / N)) instructions per message"
  grep -E 'sent [0-9]+ acked' "$OUT.load.txt" || true
  # callgrind_annotate's lines: "1,234 (5.6%)  file:function [object]"; the file's path is cut
  top() {
    callgrind_annotate --threshold=100 "$@" "$DUMP" 2>/dev/null |
      awk -v n="$N" '/^ *[0-9,]+ \(/ && !/PROGRAM TOTALS/ { c = $1; gsub(",", "", c); f = $0;
        sub(/^ *[0-9,]+ \( *[0-9.]+%\) +/, "", f); sub(/^[^ ]*\//, "", f); sub(/ \[[^]]*\]$/, "", f);
        if (++k <= 50) printf "%10d  %s\n", c / n, f }'
  }
  echo "top functions, self (instructions per message):"
  top
  echo "top functions, inclusive (instructions per message):"
  top --inclusive=yes
} >"$OUT.txt"
head -3 "$OUT.txt"
