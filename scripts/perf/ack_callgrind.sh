#!/usr/bin/env bash
# Instructions per ack on redis-server, under valgrind's callgrind (counts instructions, not
# time: the same figures on a busy or an idle machine): acks written as one-ack calls in a
# pipeline (before ADR-0053) and as one call per round (ADR-0053), with the current
# ack_mailbox.lua (its one-ack call is the call of before). Needs valgrind.
# usage: scripts/perf/ack_callgrind.sh [ROUNDS=20]; MODES="single multi" picks the modes, SCRIPT=path
# another ack_mailbox.lua (MODES=single SCRIPT=<the script before ADR-0053> gives the figure before)
# Prints, per mode, the instructions per ack inside the commands (processCommand, inclusive:
# without the event loop and serverCron) and of the whole program. Both include the ZADD of
# the entry each ack trims (the same in both modes).
set -euo pipefail
# (the awk programs below read all their input: one that exits early makes
# callgrind_annotate die of SIGPIPE, which pipefail and -e turn into a silent exit)
here="$(cd "$(dirname "$0")" && pwd)"
rounds="${1:-20}"
out="$(mktemp -d)"
for mode in ${MODES:-single multi}; do
  port=$((20000 + RANDOM % 20000))
  MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 valgrind --tool=callgrind --callgrind-out-file="$out/cg.$mode" \
    redis-server --port "$port" --save '' --appendonly no --activerehashing no >"$out/valgrind.$mode.log" 2>&1 &
  vp=$!
  for _ in $(seq 1 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done
  coproc P { python3 "$here/ack_callgrind.py" "$port" "$mode" "$rounds" --wait; }
  ppid=$P_PID
  read -r _ <&"${P[0]}"
  callgrind_control -z "$vp" >/dev/null
  echo go >&"${P[1]}"
  read -r line <&"${P[0]}"
  callgrind_control -d "$vp" >/dev/null
  kill "$vp"; wait "$vp" 2>/dev/null || true
  wait "$ppid" 2>/dev/null || true
  acks=${line##*acks=}
  total=$(callgrind_annotate "$out/cg.$mode.1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  cmds=$(callgrind_annotate --inclusive=yes "$out/cg.$mode.1" 2>/dev/null | awk '$NF ~ /:processCommand$/ || $3 ~ /:processCommand$/ {gsub(",", "", $1); if (!found) print $1; found = 1}')
  echo "$mode: $acks acks; in commands $((${cmds:-0} / acks)) instructions per ack, program $((total / acks))"
done
rm -rf "$out"
