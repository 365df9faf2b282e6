#!/usr/bin/env bash
# Install everything, then run the whole test suite (unit + integration against real services).
# pytest exits 5 when it ran no test: that is a failure here, like any other non-zero exit.
# The s3 extra is installed too (moto, the s3a jars): the object store tests need it (the demo does not fetch it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="s3${EXTRAS:+,$EXTRAS}" scripts/setup.sh
.venv/bin/ruff check cdc_assets tests
set +e
.venv/bin/python -m pytest tests --durations=10 "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest ran no test: failing" >&2
  exit 1
fi
exit "$status"
