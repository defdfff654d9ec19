#!/usr/bin/env bash
# Runs Tidemark locally: installs redis-server if missing, builds, and starts `tidemark up`
# (its own redis-server processes, data under ./data, development auth on).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-redis.sh
exec cargo run --release --locked -p tidemark -- up --dev-auth "$@"
