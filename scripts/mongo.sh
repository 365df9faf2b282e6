#!/usr/bin/env bash
# Local MongoDB wire-protocol test server for the demo and manual tests: mongo-java-server 1.47.0 (in memory, oplog
# enabled, see docs/mongodb.md) started by the launcher cdclake.MongoTestServer that scripts/setup.sh builds into
# .jars/mongo-test-server/. A background process on a private loopback port; its data is gone when it stops, unless
# CDC_MONGO_FILE names a data file (the H2 file backend: collections and oplog kept across restarts; the demo's).
#   scripts/mongo.sh start|stop|status
# Environment: CDC_MONGO_PORT (default 54337), CDC_MONGO_STATE (default <repo>/.state/mongo: pid file, port file,
# server.log), CDC_MONGO_FILE (default: none, in memory), CDC_JARS_DIR (default <repo>/.jars), PYTHON (default <repo>/.venv/bin/python: with pymongo, `start`
# waits for an answered ping; without it, for the port to accept connections).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PORT="${CDC_MONGO_PORT:-54337}"
STATE="${CDC_MONGO_STATE:-$ROOT/.state/mongo}"
JARS="${CDC_JARS_DIR:-$ROOT/.jars}/mongo-test-server"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
PIDFILE="$STATE/server.pid"
PORTFILE="$STATE/server.port"
LOG="$STATE/server.log"

# the pid of the running launcher of this state folder, or nothing
running_pid() {
  local pid
  [ -f "$PIDFILE" ] || return 0
  pid="$(cat "$PIDFILE")"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q cdclake.MongoTestServer
  then
    echo "$pid"
  fi
}

answers_ping() {
  if [ -x "$PYTHON" ] && "$PYTHON" -c "import pymongo" 2>/dev/null; then
    "$PYTHON" - "$1" <<'PY' 2>/dev/null
import sys
import pymongo
client = pymongo.MongoClient(f"mongodb://127.0.0.1:{sys.argv[1]}/?directConnection=true", serverSelectionTimeoutMS=500)
try:
    client.admin.command("ping")
finally:
    client.close()
PY
  else
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
  fi
}

case "${1:-}" in
  start)
    pid="$(running_pid)"
    if [ -n "$pid" ]; then
      RUNNING_PORT="$(cat "$PORTFILE")"
      if [ "$RUNNING_PORT" != "$PORT" ]; then
        echo "the mongo test server of $STATE is already running on port $RUNNING_PORT, not CDC_MONGO_PORT=$PORT:" \
          "run 'scripts/mongo.sh stop' (or set CDC_MONGO_PORT=$RUNNING_PORT)" >&2
        exit 1
      fi
    else
      if [ ! -f "$JARS/mongo-test-server.jar" ]; then
        echo "no MongoDB test server jar in $JARS: run scripts/setup.sh (Maven builds jvm/mongo-test-server)" >&2
        exit 1
      fi
      mkdir -p "$STATE"
      # a session of its own: the server outlives this shell and its terminal
      setsid java -cp "$JARS/*" cdclake.MongoTestServer 127.0.0.1 "$PORT" ${CDC_MONGO_FILE:+"$CDC_MONGO_FILE"} \
        > "$LOG" 2>&1 < /dev/null &
      pid=$!
      echo "$pid" > "$PIDFILE"
      echo "$PORT" > "$PORTFILE"
      for _ in $(seq 1 300); do
        if ! kill -0 "$pid" 2>/dev/null; then
          echo "the mongo test server exited at start; $LOG:" >&2
          cat "$LOG" >&2
          rm -f "$PIDFILE" "$PORTFILE"
          exit 1
        fi
        if grep -q '^listening ' "$LOG" && answers_ping "$PORT"; then
          break
        fi
        sleep 0.1
      done
      if ! answers_ping "$PORT"; then
        echo "the mongo test server (pid $pid) does not answer on 127.0.0.1:$PORT after 30 s; see $LOG" >&2
        exit 1
      fi
    fi
    echo "mongo test server running on 127.0.0.1:$PORT (pid $pid)"
    ;;
  stop)
    pid="$(running_pid)"
    if [ -n "$pid" ]; then
      kill -TERM "$pid"
      for _ in $(seq 1 200); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      if kill -0 "$pid" 2>/dev/null; then
        echo "the mongo test server (pid $pid) did not stop within 20 s of SIGTERM; killing it" >&2
        kill -KILL "$pid"
      fi
    fi
    rm -f "$PIDFILE" "$PORTFILE"
    ;;
  status)
    pid="$(running_pid)"
    if [ -z "$pid" ]; then
      echo "mongo test server of $STATE is not running"
      exit 3
    fi
    echo "mongo test server running on 127.0.0.1:$(cat "$PORTFILE") (pid $pid)"
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
