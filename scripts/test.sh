#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit + integration against real services).
# pytest exits 5 when it ran no test: that is a failure here, like any other non-zero exit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/setup.sh
.venv/bin/ruff check cdc_assets tests
set +e
# two processes, a module's tests in one (tests/conftest.py: each has its own PostgreSQL cluster, MongoDB test server
# and Spark driver; the controller runs the torture harness's short forms beside them); modules in the order
# tests/conftest.py puts them in (xdist's default reorders them by their number of tests)
.venv/bin/python -m pytest tests -n "${CDC_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=10 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest ran no test: failing" >&2
  exit 1
fi
exit "$status"
