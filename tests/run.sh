#!/usr/bin/env bash
# Runs every test: installs what the tests need (PostgreSQL 15, build tools, Apache Kafka; cached),
# then the unit and integration tests. Each integration test starts and stops its own PostgreSQL cluster
# and broker. Ends with each failing test's panic (when any) and one summary line: "tests: N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/support/install-deps.sh
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
status=0
cargo test --no-fail-fast --lib --bins --tests "$@" 2>&1 | tee "$log" || status=$?
# A failing test's reason, again at the end (CI logs are read from their end, and may be cut in the middle).
if [ "$status" -ne 0 ]; then
  echo "why the failing tests failed (the first lines of each panic; the whole output is above):"
  grep -A3 "panicked at" "$log" | grep -v "^stack backtrace:" | cut -c1-400 | head -40 || true
fi
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
