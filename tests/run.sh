#!/usr/bin/env bash
# Runs every test: installs what the tests need (PostgreSQL 15, build tools, Apache Kafka; cached),
# then the unit and integration tests. Each integration test starts and stops its own PostgreSQL cluster
# and broker. Ends with one summary line: "tests: N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/support/install-deps.sh
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --no-fail-fast --lib --bins --tests "$@" 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
