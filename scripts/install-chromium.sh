#!/usr/bin/env bash
# Installs headless Chromium and its WebDriver (chromedriver) from Debian's packages when
# either is missing: the console's browser test (cmd/tidemark/tests/console.rs) drives them.
# Idempotent. Exits non-zero when they cannot be installed; scripts/test.sh goes on then, and
# the browser test prints a SKIPPED notice.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
echo "chromium/chromedriver not found: installing them from Debian's packages (apt-get)..." >&2
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "error: need root or sudo to run: apt-get update && apt-get install -y chromium chromium-driver" >&2
    exit 1
  fi
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
chromium --version
chromedriver --version
