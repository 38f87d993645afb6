# Shared paths for the support scripts. Source it; do not run it.
# The broker binary is cached outside the checkout so later runs on the same machine reuse it.
OUTBOXD_CACHE="${OUTBOXD_CACHE:-/var/cache/outboxd}"
TANSU_VERSION=0.6.0
# dynostore: the in-memory engine most tests use; libsql: the sqlite:// engine whose data survives a broker
# restart (the chaos suite).
TANSU_FEATURES=dynostore,libsql
TANSU_ROOT="$OUTBOXD_CACHE/tansu-$TANSU_VERSION-${TANSU_FEATURES//,/-}"
TANSU_BIN="${OUTBOXD_TANSU_BIN:-$TANSU_ROOT/bin/tansu}"
PG_BIN="${OUTBOXD_PG_BIN:-/usr/lib/postgresql/15/bin}"
# Python tools the tests run (the Kubernetes manifests' validator, the CloudEvents SDK), in their own
# virtual environment.
PY_TOOLS_PACKAGES="kubernetes-validate==1.37.0 cloudevents==2.2.0"
PY_TOOLS="$OUTBOXD_CACHE/python-tools"
export OUTBOXD_CACHE TANSU_BIN PG_BIN PY_TOOLS
