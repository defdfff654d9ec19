#!/usr/bin/env bash
# Installs redis-server from Debian's packages when it is missing. Idempotent.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
echo "redis-server not found: installing it from Debian's packages (apt-get)..." >&2
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "error: need root or sudo to run: apt-get update && apt-get install -y redis-server" >&2
    exit 1
  fi
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
# Debian's package may start a system service on :6379; Tidemark never uses it.
redis-server --version
