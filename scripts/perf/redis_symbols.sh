#!/usr/bin/env bash
# Builds the installed redis-server's version from Debian's source package with debug symbols,
# for profiles by function (Debian's binary is stripped: callgrind and perf then name only the
# exported functions). Prints the binary's path. Idempotent: a binary already built is reused.
#   scripts/perf/redis_symbols.sh [OUT_DIR=target/redis-symbols]
# Then, for example: REDIS_SERVER=$(scripts/perf/redis_symbols.sh) CG_AOF=1 \
#   VARIANTS=spread:10 FLAG=3 PACKED=1 KEEP=1 scripts/perf/commit_callgrind.sh
# Needs root or sudo (a deb-src entry for Debian's sources, removed again), dpkg-dev, make and
# a C compiler. Upstream's bundled Lua and jemalloc are used (Debian's build links the system's
# Lua 5.1, the same Lua version): instruction counts are close to, not the same as, the
# packaged binary's.
set -euo pipefail
OUT=${1:-$(dirname "$0")/../../target/redis-symbols}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
VER=$(redis-server --version | sed -E 's/.*v=([0-9.]+).*/\1/')
BIN=$OUT/redis-$VER/src/redis-server
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
command -v dpkg-source >/dev/null || $SUDO apt-get install -y -qq dpkg-dev >/dev/null
if ! ls "$OUT"/redis_"$VER"*.orig.tar.gz >/dev/null 2>&1; then
  SRC=/etc/apt/sources.list.d/tidemark-redis-src.sources
  sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources | $SUDO tee "$SRC" >/dev/null
  trap '$SUDO rm -f "$SRC"' EXIT
  $SUDO apt-get update -qq
  (cd "$OUT" && apt-get source --download-only "redis=$(dpkg-query -W -f='${Version}' redis-server)" >/dev/null 2>&1)
fi
tar -xzf "$OUT"/redis_"$VER"*.orig.tar.gz -C "$OUT"
[ -d "$OUT/redis-$VER" ] || mv "$OUT"/redis-*"$VER"* "$OUT/redis-$VER" 2>/dev/null || true
make -C "$OUT/redis-$VER" -j"$(nproc)" OPTIMIZATION=-O2 CFLAGS=-g >"$OUT/build.log" 2>&1
echo "$BIN"
