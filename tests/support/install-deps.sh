#!/usr/bin/env bash
# Installs what building and testing outboxd needs on a fresh Debian 12 machine (as root):
# compilers and headers for librdkafka, PostgreSQL 15 (Debian) and servers of 14, 16, 17, 18, and Apache Kafka (Java 17 and Maven from
# Debian, Kafka's jars from Maven Central, cached). tansu is built only when OUTBOXD_TEST_BROKER=tansu.
# Idempotent: a second run installs nothing.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"

need_apt=()
# curl: the demo samples /metrics with it.
# xz-utils: the PostgreSQL servers of the other majors come as .txz (pg-servers.sh).
for pkg in build-essential pkg-config zlib1g-dev libssl-dev openssl sqlite3 postgresql-15 postgresql-client-15 curl xz-utils; do
  [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" == *"install ok installed"* ]] || need_apt+=("$pkg")
done
# Apache Kafka runs on Java 17; Maven fetches its jars and builds examples/java-order-service (any Java 17+ and
# Maven already installed will do). The JDK, not only the runtime: kafka.sh compiles its small Admin API tool
# (users and ACLs of the secure broker).
command -v javac >/dev/null || need_apt+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null || need_apt+=(maven)
# Python 3 with venv: the Kubernetes manifests' validator is installed into a virtual environment.
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3 python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing packages: ${need_apt[*]} (run this script as root, or install them)" >&2
    exit 1
  fi
  echo "installing: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Do not let the package start Debian's own cluster: tests run their own throwaway clusters.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  rm -f /usr/sbin/policy-rc.d
fi

if ! id postgres >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  useradd --system --create-home --shell /bin/bash postgres
fi

bash "$here/kafka.sh" install
# PostgreSQL servers of the other majors of the version matrix (Maven Central, cached).
bash "$here/pg-servers.sh" install
if [ "${OUTBOXD_TEST_BROKER:-kafka}" = tansu ] && [ ! -x "$TANSU_BIN" ]; then
  echo "installing tansu $TANSU_VERSION (features: $TANSU_FEATURES) into $TANSU_ROOT; takes several minutes once"
  mkdir -p "$OUTBOXD_CACHE"
  CARGO_TARGET_DIR="$OUTBOXD_CACHE/tansu-build" \
    cargo install --locked tansu --version "$TANSU_VERSION" --features "$TANSU_FEATURES" --root "$TANSU_ROOT"
  rm -rf "$OUTBOXD_CACHE/tansu-build"
fi
# Python tools of the tests: the Kubernetes manifests' validator (tests/it/kubernetes.rs) and the CloudEvents
# SDK that reads --format cloudevents records (tests/it/cloudevents.rs); the benchmark's Python plain poller
# (examples/plain_poller.py: confluent-kafka, psycopg).
if [ "$(cat "$PY_TOOLS/.installed" 2>/dev/null)" != "$PY_TOOLS_PACKAGES" ]; then
  echo "installing $PY_TOOLS_PACKAGES into $PY_TOOLS (once)"
  rm -rf "$PY_TOOLS"
  mkdir -p "$OUTBOXD_CACHE"
  python3 -m venv "$PY_TOOLS"
  # shellcheck disable=SC2086 # a list of requirements
  "$PY_TOOLS/bin/pip" install --quiet --disable-pip-version-check $PY_TOOLS_PACKAGES
  echo "$PY_TOOLS_PACKAGES" >"$PY_TOOLS/.installed"
fi
echo "dependencies ready: Apache Kafka in $OUTBOXD_CACHE, PostgreSQL $PG_MAJOR at $PG_BIN, Python tools in $PY_TOOLS"
