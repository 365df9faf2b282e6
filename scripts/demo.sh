#!/usr/bin/env bash
# The demo: install everything, start PostgreSQL (wal_level=logical, private port) with the demo database and
# the MongoDB test server (its data in .state/mongo/demo.mv.db, kept across demos) with the database shop, a live
# write workload on each, and Dagster (webserver + daemon). The planner sensors plan chunks and request the initial
# snapshots; the streaming sensors keep the Delta mirrors under .state/lake current.
# Ctrl-C stops everything it started (Dagster, the workloads, PostgreSQL, the MongoDB server).
# So does SIGTERM (kill <pid>). Started in the background by a shell without job control (`scripts/demo.sh &` in a
# script), bash ignores SIGINT from the start and can not trap it: stop it with SIGTERM then.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh

export CDC_PG_PORT="${CDC_PG_PORT:-54329}"
export CDC_LAKE_ROOT="${CDC_LAKE_ROOT:-$ROOT/.state/lake}"
export DAGSTER_HOME="$ROOT/dagster_home"
export DAGSTER_PORT="${DAGSTER_PORT:-3000}"
export CDC_MONGO_PORT="${CDC_MONGO_PORT:-54337}"
export CDC_MONGO_FILE="${CDC_MONGO_FILE:-$ROOT/.state/mongo/demo.mv.db}"
export CDC_MONGODB_URI="mongodb://127.0.0.1:$CDC_MONGO_PORT/?directConnection=true"
mkdir -p .state
if [ -z "${CDC_DEMO_PASSWORD:-}" ]; then
  [ -f .state/demo_password ] || (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' > .state/demo_password)
  CDC_DEMO_PASSWORD="$(cat .state/demo_password)"
fi
export CDC_DEMO_PASSWORD

pg_was_running=0
scripts/pg.sh status >/dev/null 2>&1 && pg_was_running=1
scripts/pg.sh start
mongo_was_running=0
scripts/mongo.sh status >/dev/null 2>&1 && mongo_was_running=1
mkdir -p "$(dirname "$CDC_MONGO_FILE")"
scripts/mongo.sh start
pids=()
# job control: each background job gets its own process group and keeps SIGINT (dagster dev shuts down
# cleanly on SIGINT, not on SIGTERM); cleanup interrupts the groups, waits, then kills what is left.
set -m
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null || true; done
  for _ in $(seq 1 60); do
    alive=0
    for pid in "${pids[@]}"; do pgrep -g "$pid" >/dev/null 2>&1 && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  # stop PostgreSQL only if the demo started it (a test run may be using the same cluster)
  [ "$pg_was_running" = 1 ] || scripts/pg.sh stop || true
  [ "$mongo_was_running" = 1 ] || scripts/mongo.sh stop || true
  echo "demo stopped"
}
trap cleanup EXIT INT TERM

.venv/bin/python tools/demo_db.py setup
.venv/bin/python tools/demo_db.py workload "${CDC_DEMO_RATE:-200}" &
pids+=($!)
.venv/bin/python tools/demo_mongo.py setup
.venv/bin/python tools/demo_mongo.py workload "${CDC_DEMO_MONGO_RATE:-100}" &
pids+=($!)
echo "Dagster UI: http://127.0.0.1:$DAGSTER_PORT  (lake: $CDC_LAKE_ROOT)"
.venv/bin/dagster dev -w workspace.yaml -h 127.0.0.1 -p "$DAGSTER_PORT" &
pids+=($!)
wait "${pids[-1]}" || true
