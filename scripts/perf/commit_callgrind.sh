#!/usr/bin/env bash
# Instructions per call of the commit script, a plain SET NX + INCR + XADD script and a no-op
# script, each on a fresh redis-server under valgrind's callgrind (counts instructions, not
# time: the same figures on a busy or an idle machine). Needs valgrind (apt-get install
# valgrind). usage: scripts/perf/commit_callgrind.sh [N=2000]
# VARIANTS="noop plain commit group:10" picks the variants (commit_script.py's names; for
# group:K and spread:K it also prints instructions per message); SCRIPT=variant.lua and FLAG=0|1|2|3 are
# passed to commit_script.py (a variant of the commit script, the claim flag). "in EVALSHA" counts
# only the instructions inside evalShaCommand (Debian's redis-server exports its function names),
# the steadier figure for comparing two scripts.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=callgrind_lib.sh
. "$here/callgrind_lib.sh"
n="${1:-2000}"
out="$(mktemp -d)"
for v in ${VARIANTS:-noop plain commit}; do
  callgrind_redis "$out/cg.$v"
  callgrind_drive python3 "$here/commit_script.py" "$CG_PORT" "$v" "$n" --wait
  line=$CG_LINE
  total=$(callgrind_total "$out/cg.$v.1")
  # the EVALSHA command alone (inclusive): without the event loop and serverCron, whose
  # share depends on how long the run took under valgrind, so it varies from run to run
  evalsha=$(callgrind_inclusive "$out/cg.$v.1" evalShaCommand)
  k=1; case "$v" in group:*|spread:*) k=${v#*:} ;; esac
  echo "$v: $((total / n)) instructions per call, $((total / n / k)) per message; in EVALSHA $((${evalsha:-0} / n / k)) per message ($line)"
done
if [ -n "${KEEP:-}" ]; then echo "callgrind files kept in $out"; else rm -rf "$out"; fi
