#!/usr/bin/env bash
# Throwaway PostgreSQL cluster (of OUTBOXD_PG_MAJOR, env.sh) for tests and the demo.
#   pg.sh start DIR PORT    initdb (if needed) and start; wal_level=logical unless PG_WAL_LEVEL is set
#   pg.sh stop DIR [MODE]   stop it (-m fast, or MODE: immediate)
#   pg.sh restart DIR MODE  restart with -m fast|immediate
#   pg.sh basebackup DIR PORT SOURCE_PORT [standby]
#                           a base backup (pg_basebackup up to 15, the low-level API after) of the server on SOURCE_PORT into DIR, set to listen on PORT (not
#                           started: use start); with "standby" it streams from the source (-R)
#   pg.sh promote DIR       promote a standby and wait until it accepts writes
# Runs the server as the unprivileged user 'postgres' when invoked as root (PostgreSQL refuses root).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
. "$here/env.sh"

as_pg() {
  if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

psql_to() {
  "$PG_CLIENT_BIN/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$1" -U postgres -d postgres "${@:2}"
}

# A base backup of the server on port $1 into $2 with pg_backup_start / a copy / pg_backup_stop. With $3 =
# standby, the copy streams from the source through a physical slot of its own ("standby_<pid>", also its
# primary_slot_name), which keeps the WAL the copy needs from the backup's start.
low_level_backup() {
  local source_port="$1" target="$2" standby="$3" source_dir slot=""
  source_dir="$(psql_to "$source_port" -Atc "SHOW data_directory")"
  if [ -n "$standby" ]; then
    slot="standby_$$"
    psql_to "$source_port" -Atc "SELECT pg_create_physical_replication_slot('$slot', true)" >/dev/null
  fi
  local copy="cp -a '$source_dir' '$target' && rm -f '$target/postmaster.pid' '$target/postmaster.opts' && find '$target/pg_replslot' -mindepth 1 -delete"
  psql_to "$source_port" <<SQL
SELECT pg_backup_start('outboxd tests', true);
\\! $copy
\\pset tuples_only on
\\pset format unaligned
SELECT labelfile FROM pg_backup_stop(false) \\g $target/backup_label
SQL
  # The WAL written up to the backup's end (the copy above may predate it).
  cp -a "$source_dir/pg_wal/." "$target/pg_wal/"
  if [ -n "$standby" ]; then
    touch "$target/standby.signal"
    printf "primary_conninfo = 'host=127.0.0.1 port=%s user=postgres dbname=postgres'\nprimary_slot_name = '%s'\n" \
      "$source_port" "$slot" >>"$target/postgresql.auto.conf"
  fi
  [ "$(id -u)" -eq 0 ] && chown -R postgres: "$target"
  return 0
}

cmd="${1:?usage: pg.sh start|stop|restart DIR [PORT|MODE]}"
dir="${2:?DIR required}"
case "$cmd" in
  start)
    port="${3:?PORT required}"
    mkdir -p "$dir"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$dir"
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      as_pg "$PG_BIN/initdb" -D "$dir/data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 --no-sync >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
      cat >>"$dir/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$dir'
wal_level = ${PG_WAL_LEVEL:-logical}
max_wal_senders = 20
max_replication_slots = 20
fsync = off
full_page_writes = off
log_min_messages = warning
CONF
    fi
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null \
      || { tail -20 "$dir/server.log" >&2; exit 1; }
    ;;
  stop)
    [ -f "$dir/data/postmaster.pid" ] && as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -m "${3:-fast}" -w stop >/dev/null || true
    ;;
  basebackup)
    port="${3:?PORT required}"
    source_port="${4:?SOURCE_PORT required}"
    mkdir -p "$dir"
    [ "$(id -u)" -eq 0 ] && chown postgres: "$dir"
    if [ "$PG_MAJOR" -le 15 ]; then
      as_pg "$PG_CLIENT_BIN/pg_basebackup" -h 127.0.0.1 -p "$source_port" -U postgres -D "$dir/data" -X stream --no-sync \
        ${5:+--write-recovery-conf} >"$dir/basebackup.log" 2>&1 || { cat "$dir/basebackup.log" >&2; exit 1; }
    else
      # pg_basebackup 15 refuses newer servers: the low-level backup API, in one session.
      low_level_backup "$source_port" "$dir/data" "${5:-}" >"$dir/basebackup.log" 2>&1 || { cat "$dir/basebackup.log" >&2; exit 1; }
    fi
    # Later lines win: listen on our own port and socket directory.
    printf "port = %s\nunix_socket_directories = '%s'\n" "$port" "$dir" >>"$dir/data/postgresql.conf"
    ;;
  promote)
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -w -t 60 promote >/dev/null
    ;;
  restart)
    as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -m "${3:-fast}" -w -t 60 restart >/dev/null
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
