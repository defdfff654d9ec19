# Sourced by the scripts in scripts/perf/: starts `tidemark up --dev-auth ${UP_ARGS}` ($BIN) under a
# temporary data dir and waits for its gateway. Sets DIR (the temporary dir, removed on exit),
# PORT (the gateway's), UP (its pid), PASS (the Redis password), CORE and MAILBOX (the
# instances' URLs with the password, comma-separated), and an EXIT trap that stops `up`
# (and $LOAD, when set) and removes DIR.
# shellcheck shell=bash
DIR=$(mktemp -d /tmp/tm-perf.XXXXXX)
PORT=$((7600 + RANDOM % 600))
# shellcheck disable=SC2086 # UP_ARGS: extra flags, split on spaces (e.g. --read-linger-ms 5)
"$BIN" up --dev-auth --data-dir "$DIR/data" --listen "127.0.0.1:$PORT" ${UP_ARGS:-} >"$DIR/up.log" 2>&1 &
UP=$!
LOAD=
trap 'kill $UP ${LOAD:-} 2>/dev/null; wait $UP 2>/dev/null; rm -rf "$DIR"' EXIT
# UP_WAIT: how many 0.2 s waits for the gateway line (default 100: 20 s)
for _ in $(seq "${UP_WAIT:-100}"); do grep -q '^gateway ' "$DIR/up.log" 2>/dev/null && break; sleep 0.2; done
PASS=$(cat "$DIR/data/redis.pass")
up_urls() { grep -E "^$1 " "$DIR/up.log" | sed -E "s#redis://#redis://:$PASS@#; s#^$1 +[0-9]+ ##" | paste -sd, -; }
CORE=$(up_urls core)
MAILBOX=$(up_urls mailbox)
