#!/usr/bin/env bash
# Installs redis-server and redis-cli from Debian's packages when either is missing. Idempotent.
# (redis-cli, in the redis-tools package, creates and reshards the local Redis Clusters of
# crates/redis-proc; Debian's redis-server package depends on redis-tools, named here anyway.)
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
  exit 0
fi
echo "redis-server or redis-cli not found: installing them from Debian's packages (apt-get)..." >&2
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "error: need root or sudo to run: apt-get update && apt-get install -y redis-server redis-tools" >&2
    exit 1
  fi
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
# Debian's package may start a system service on :6379; Tidemark never uses it.
redis-server --version
redis-cli --version
