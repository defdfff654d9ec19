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
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=callgrind_lib.sh
. "$here/callgrind_lib.sh"
rounds="${1:-20}"
out="$(mktemp -d)"
for mode in ${MODES:-single multi}; do
  callgrind_redis "$out/cg.$mode"
  callgrind_drive python3 "$here/ack_callgrind.py" "$CG_PORT" "$mode" "$rounds" --wait
  line=$CG_LINE
  acks=${line##*acks=}
  total=$(callgrind_total "$out/cg.$mode.1")
  cmds=$(callgrind_inclusive "$out/cg.$mode.1" processCommand)
  echo "$mode: $acks acks; in commands $((${cmds:-0} / acks)) instructions per ack, program $((total / acks))"
done
rm -rf "$out"
