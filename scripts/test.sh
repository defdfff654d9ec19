#!/usr/bin/env bash
# The whole test suite, as README.md and CI run it: installs redis-server if missing, then
# runs every test of the workspace against real redis-server processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-redis.sh
cargo test --workspace --locked "$@"
