#!/usr/bin/env bash
# Local PostgreSQL for the demo and the tests: a private cluster under .state/pg, owned by the
# `postgres` OS user (the server refuses to run as root), wal_level=logical, on a private port.
#   scripts/pg.sh start|stop|status|psql [args]
# Environment: CDC_PG_PORT (default 54329), CDC_PG_STATE (default <repo>/.state/pg).
# Local (unix-socket) connections of the OS user `postgres` are trusted: that is the administrator.
# TCP connections on 127.0.0.1 need a password (scram-sha-256), as the pipeline's roles use.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${CDC_PG_PORT:-54329}"
STATE="${CDC_PG_STATE:-$ROOT/.state/pg}"
DATA="$STATE/data"
SOCK="$STATE/sock"
BIN="$(ls -d /usr/lib/postgresql/15/bin 2>/dev/null || dirname "$(command -v pg_ctl)")"

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case "${1:-}" in
  start)
    mkdir -p "$STATE" "$SOCK"
    [ "$(id -u)" = 0 ] && chown postgres "$STATE" "$SOCK"
    if [ ! -f "$DATA/PG_VERSION" ]; then
      as_pg "$BIN/initdb" -D "$DATA" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
        -E UTF8 --locale=C.UTF-8 >/dev/null
      cat >> "$DATA/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$SOCK'
wal_level = logical
max_replication_slots = 20
max_wal_senders = 20
max_connections = 200
shared_buffers = 256MB
fsync = off
synchronous_commit = off
full_page_writes = off
log_min_messages = warning
CONF
      # Replication-protocol connections of password-holding roles (not used by the pipeline's SQL interface,
      # but what a Debezium-style reader would need) on loopback only.
      echo "host replication all 127.0.0.1/32 scram-sha-256" >> "$DATA/pg_hba.conf"
    fi
    if ! as_pg "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
      # the port on the command line: the one in postgresql.conf is the port of the cluster's first start
      as_pg "$BIN/pg_ctl" -D "$DATA" -l "$STATE/server.log" -o "-p $PORT" -w -t 60 start >/dev/null
    else
      RUNNING_PORT="$(sed -n 4p "$DATA/postmaster.pid")"
      if [ "$RUNNING_PORT" != "$PORT" ]; then
        echo "postgresql of $STATE is already running on port $RUNNING_PORT, not CDC_PG_PORT=$PORT:" \
          "run 'scripts/pg.sh stop' (or set CDC_PG_PORT=$RUNNING_PORT)" >&2
        exit 1
      fi
    fi
    echo "postgresql running on 127.0.0.1:$PORT (socket $SOCK)"
    ;;
  stop)
    if [ -f "$DATA/PG_VERSION" ] && as_pg "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
      as_pg "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null
    fi
    ;;
  restart)
    as_pg "$BIN/pg_ctl" -D "$DATA" -m fast -w -l "$STATE/server.log" restart >/dev/null
    ;;
  status)
    as_pg "$BIN/pg_ctl" -D "$DATA" status
    ;;
  psql)
    shift
    as_pg psql -h "$SOCK" -p "$PORT" -U postgres -v ON_ERROR_STOP=1 "$@"
    ;;
  *)
    echo "usage: $0 start|stop|restart|status|psql [args]" >&2; exit 2 ;;
esac
