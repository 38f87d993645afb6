#!/usr/bin/env bash
# The local broker of the tests, the demo and the benchmark: Apache Kafka (tests/support/kafka.sh) unless
# OUTBOXD_TEST_BROKER=tansu, which runs tansu, a Kafka-protocol broker (a second, optional target):
#   broker.sh start DIR PORT [ADVERTISED_PORT]   start it in the background and wait until it answers;
#                              clients are sent to ADVERTISED_PORT (e.g. a test's proxy). Data in DIR survives
#                              stop and start (tansu: only with TANSU_STORAGE=sqlite://tansu.db).
#   broker.sh stop DIR         stop it
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"
if [ "${OUTBOXD_TEST_BROKER:-kafka}" != tansu ]; then
  exec "$here/kafka.sh" "$@"
fi

cmd="${1:?usage: broker.sh start|stop DIR [PORT]}"
dir="${2:?DIR required}"
case "$cmd" in
  start)
    port="${3:?PORT required}"
    advertised="${4:-$port}"
    [ -x "$TANSU_BIN" ] || { echo "tansu not found at $TANSU_BIN: run tests/support/install-deps.sh" >&2; exit 1; }
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    # tansu resolves a sqlite:// storage URL against its working directory: run it in DIR.
    cd "$dir"
    nohup "$TANSU_BIN" broker \
      --listener-url "tcp://127.0.0.1:$port" \
      --advertised-listener-url "tcp://127.0.0.1:$advertised" \
      --storage-engine "${TANSU_STORAGE:-memory://tansu/}" >"$dir/tansu.log" 2>&1 &
    echo $! >"$dir/tansu.pid"
    for _ in $(seq 1 100); do
      if timeout 2 "$TANSU_BIN" topic list --broker "tcp://127.0.0.1:$port" >/dev/null 2>&1; then
        # tansu 0.6's sqlite schema has no index on header(topition, offset_id) and looks headers up per
        # record: reading N records back scans the header table N times. Add the index it lacks.
        if [ -f "$dir/tansu.db" ]; then
          sqlite3 -cmd ".timeout 10000" "$dir/tansu.db" "CREATE INDEX IF NOT EXISTS header_by_record ON header (topition, offset_id)"
        fi
        exit 0
      fi
      kill -0 "$(cat "$dir/tansu.pid")" 2>/dev/null || { cat "$dir/tansu.log" >&2; exit 1; }
      sleep 0.2
    done
    echo "tansu did not become ready on port $port" >&2; cat "$dir/tansu.log" >&2; exit 1
    ;;
  stop)
    if [ -f "$dir/tansu.pid" ]; then
      pid="$(cat "$dir/tansu.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$dir/tansu.pid"
    fi
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
