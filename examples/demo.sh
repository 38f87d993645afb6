#!/usr/bin/env bash
# The whole thing, end to end, on this machine: a local PostgreSQL 15 with logical replication, a local
# Apache Kafka broker (KRaft), migrations, outboxd, and an "order service" inserting orders with their
# outbox events in one transaction. Shows the events arriving in Kafka and outboxd's status, then stops
# everything it started.
#   bash examples/demo.sh            (ports: DEMO_PG_PORT=7432, DEMO_BROKER_PORT=7092, DEMO_METRICS_PORT=7187;
#                                     DEMO_PROFILE=dev uses the debug build instead of the release one)
# The default ports are below Linux's ephemeral range (32768..61000): a port in it can be the source port of
# some outgoing connection at the moment the broker binds it (CI once failed so on 59092).
set -euo pipefail
cd "$(dirname "$0")/.."
support=tests/support
bash "$support/install-deps.sh"

work="${DEMO_DIR:-/tmp/outboxd-demo}"
pg_port="${DEMO_PG_PORT:-7432}"
broker_port="${DEMO_BROKER_PORT:-7092}"
metrics_port="${DEMO_METRICS_PORT:-7187}"
case "${DEMO_PROFILE:-release}" in
  release) build_flags=(--release) bin=target/release ;;
  dev) build_flags=() bin=target/debug ;;
  *) echo "DEMO_PROFILE must be release or dev, not ${DEMO_PROFILE}" >&2; exit 2 ;;
esac
db="postgres://postgres@127.0.0.1:$pg_port/postgres"
brokers="127.0.0.1:$broker_port"
outboxd_pid=""
sampler_pid=""

cleanup() {
  [ -n "$sampler_pid" ] && kill "$sampler_pid" 2>/dev/null || true
  [ -n "$outboxd_pid" ] && kill "$outboxd_pid" 2>/dev/null && wait "$outboxd_pid" 2>/dev/null || true
  bash "$support/broker.sh" stop "$work/broker" || true
  bash "$support/pg.sh" stop "$work/pg" || true
}
trap cleanup EXIT
# Waits (up to 30 s) until every outbox row has published_at.
wait_drained() {
  for _ in $(seq 1 300); do
    left=$(psql "$db" -Atc "SELECT count(*) FROM outbox_event WHERE published_at IS NULL")
    [ "$left" = "0" ] && return 0
    sleep 0.1
  done
  echo "$left events still unpublished after 30 s; outboxd's log: $work/outboxd.log" >&2
  exit 1
}
# Fails unless outboxd's published counter (from /metrics) is exactly $1.
expect_published() {
  published=$(curl -s "http://127.0.0.1:$metrics_port/metrics" |
    awk '/^outboxd_events_published_total\{path="cdc"\}/ { print $2 }')
  if [ "$published" != "$1" ]; then
    echo "outboxd published ${published:-nothing}, expected $1 ($2); log: $work/outboxd.log" >&2
    exit 1
  fi
}

# Fails, naming the variable to change, when something already holds one of the demo's ports.
for var in DEMO_PG_PORT:$pg_port DEMO_BROKER_PORT:$broker_port DEMO_METRICS_PORT:$metrics_port; do
  # SO_REUSEADDR as the servers bind: a connection of the last run in TIME_WAIT does not hold the port.
  if ! python3 -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "${var#*:}" 2>/dev/null; then
    echo "port ${var#*:} is in use on 127.0.0.1: stop what holds it or pick another, e.g. ${var%%:*}=$((${var#*:} + 1)) bash examples/demo.sh" >&2
    exit 1
  fi
done

rm -rf "$work" && mkdir -p "$work"
echo "== building outboxd (${DEMO_PROFILE:-release})"
cargo build "${build_flags[@]}" --bin outboxd --example tail
echo "== starting PostgreSQL on $pg_port and the broker on $broker_port"
bash "$support/pg.sh" start "$work/pg" "$pg_port"
bash "$support/broker.sh" start "$work/broker" "$broker_port"

echo "== outboxd migrate"
"$bin"/outboxd migrate --database-url "$db"

echo "== outboxd doctor (every check run needs, each with its fix; exit 0: nothing to fix)"
"$bin"/outboxd doctor --database-url "$db" --brokers "$brokers" --topic-replication-factor 1

echo "== outboxd run (log: $work/outboxd.log)"
"$bin"/outboxd run --database-url "$db" --brokers "$brokers" --topic-replication-factor 1 \
  --metrics-addr "127.0.0.1:$metrics_port" >"$work/outboxd.log" 2>&1 &
outboxd_pid=$!
# Sample /metrics twice a second into a CSV (examples/plot_metrics.py turns it into the README picture).
echo "t,published,unpublished,lag_bytes,inflight,ack_count,ack_sum" >"$work/metrics.csv"
(
  while kill -0 "$outboxd_pid" 2>/dev/null; do
    curl -s "http://127.0.0.1:$metrics_port/metrics" | awk -v t="$(date +%s.%N)" '
      /^outboxd_events_published_total\{path="cdc"\}/ { p = $2 }
      /^outboxd_unpublished_events / { u = $2 }
      /^outboxd_slot_lag_bytes / { l = $2 }
      /^outboxd_inflight_events / { i = $2 }
      /^outboxd_commit_to_ack_seconds_count/ { c = $2 }
      /^outboxd_commit_to_ack_seconds_sum/ { s = $2 }
      END { if (p != "") printf "%s,%s,%s,%s,%s,%s,%s\n", t, p, u, l, i, c + 0, s + 0 }' >>"$work/metrics.csv" ||
      true # /metrics not up yet: under set -e a failed curl used to end the sampler for good (an empty CSV)
    sleep 0.5
  done
) &
sampler_pid=$!
for _ in $(seq 1 200); do
  active=$(psql "$db" -Atc "SELECT active FROM pg_replication_slots WHERE slot_name = 'outboxd'" 2>/dev/null || true)
  [ "$active" = "t" ] && break
  kill -0 "$outboxd_pid" || { cat "$work/outboxd.log"; exit 1; }
  sleep 0.1
done

echo "== an order service places 20 orders (business row + outbox row in one transaction; one rolls back)"
psql "$db" -q <<'SQL'
CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, customer text, total numeric);
DO $$
BEGIN
  FOR i IN 1..20 LOOP
    INSERT INTO orders VALUES ('order-' || i, 'customer-' || (i % 5), i * 10.5);
    INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
    VALUES (gen_random_uuid(), 'Order', 'order-' || i, 'OrderPlaced',
            jsonb_build_object('orderId', 'order-' || i, 'customer', 'customer-' || (i % 5), 'total', i * 10.5));
    COMMIT;
  END LOOP;
END $$;
BEGIN;
INSERT INTO orders VALUES ('order-rolled-back', 'nobody', 0);
INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
VALUES (gen_random_uuid(), 'Order', 'order-rolled-back', 'OrderPlaced', '{"never": "published"}');
ROLLBACK;
SQL

echo "== the events in Kafka (topic outbox.Order)"
"$bin"/examples/tail --brokers "$brokers" --topic outbox.Order --count 20 --timeout-secs 60
wait_drained
expect_published 20 "the 20 committed orders, not the rolled-back one"
echo "== steady traffic for ~15 s: 60 transactions of 50 events, 4 per second (metrics sampled meanwhile)"
psql "$db" -q <<'SQL'
DO $$
BEGIN
  FOR t IN 1..60 LOOP
    INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
    SELECT gen_random_uuid(), 'Order', 'order-' || (t * 50 + i) % 200, 'OrderUpdated',
           jsonb_build_object('n', t * 50 + i, 'pad', repeat('x', 150))
    FROM generate_series(1, 50) i;
    COMMIT;
    PERFORM pg_sleep(0.25);
  END LOOP;
END $$;
SQL
wait_drained
expect_published 3020 "every committed event"
sleep 6  # let the 5 s gauges and the sampler catch the drained state
samples=$(($(wc -l <"$work/metrics.csv") - 1))
echo "== metrics sampled during the demo: $work/metrics.csv ($samples samples)"
if [ "$samples" -lt 10 ]; then
  echo "the metrics sampler recorded $samples samples (want at least 10): is curl installed and /metrics up?" >&2
  exit 1
fi
echo "== outboxd status"
"$bin"/outboxd status --database-url "$db"
echo "== demo done: 20 committed orders published, the rolled-back one never was"
