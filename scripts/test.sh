#!/usr/bin/env bash
# The whole test suite, as README.md and CI run it: installs redis-server if missing (and
# Chromium with chromedriver for the console's browser test), then runs every test of the
# workspace against real redis-server processes, and the replica-wait tests once more against
# Valkey 8 (fetched from Debian bookworm-backports by scripts/with-valkey.sh); then the lints
# every commit keeps: rustfmt, clippy with warnings as errors, and the docs (every intra-doc
# link resolves; links from public to private items are allowed: these crates document their
# private items for the project's developers).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-redis.sh
if ! scripts/install-chromium.sh; then
  echo "*** chromium/chromedriver could not be installed: the browser test (cmd/tidemark/tests/console.rs) will print SKIPPED ***" >&2
fi
cargo test --workspace --locked "$@"
# The trim check's reconnect case (ADR-0063) and a duplicate's confirmation on another
# connection (ADR-0116) can only fail on a server whose WAIT counts what the connection itself
# wrote: Redis 7.0 does not, Valkey 8 does. Run those tests there too.
if scripts/with-valkey.sh true; then
  scripts/with-valkey.sh cargo test --locked -p tidemark-store --test trim_check --test replicated_reads "$@"
else
  echo "*** Valkey 8 could not be fetched (scripts/with-valkey.sh): trim_check and replicated_reads ran on Redis 7.0 only, SKIPPED on Valkey ***" >&2
fi
# The lints. A toolchain without rustfmt or clippy (a minimal rustup profile) skips that one,
# with a notice.
if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all --check
else
  echo "*** rustfmt is not installed: the formatting check was SKIPPED ***" >&2
fi
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --workspace --all-targets --locked -- -D warnings
else
  echo "*** clippy is not installed: the clippy check was SKIPPED ***" >&2
fi
RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
  cargo doc --workspace --no-deps --document-private-items --locked
