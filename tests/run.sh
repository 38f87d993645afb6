#!/usr/bin/env bash
# Runs every test: installs what the tests need (PostgreSQL 15, build tools, the tansu broker; cached),
# then `cargo test`. Each integration test starts and stops its own PostgreSQL cluster and broker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/support/install-deps.sh
cargo test --all-targets "$@"
