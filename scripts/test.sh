#!/usr/bin/env bash
# The whole test suite, as README.md and CI run it: installs redis-server if missing (and
# Chromium with chromedriver for the console's browser test), then runs every test of the
# workspace against real redis-server processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-redis.sh
if ! scripts/install-chromium.sh; then
  echo "*** chromium/chromedriver could not be installed: the browser test (cmd/tidemark/tests/console.rs) will print SKIPPED ***" >&2
fi
cargo test --workspace --locked "$@"
