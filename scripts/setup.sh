#!/usr/bin/env bash
# Install everything the project needs on a fresh machine (idempotent):
#   Debian packages (PostgreSQL 15 server, Java 17, Maven, and Chromium for the browser tests, which Playwright
#   drives: no browser is downloaded by Playwright) when missing, a Python 3.11 virtualenv in .venv with
#   the project and its dev extras from PyPI, the Delta JVM jars via Maven into the git-ignored .jars/, and the
#   MongoDB test server (jvm/mongo-test-server, built with Maven) with its dependencies into .jars/mongo-test-server/
#   (a folder of its own: Spark loads every jar directly in .jars/, and the test server's netty 4.2 must not be there),
#   then the Spark driver's class archive into .jars/spark-classes.jsa.
# EXTRAS (comma-separated) adds optional-dependency groups of pyproject.toml and their JVM jars: bench (.jars/bench/),
# s3 (moto for the tests; hadoop-aws and the ~558 MB AWS SDK bundle into .jars/s3/, for an s3a:// lake root).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

need_apt=()
[ -x /usr/lib/postgresql/15/bin/postgres ] || need_apt+=(postgresql-15 postgresql-client-15)
command -v java >/dev/null || need_apt+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null || need_apt+=(maven)
command -v chromium >/dev/null || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev${EXTRAS:+,$EXTRAS}]"

if [ ! -f .jars/.complete ] || [ jvm/pom.xml -nt .jars/.complete ]; then
  rm -rf .jars
  (cd jvm && mvn -q -B dependency:copy-dependencies -DoutputDirectory=../.jars -DincludeScope=runtime)
  touch .jars/.complete
fi
MTS=jvm/mongo-test-server
if [ ! -f .jars/mongo-test-server/.complete ] \
  || [ -n "$(find "$MTS/pom.xml" "$MTS/src" -newer .jars/mongo-test-server/.complete -print -quit)" ]; then
  rm -rf .jars/mongo-test-server
  (cd "$MTS" && mvn -q -B package dependency:copy-dependencies \
    -DoutputDirectory=../../.jars/mongo-test-server -DincludeScope=runtime)
  cp "$MTS/target/mongo-test-server.jar" .jars/mongo-test-server/
  touch .jars/mongo-test-server/.complete
fi
# the benchmarks' own jars (bench.snapshot's spark_jdbc tool), only with the bench extra
if [[ ",${EXTRAS:-}," == *",bench,"* ]] \
  && { [ ! -f .jars/bench/.complete ] || [ jvm/bench/pom.xml -nt .jars/bench/.complete ]; }; then
  rm -rf .jars/bench
  (cd jvm/bench && mvn -q -B dependency:copy-dependencies -DoutputDirectory=../../.jars/bench -DincludeScope=runtime)
  touch .jars/bench/.complete
fi
# the s3a file system's jars (hadoop-aws, the AWS SDK bundle: ~558 MB) for an s3a:// lake root, only with the s3
# extra (scripts/test.sh asks for it); spark_session adds them to Spark's classpath only for such a lake root
if [[ ",${EXTRAS:-}," == *",s3,"* ]] \
  && { [ ! -f .jars/s3/.complete ] || [ jvm/s3/pom.xml -nt .jars/s3/.complete ]; }; then
  rm -rf .jars/s3
  (cd jvm/s3 && mvn -q -B dependency:copy-dependencies -DoutputDirectory=../../.jars/s3 -DincludeScope=runtime)
  touch .jars/s3/.complete
fi
# the Spark driver's class archive (cdc_assets/lake/class_archive.py, built by build_class_archive.py: Spark's and
# Delta's classes parsed once, mapped by every driver after; about a minute to build), again when a jar on the
# driver's classpath or java is newer
.venv/bin/python -m cdc_assets.lake.build_class_archive --if-stale \
  || echo "warning: the Spark class archive was not built; drivers start without it (slower, nothing else)" >&2
echo "setup complete: .venv and .jars ready"
