#!/usr/bin/env bash
# Instructions per record of the materializer's hot path on redis-server, under valgrind's
# callgrind (instructions, not time: the same figures on a busy or an idle box): steps of K
# shards with one record each, one `materialize_fresh_single_recipient.lua` call per shard in
# one pipeline (the materializer's calls at 5,000 msg/s over 64 shards). Needs valgrind.
# usage: scripts/perf/hot_callgrind.sh [K=10] [STEPS=300]; SCRIPT=path: another script
# Prints per record: the whole program, the EVALSHA (evalGenericCommand), the Lua call
# (lua_pcall: the script with the commands it calls), the commands it calls (scriptCall), the
# replies turned into Lua values (parseReply), Lua's incremental GC (lua_gc), and KEYS/ARGV
# built as Lua tables (what luaCallFunction spends outside lua_pcall, lua_gc and pushes).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=callgrind_lib.sh
. "$here/callgrind_lib.sh"
k="${1:-10}" steps="${2:-300}"
out="$(mktemp -d)"
callgrind_redis "$out/cg"
callgrind_drive python3 "$here/hot_callgrind.py" "$CG_PORT" "$k" "$steps" --wait
n=${CG_LINE##*records=}
dump="$out/cg.1"
per() { local v; v=$(callgrind_inclusive "$dump" "$1"); echo $(( ${v:-0} / n )); }
program=$(( $(callgrind_total "$dump") / n ))
eval_=$(per evalGenericCommand) lcall=$(per luaCallFunction) pcall=$(per lua_pcall)
cmds=$(per scriptCall) replies=$(per parseReply) gc=$(per lua_gc)
echo "records $n (K=$k, $steps steps)"
echo "program $program, evalsha $eval_, lua_pcall $pcall (commands called $cmds, their replies into Lua $replies), lua_gc $gc, the call's setup and KEYS/ARGV tables $((lcall - pcall - gc)) instructions per record"
rm -rf "$out"
