"""Shared fixtures: services are started once per test session by the project's own scripts."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pymongo
import pytest

from tests.integration.mongo_support import REAL_MONGODB_URI_ENV, real_mongodb_uri, start_mongo_test_server
from tests.integration.s3_support import s3_server
from tests.integration.support import ABSENT_STANDBY, PG_PORT, PG_SOCKET
from tests.pipeline_support import FaultPoints, arm_faults
from tests.tools.torture_support import (
    BackgroundRun,
    ChainedRun,
    Run,
    start_broken_run,
    start_faulted_run,
    start_mongodb_run,
)

ROOT = Path(__file__).resolve().parents[1]
BROKEN_TORTURE_RUN = pytest.StashKey[Run]()
FAULTED_TORTURE_RUN = pytest.StashKey[BackgroundRun]()
MONGODB_TORTURE_RUN = pytest.StashKey[Run]()
# One run at a time, one after the other: in a suite run from a fresh clone two at once (faulted and broken, then
# MongoDB after broken) held the machine at 0 % idle for their 11 minutes, and the 25 minutes of tests after them
# ran at 30-40 % idle; one at a time they fill that idle time instead.
BACKGROUND_RUNS = {  # fixture -> (stash key, start, work dir, the run it follows when that one was started too)
    "faulted_torture_run": (FAULTED_TORTURE_RUN, start_faulted_run, ROOT / ".state" / "torture-faulted-run", None),
    "broken_torture_run": (
        BROKEN_TORTURE_RUN, start_broken_run, ROOT / ".state" / "torture-broken-run", FAULTED_TORTURE_RUN,
    ),
    "mongodb_torture_run": (
        MONGODB_TORTURE_RUN, start_mongodb_run, ROOT / ".state" / "torture-mongodb-run", BROKEN_TORTURE_RUN,
    ),
}  # fmt: skip
# the run started with the session's first test, beside the browser tests: they mostly wait for Dagster's daemons
# (sensor ticks, the backfill daemon's 30-second iterations, run monitoring), and left the machine 70 % idle for
# their 7 minutes (a suite run on 2026-11-29: 2-65 % busy per 10 s, the rest of the suite 95-99 %); one harness run
# (about 5.5 minutes) fills that instead of stretching the busy part. The others start after ``BEFORE_TORTURE_RUNS``.
EARLY_RUN = "faulted_torture_run"


# tests (paths under tests/) that run before the torture runs start (but ``EARLY_RUN``): they wait for other
# processes with timeouts and retries, which the torture runs' first minutes (three Spark drivers starting, every
# chunk snapshotted) stretched most: the browser tests' runs of ``dagster dev`` (the added-table test: 162 s alone,
# 343 s beside all three runs), then the consistency checks, which wait for a stream beside them (the drift test:
# 108 s alone, 433 s beside them once the runs started after the browser tests; that module took 717 s instead of
# 339). They run first (``pytest_collection_modifyitems``): in path order the unit tests under engine/ came between
# them, so the runs started there, beside the consistency checks (the drift test took 413 s in a suite run).
# The big-value stream tests come right after the browser tests, while the session's Spark driver is still nearly
# fresh, as a stream run's is (each run starts its own): their 2 GB transaction of 10 MB values fills most of the
# default heap, and at their place in path order, after most of the suite, the session's driver ran out of heap there
# in 3 fresh-clone and CI runs (46d6524, 6bf8447, f3ae802's CI; it passed in the others), and its death failed every
# later test; alone, the module always passed. The driver keeps more heap the longer it lives: sampled every minute
# after a full collection through a whole suite (2026-12-05), the smallest live heap per ten minutes was 81, 204,
# 589, 686 and 1,293 MB. What holds it was not found (class histograms: mostly long[] arrays, the form of Spark's
# on-heap memory pages, and retained query plans).
BEFORE_TORTURE_RUNS = ("browser/", "integration/test_stream_big_values.py", "integration/test_consistency.py")
TORTURE_RUNS_STARTED = pytest.StashKey[bool]()
EARLY_RUN_STARTED = pytest.StashKey[bool]()


def before_torture_rank(item: pytest.Item) -> int:
    """The place of the item's group in ``BEFORE_TORTURE_RUNS``; after all of them when it is in none."""
    path = Path(item.path).resolve().relative_to(ROOT / "tests").as_posix()
    return next((rank for rank, prefix in enumerate(BEFORE_TORTURE_RUNS) if path.startswith(prefix)),
                len(BEFORE_TORTURE_RUNS))  # fmt: skip


def runs_before_torture(item: pytest.Item) -> bool:
    return before_torture_rank(item) < len(BEFORE_TORTURE_RUNS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests under ``BEFORE_TORTURE_RUNS`` first, group by group in its order, then the others (in theirs)."""
    items.sort(key=before_torture_rank)  # stable: each group keeps its order


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures, which read the stash
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start the torture runs whose tests were selected (see ``tests/tools/torture_support.py``): ``EARLY_RUN`` at
    the session's first test, the others at the first test not under ``BEFORE_TORTURE_RUNS``, each once the run it
    follows has ended. They run beside the tests, in the background."""
    config = item.config
    if not config.stash.get(EARLY_RUN_STARTED, False):
        config.stash[EARLY_RUN_STARTED] = True
        start_background_runs(item, lambda fixture: fixture == EARLY_RUN)
    if config.stash.get(TORTURE_RUNS_STARTED, False) or runs_before_torture(item):
        return
    config.stash[TORTURE_RUNS_STARTED] = True
    start_background_runs(item, lambda fixture: fixture != EARLY_RUN)


def start_background_runs(item: pytest.Item, chosen: Callable[[str], bool]) -> None:
    """Start the ``chosen`` runs of ``BACKGROUND_RUNS`` that a selected test uses."""
    config = item.config
    for fixture, (key, start, work_dir, after) in BACKGROUND_RUNS.items():
        if not chosen(fixture) or not any(fixture in getattr(t, "fixturenames", ()) for t in item.session.items):
            continue
        before = config.stash.get(after, None) if after is not None else None
        if before is None:
            config.stash[key] = start(work_dir)
        else:  # started when ``before`` has ended (``ChainedRun``)
            config.stash[key] = ChainedRun(before, lambda start=start, work_dir=work_dir: start(work_dir))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for key, _, _, _ in reversed(BACKGROUND_RUNS.values()):  # a chained run first: stopped, it starts no more
        run = session.config.stash.get(key, None)
        if run is not None:
            run.stop()


@pytest.fixture(scope="session")
def broken_torture_run(request: pytest.FixtureRequest) -> Run:
    """The background ``--broken-reconciliation`` run (started once the faulted run ended, when that one runs too)."""
    return request.config.stash[BROKEN_TORTURE_RUN]


@pytest.fixture(scope="session")
def faulted_torture_run(request: pytest.FixtureRequest) -> BackgroundRun:
    """The background run with faults (started at the first test after ``BEFORE_TORTURE_RUNS``)."""
    return request.config.stash[FAULTED_TORTURE_RUN]


@pytest.fixture(scope="session")
def mongodb_torture_run(request: pytest.FixtureRequest) -> Run:
    """The background MongoDB run with faults (started once the broken-reconciliation run ended, when that one
    runs too)."""
    return request.config.stash[MONGODB_TORTURE_RUN]


@pytest.fixture()
def faults(monkeypatch: pytest.MonkeyPatch) -> FaultPoints:
    """The generic pipeline's fault points "kill" the run in the test's process (``tests/pipeline_support.py``)."""
    return arm_faults(monkeypatch)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[dict[str, str]]:
    """Start (or reuse) the project's private PostgreSQL cluster; never skip: a missing server is a failure.
    A cluster this session started is stopped at its end (one that was already running, e.g. the demo's, is left)."""
    pg = str(ROOT / "scripts" / "pg.sh")
    was_running = subprocess.run([pg, "status"], capture_output=True).returncode == 0
    subprocess.run([pg, "start"], check=True, capture_output=True, text=True)
    reset_absent_standby(f"host={PG_SOCKET} port={PG_PORT} user=postgres dbname=postgres")
    yield {"socket": PG_SOCKET, "port": str(PG_PORT)}
    if not was_running:
        subprocess.run([pg, "stop"], check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def mongo_server() -> Iterator[str]:
    """Start the MongoDB test server (mongo-java-server, oplog on; ``tests/integration/mongo_support.py``) on a free
    loopback port for this session and yield its connection string; stopped at the session's end. Never skips: a
    missing ``java`` or launcher jar is a failure."""
    server = start_mongo_test_server(ROOT / ".state" / "mongo-test-server")
    try:
        yield server.uri
    finally:
        server.stop()


@pytest.fixture()
def database_name(mongo_server: str) -> Iterator[str]:
    """A fresh MongoDB database name on the test server for one test; the database is dropped after it."""
    name = f"cdc_{uuid.uuid4().hex[:10]}"
    yield name
    with pymongo.MongoClient(mongo_server) as client:
        client.drop_database(name)


@pytest.fixture(scope="session")
def real_mongodb() -> str:
    """The connection string of a real replica set from ``$CDC_TEST_MONGODB_URI``: the gated tests that use it skip
    (the one allowed skip) when it is not set."""
    uri = real_mongodb_uri()
    if uri is None:
        pytest.skip(f"{REAL_MONGODB_URI_ENV} is not set: no real MongoDB replica set to run against")
    return uri


def reset_absent_standby(admin_dsn: str) -> None:
    """A test run killed inside ``commit_held_by_absent_standby`` leaves ``synchronous_standby_names`` set in
    ``postgresql.auto.conf``; every later commit would wait for that standby forever. Undo it (only that value)."""
    with psycopg.connect(admin_dsn, autocommit=True) as root:
        (names,) = root.execute("select current_setting('synchronous_standby_names')").fetchone()
        if names == ABSENT_STANDBY:
            root.execute("alter system reset synchronous_standby_names")
            root.execute("select pg_reload_conf()")


@pytest.fixture(scope="session")
def s3_lake() -> Iterator[str]:
    """An ``s3a://<bucket>/<unique prefix>`` lake root on an S3-compatible server (moto's, ``moto[server]`` from the
    ``s3`` extra) on a free loopback port, for the whole test session (``tests/integration/s3_support.py``): while it
    runs, ``AWS_ENDPOINT_URL``, dummy credentials and ``AWS_REGION`` are set in ``os.environ`` (restored after).
    One root for the session's tests: each works in a folder of its own under it.
    A JVM copies the environment when it starts and never sees later changes: a Spark session that reaches this store
    through s3a (credentials from the provider chain's environment variables) must be started after this fixture; the
    ``spark`` fixture is, when a selected test uses this one. Never skips: a missing ``moto`` is a failure."""
    bucket = "cdc-lake-test"
    with s3_server(bucket):
        yield f"s3a://{bucket}/lake-{uuid.uuid4().hex[:10]}"


def uses_s3_lake(session: pytest.Session) -> bool:
    """Whether a selected test uses the ``s3_lake`` fixture."""
    return any("s3_lake" in getattr(item, "fixturenames", ()) for item in session.items)


@pytest.fixture(scope="session")
def spark(request: pytest.FixtureRequest):
    """One local Spark session with Delta for the whole test session. When a selected test uses ``s3_lake``, the
    session is started inside it, for that lake root: with the s3a jars (``.jars/s3/``: they cannot be added to a
    running JVM, and the ~558 MB AWS SDK bundle adds seconds to the start, so only then) and the S3 server's
    environment (its credentials reach the driver JVM only at its start)."""
    from cdc_assets.config import SparkConfig
    from cdc_assets.lake.spark import driver_exit_code, spark_session

    lake_root = request.getfixturevalue("s3_lake") if uses_s3_lake(request.session) else None
    session = spark_session(SparkConfig(master="local[2]"), lake_root)
    yield session
    if driver_exit_code() is None:  # one driver per process: the session's
        session.stop()


SPARK_DRIVER_DEATH = pytest.StashKey[str]()


def memory_holders(count: int = 6) -> str:
    """The machine's used memory and its largest processes by resident memory, for a failure message."""
    import psutil

    rows = []
    for process in psutil.process_iter(["pid", "name", "memory_info", "cmdline"]):
        info = process.info
        if info["memory_info"] is not None:
            rows.append((info["memory_info"].rss, info["pid"], " ".join(info["cmdline"] or [info["name"] or ""])[:80]))
    rows.sort(reverse=True)
    used = psutil.virtual_memory()
    listed = "; ".join(f"{rss / 2**20:.0f} MB pid {pid} {command}" for rss, pid, command in rows[:count])
    return f"used {used.used / 2**20:.0f} of {used.total / 2**20:.0f} MB; largest: {listed}"


@pytest.fixture(autouse=True)
def spark_driver_outlives_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that uses ``spark`` fails at its set-up, naming the test in which the session's driver JVM died, when
    it died before (instead of py4j's "connection refused" from inside the test); the test in which it dies gets an
    error at its teardown that says so, with the JVM's exit code (-9: SIGKILL, which is what the kernel's OOM killer
    sends; 52: Spark's own exit on ``java.lang.OutOfMemoryError``) and what held the machine's memory then."""
    if "spark" not in request.fixturenames:
        yield
        return
    died = request.config.stash.get(SPARK_DRIVER_DEATH, None)
    if died is not None:
        pytest.fail(f"the session's Spark driver JVM died before this test: {died}", pytrace=False)
    from cdc_assets.lake.spark import driver_exit_code

    request.getfixturevalue("spark")
    yield
    code = driver_exit_code()  # the session's driver: one per process
    if code is not None:
        died = f"during {request.node.nodeid}, exit code {code} ({memory_holders()})"
        request.config.stash[SPARK_DRIVER_DEATH] = died
        pytest.fail(f"the session's Spark driver JVM died {died}", pytrace=False)
