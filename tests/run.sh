#!/usr/bin/env bash
# Runs every test: installs what the tests need (PostgreSQL 14 to 18, build tools, Apache Kafka; cached),
# then the unit and integration tests on the default PostgreSQL major and the core of the integration tests
# on every other major (OUTBOXD_PG_MATRIX=full: every test on every major). Each integration test starts and
# stops its own PostgreSQL cluster and broker. Ends with each failing test's panic (when any) and one summary line: "tests: N passed, N failed".
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/support/install-deps.sh
log="$(mktemp)"
# Each integration test's duration (tests/support), for the list of the slowest at the end.
OUTBOXD_TEST_TIMES="$(mktemp)"
export OUTBOXD_TEST_TIMES
trap 'rm -f "$log" "$OUTBOXD_TEST_TIMES"' EXIT
# Three tests at a time on 2 cores: a test spends much of its time waiting on its servers (a restart, a
# keepalive, a lease running out), and three at a time took a fifth less time than two.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-3}"
. tests/support/env.sh
# The core of the suite, run again on every other major of the version matrix: CDC end to end with SIGKILLs
# (rows sharing one commit among them), the polling path, the slot hand-off, migrations on an existing table,
# least privilege, and the failover tests of each major. Names are cargo test filters (substrings). What does
# not differ between majors (the password command, client certificates, row level security) runs on the
# default major only, to keep CI under an hour.
core=(
  cdc::delivers_every_committed_event_in_order_with_headers
  cdc::sigkill_mid_stream_loses_nothing
  cdc::rows_sharing_one_commit_survive_sigkills_mid_transaction
  poll::sweeper_publishes_rows_older_than_the_slot_exactly_once
  poll::a_slot_invalidated_while_outboxd_was_stopped_is_replaced_and_its_gap_swept
  poll::poison_event_is_handed_off_and_dead_lettered_from_cdc
  poll::migrate_adds_polling_columns_to_an_existing_table_without_a_rewrite
  poll::a_slot_invalidated_for_idleness_while_outboxd_was_stopped_is_replaced
  managed::the_owner_migrates_and_a_role_with_only_readmes_grants_runs
  failover::the_slot_is_a_failover_slot_from_17_on_unless_opted_out
  failover::decoding_on_a_standby_is_refused_with_the_reason
  failover::a_promoted_standby_continues_from_the_failover_slot_synchronised_to_it
  failover::a_promoted_standby_without_a_copy_of_the_slot_hands_the_gap_off
)
status=0
# The whole suite on the default major (OUTBOXD_PG_MAJOR, env.sh)...
echo "== PostgreSQL $PG_MAJOR: every test"
cargo test --no-fail-fast --lib --bins --tests "$@" 2>&1 | tee "$log" || status=$?
# ...the soak (ignored above) alone, its two paths side by side: memory growth is judged under a steady load,
# which other tests beside it would disturb...
echo "== PostgreSQL $PG_MAJOR: the soak, alone"
cargo test --no-fail-fast --test it "$@" -- --ignored soak:: 2>&1 | tee -a "$log" || status=$?
# ...then the core on every other major; OUTBOXD_PG_MATRIX=full runs every test on every major.
for major in $PG_MATRIX; do
  [ "$major" = "$PG_MAJOR" ] && continue
  if [ "${OUTBOXD_PG_MATRIX:-core}" = full ]; then
    echo "== PostgreSQL $major: every integration test"
    OUTBOXD_PG_MAJOR=$major cargo test --no-fail-fast --test it "$@" 2>&1 | tee -a "$log" || status=$?
  else
    echo "== PostgreSQL $major: the core"
    OUTBOXD_PG_MAJOR=$major cargo test --no-fail-fast --test it "$@" -- "${core[@]}" 2>&1 | tee -a "$log" || status=$?
  fi
done
# A failing test's reason, again at the end (CI logs are read from their end, and may be cut in the middle).
if [ "$status" -ne 0 ]; then
  echo "why the failing tests failed (the first lines of each panic; the whole output is above):"
  grep -A3 "panicked at" "$log" | grep -v "^stack backtrace:" | cut -c1-400 | head -40 || true
fi
if [ -s "$OUTBOXD_TEST_TIMES" ]; then
  echo "the slowest integration tests (seconds, every major):"
  # awk reads every line (no head): under pipefail, sort killed by SIGPIPE would fail the run (exit 141).
  sort -t$'\t' -k2,2nr "$OUTBOXD_TEST_TIMES" | awk -F'\t' 'NR <= 12 { printf "  %5d  %s\n", $2, $1 }'
fi
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
