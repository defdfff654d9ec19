#!/usr/bin/env bash
# Runs a command with Valkey 8 (Debian bookworm-backports) as `redis-server`/`redis-cli` on
# PATH, so that tests which start their own servers run against Valkey instead of Debian 12's
# Redis 7.0. Off CI's path: the project's supported server stays Debian's redis-server.
#
#   scripts/with-valkey.sh cargo test -p tidemark-store --test trim_check
#
# Why: some server behaviour differs between the two. Redis 7.0 sets a client's replication
# offset after every command, Valkey 8 only after one that propagated, so a
# `WAIT` that covers nothing the connection wrote answers at once there (ADR-0063).
# The packages are downloaded and unpacked under target/valkey, not installed; no root needed.
#
# Only the two packages are fetched, not their dependencies: the libraries valkey-server links
# (libjemalloc2, liblzf1, libssl3, libsystemd0) are those of Debian's redis-server, which
# scripts/install-redis.sh installs.
set -euo pipefail
if [ $# -eq 0 ]; then
  echo "usage: $0 COMMAND [ARGS...]   (runs COMMAND with Valkey 8 as redis-server on PATH)" >&2
  exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
dir="$(realpath -m "${VALKEY_DIR:-$root/target/valkey}")"
if [ ! -x "$dir/bin/redis-server" ]; then
  rm -rf "$dir/debs" "$dir/root"
  mkdir -p "$dir/apt/lists/partial" "$dir/apt/cache/archives/partial" "$dir/debs" "$dir/bin"
  echo "deb http://deb.debian.org/debian bookworm-backports main" > "$dir/apt/sources.list"
  opts=(-o "Dir::Etc::sourcelist=$dir/apt/sources.list" -o "Dir::Etc::sourceparts=-"
        -o "Dir::State::Lists=$dir/apt/lists" -o "Dir::Cache=$dir/apt/cache"
        -o "APT::Default-Release=bookworm-backports" -o "Debug::NoLocking=1")
  echo "fetching valkey-server and valkey-tools from bookworm-backports into $dir ..." >&2
  apt-get "${opts[@]}" update -qq
  (cd "$dir/debs" && apt-get "${opts[@]}" download valkey-server valkey-tools)
  for deb in "$dir"/debs/*.deb; do dpkg-deb -x "$deb" "$dir/root"; done
  ln -sf "$dir/root/usr/bin/valkey-server" "$dir/bin/redis-server"
  ln -sf "$dir/root/usr/bin/valkey-cli" "$dir/bin/redis-cli"
fi
export PATH="$dir/bin:$PATH"
redis-server --version >&2
exec "$@"
