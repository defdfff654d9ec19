# shellcheck shell=bash
# Shared by commit_callgrind.sh and ack_callgrind.sh (sourced): a redis-server under
# valgrind's callgrind, and the instruction counts of a dump of it.

# callgrind_redis OUT: starts redis-server under callgrind (dumps to OUT.1, its log to
# OUT.log) on a random port, and waits until it answers; sets CG_PORT and CG_PID.
# jemalloc purges by elapsed time and serverCron rehashes by time: both vary with how long
# valgrind takes, so both are turned off. With callgrind_drive's counts, runs of one workload
# agree within 0.3 %.
# REDIS_SERVER: the redis-server to run (default: the one on PATH; scripts/perf/redis_symbols.sh
# builds one with symbols, so that callgrind_annotate names every function). CG_AOF=1: with
# `appendonly yes` and `appendfsync always`, as `tidemark up` runs core and mailbox Redis: a
# script's writes are then also propagated to the AOF (its data dir is a temporary dir).
callgrind_redis() {
  CG_PORT=$((20000 + RANDOM % 20000))
  local aof=(--appendonly no)
  if [ "${CG_AOF:-0}" = 1 ]; then
    aof=(--appendonly yes --appendfsync always --dir "$(mktemp -d)")
  fi
  MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 valgrind --tool=callgrind --callgrind-out-file="$1" \
    "${REDIS_SERVER:-redis-server}" --port "$CG_PORT" --save '' "${aof[@]}" --activerehashing no >"$1.log" 2>&1 &
  CG_PID=$!
  for _ in $(seq 1 100); do redis-cli -p "$CG_PORT" ping >/dev/null 2>&1 && break; sleep 0.2; done
}

# callgrind_total DUMP: the program's instructions.
callgrind_total() {
  callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'
}

# callgrind_inclusive DUMP FUNCTION: the instructions in FUNCTION and what it calls (Debian's
# redis-server exports its function names). The awk reads all its input: one that exits
# early makes callgrind_annotate die of SIGPIPE, which `set -o pipefail` and `-e` turn into
# a silent exit of the calling script. The name is looked for in every field: below 10 % the
# share is printed as "( 3.91%)", two fields, and the name moves one field right.
callgrind_inclusive() {
  callgrind_annotate --inclusive=yes "$1" 2>/dev/null |
    awk -v f=":$2\$" '{ for (i = 2; i <= NF; i++) if ($i ~ f && !found) { gsub(",", "", $1); print $1; found = 1 } }'
}

# callgrind_drive DRIVER...: runs DRIVER (a command that warms the redis-server of
# callgrind_redis up, prints a line when ready, waits for a line on stdin, does the measured
# work and prints one line of result), counts only the measured work (the counters are
# zeroed in between and dumped after), then stops that redis-server and waits for DRIVER.
# Sets CG_LINE to DRIVER's result line.
callgrind_drive() {
  coproc CG_DRIVER { "$@"; }
  # bash unsets CG_DRIVER_PID once the coproc has ended: keep it
  local driver=$CG_DRIVER_PID
  read -r _ <&"${CG_DRIVER[0]}"
  callgrind_control -z "$CG_PID" >/dev/null
  echo go >&"${CG_DRIVER[1]}"
  read -r CG_LINE <&"${CG_DRIVER[0]}"
  callgrind_control -d "$CG_PID" >/dev/null
  kill "$CG_PID"; wait "$CG_PID" 2>/dev/null || true
  # the driver must be gone before the next coproc starts (bash runs one at a time)
  wait "$driver" 2>/dev/null || true
}
