# Shared paths for the support scripts. Source it; do not run it.
# The broker binary is cached outside the checkout so later runs on the same machine reuse it.
OUTBOXD_CACHE="${OUTBOXD_CACHE:-/var/cache/outboxd}"
TANSU_VERSION=0.6.0
# dynostore: the in-memory engine most tests use; libsql: the sqlite:// engine whose data survives a broker
# restart (the chaos suite).
TANSU_FEATURES=dynostore,libsql
TANSU_ROOT="$OUTBOXD_CACHE/tansu-$TANSU_VERSION-${TANSU_FEATURES//,/-}"
TANSU_BIN="${OUTBOXD_TANSU_BIN:-$TANSU_ROOT/bin/tansu}"
# PostgreSQL: the server of OUTBOXD_PG_MAJOR (default PG_DEFAULT_MAJOR; tests/run.sh runs the core of the suite
# on every major of PG_MATRIX). 15 is Debian's, the others are unpacked by pg-servers.sh. Client tools (psql,
# pg_recvlogical, pg_basebackup) are always Debian's 15.
PG_MATRIX="14 15 16 17 18"
PG_DEFAULT_MAJOR=17
PG_MAJOR="${OUTBOXD_PG_MAJOR:-$PG_DEFAULT_MAJOR}"
pg_server_version() {
  case "$1" in
    14) echo 14.24.0 ;; 16) echo 16.15.0 ;; 17) echo 17.11.0 ;; 18) echo 18.6.0 ;;
    *) return 1 ;;
  esac
}
if [ "$PG_MAJOR" = 15 ]; then
  PG_BIN="${OUTBOXD_PG_BIN:-/usr/lib/postgresql/15/bin}"
else
  PG_BIN="${OUTBOXD_PG_BIN:-$OUTBOXD_CACHE/postgresql-$(pg_server_version "$PG_MAJOR" || echo "unsupported-$PG_MAJOR")/bin}"
fi
PG_CLIENT_BIN=/usr/lib/postgresql/15/bin
# Python tools the tests and the benchmark run (the Kubernetes manifests' validator, the CloudEvents SDK, the
# plain poller's Kafka and PostgreSQL clients), in their own virtual environment.
PY_TOOLS_PACKAGES="kubernetes-validate==1.37.0 cloudevents==2.2.0 confluent-kafka==2.12.1 psycopg[binary]==3.3.9"
PY_TOOLS="$OUTBOXD_CACHE/python-tools"
export OUTBOXD_CACHE TANSU_BIN PG_BIN PG_MAJOR PG_CLIENT_BIN PY_TOOLS
