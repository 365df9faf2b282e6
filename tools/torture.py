"""Torture harness (issue #3): random workloads, crashes and restarts against the real pipeline, then exact checks.

    python tools/torture.py --seeds 1-5 --duration 60 [--broken-reconciliation]

Contract
--------
This module is the runner; the source database's side (server, seeded schema, workload, schema events, checks
against the source's own log) comes from a ``TortureSource`` (``tools/torture_source.py``) of the source's kind:
``tools/torture_postgres.py`` for ``--source postgres``, ``tools/torture_mongodb.py`` for ``--source mongodb``. The
runner drives the pipeline only
through ``cdc_assets.source.CdcSource`` (``prepare``, ``plan``, ``snapshot``, ``stream_batch``, ``acknowledge``),
so it drives any source that ``open_source`` returns.

For each seed (every random choice comes from ``random.Random`` streams derived from the seed; thread timing is not
deterministic, so a seed fixes the workload's recipe, not its exact interleaving):

1. **Source.** ``TortureSource.create`` makes the seed's database (PostgreSQL: ``torture_<seed>``, four tables of
   every supported column type, a read-only role, the publication, the pipeline's slot and an oracle slot).
2. **Workload.** The source's workload threads (PostgreSQL: inserts, updates, deletes, primary-key updates,
   delete-then-reinsert, savepoints, multi-row updates, TOAST changes, long transactions spanning many chunk
   windows) run ``--duration`` seconds, at least until every chunk was snapshotted once and at least until
   ``--min-transactions`` write transactions were committed (so a seed's amount of work does not depend on how fast
   the machine snapshots: on a fast one the chunks were done after 214 transactions, on another after 810); the
   source's schema events (PostgreSQL: ``ALTER TABLE ADD COLUMN`` twice, ``TRUNCATE``) happen at seeded points of it.
3. **Pipeline.** Worker subprocesses (``--worker``, one Spark driver each, ``local[2,4]``, kept across runs and
   seeds like a long-lived Spark session; a killed one is replaced by a new process): ``--snapshot-workers``
   processes snapshot all chunks in parallel (groups of 1-3 chunks per run, then random re-snapshots while the
   workload lasts) while one stream process runs batches back to back: ``stream_batch``, the harness records the
   offset, then the worker acknowledges it (the slot moves, as the Dagster stream asset does); after every 4th
   batch it runs the lake upkeep (``maintain_lake``: staged attempts dropped, compaction; after every 8th also
   vacuum; not with ``--broken-reconciliation``). Every run builds a fresh ``CdcSource`` (``open_source``) and
   calls ``prepare()``, as a Dagster run would. The stream worker writes every mirror as a big one: new keys above
   the mirror's appended, then two statements, replaced rows marked in deletion vectors (``apply_changes``' path
   for mirrors of ``TWO_STATEMENTS_FROM_BYTES`` or more; the harness's are smaller).
4. **Faults** (unless ``--no-faults``): workers run with ``CDC_FAULTS`` / ``CDC_FAULT_PROBABILITY`` /
   ``CDC_FAULT_SEED`` (every point of ``cdc_assets.engine.faults.POINTS``: snapshot workers its ``snapshot.*``
   ones, the stream worker its ``stream.*`` ones), so they are SIGKILLed at those points; a killed or failed run is
   re-run (as Dagster's retry policy would, up to 8 attempts). A **run kill**: a busy chunk run
   (twice per seed) and the stream run
   (once) are SIGKILLed 0.3-6 s into their work, wherever that is: a chunk run anywhere from opening its source to
   recording its windows (so also inside its read-and-stage Spark job: some staged files written, window not recorded),
   the stream run anywhere from its slot read to its slot advance. An **executor loss**: a Spark Python worker process
   of a snapshot worker is SIGKILLed while a chunk read runs (Spark retries the task, which rewrites its staged file, or
   the run fails and is re-run). A **source restart** (``TortureSource.restart``; PostgreSQL: ``scripts/pg.sh restart``)
   once mid-run (writers reconnect; runs fail and are re-run), for a source whose ``restart_fault`` is not None
   (MongoDB's test server is in memory: a restart would lose everything).
5. **Checks**, after the workload stopped and the stream caught up (no waiting window, no change, lag 0): the
   source's ``verify`` in the stream worker (every mirror equals its source row by row and column by column, no
   ``_cdc_unknown``, no duplicate and no gap in the changelog against the source's own log: PostgreSQL's
   ``test_decoding`` oracle slot), then the source's log against the workload's own count of committed changes
   per table (acknowledged <= decoded <= acknowledged + in doubt, where "in doubt" are commits whose
   acknowledgement was lost in the restart).

Progress lines go to ``<work-dir>/logs/harness.log`` (and stderr with ``--verbose``), worker output to
``<work-dir>/logs/<worker>.log``.

**Patches for bugs the harness found.** ``apply_patches`` replaces a production function by its proposed fix in the
workers, only while the production source still contains the faulty construct (so a fixed pipeline runs
unpatched); the PASS line lists the patches that were active (``patched=...``); ``--unpatched`` disables them.

Output: one line per seed, ``seed 3: PASS 41s chunks=.. windows=.. changes=.. faults=.. (..)`` or
``seed 3: FAIL <first failure>`` (for a row: the table, the first differing key and both values), then
``N passed, N failed``. Exit status 0 when every seed passed, 1 otherwise. A passing seed's database and lake are
dropped; a failing seed's are kept for inspection (``--drop-failed`` drops them too).

``--broken-reconciliation`` makes the stream workers (the runs that reconcile) replace the source's settled rule by
"every transaction is settled" inside their own process (``TortureSource.break_settled_rule``; production code is
unchanged). The checks must then fail: that shows the harness can fail.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cdc_assets.config import SparkConfig  # noqa: E402
from cdc_assets.engine.faults import POINTS  # noqa: E402
from tools.torture_source import (  # noqa: E402
    WORKER_MASTER,
    SeedSource,
    Tally,
    TortureSource,
    WorkloadContext,
    log,
    log_to,
)

SOURCE_KINDS = ("postgres", "mongodb")
# every named point that kills the process: snapshot workers fire the snapshot ones, the stream worker the others
SNAPSHOT_POINTS = tuple(point for point in POINTS if point.startswith("snapshot."))
STREAM_POINTS = tuple(point for point in POINTS if point.startswith("stream."))
# SIGKILLs at a random moment of a busy run, per seed: chunk runs, stream runs
RUN_KILLS = {"snapshot.killed_at_random": 2, "stream.killed_at_random": 1}
# the stream worker compacts after every 4th batch and also vacuums after every 8th (production: at most every
# stream.compact_seconds and stream.vacuum_seconds)
COMPACT_EVERY, VACUUM_EVERY = 4, 8
TASK_ATTEMPTS = 8


def source_kind(kind: str) -> type[TortureSource]:
    """The ``TortureSource`` class of a source kind (imported only when used: its driver module comes with it)."""
    if kind == "postgres":
        from tools.torture_postgres import PostgresTorture

        return PostgresTorture
    if kind == "mongodb":
        from tools.torture_mongodb import MongoTorture

        return MongoTorture
    raise ValueError(f"source kind {kind!r} has no torture side; allowed: {', '.join(SOURCE_KINDS)}")


# ----------------------------------------------------------------------------------------------------------------
# Workers: one Spark driver per process; tasks as JSON lines on stdin, results on a private pipe
WORKER_DRIVER_MEMORY = "2g"


def _emit(channel: IO[str], message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def warm_up(spark: Any) -> None:
    """Load Delta and start Spark's Python workers once, so that a run is not slowed by a cold driver."""
    from delta.tables import DeltaTable

    with tempfile.TemporaryDirectory(prefix="torture-warm-") as folder:
        frame = spark.range(20).selectExpr("id", "cast(id as string) as v")
        frame.write.format("delta").save(f"{folder}/t")
        target = DeltaTable.forPath(spark, f"{folder}/t").alias("t")
        target.merge(frame.alias("s"), "t.id = s.id").whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
        spark.read.format("delta").load(f"{folder}/t").mapInArrow(lambda batches: batches, frame.schema).count()


def apply_patches() -> list[str]:
    """Replace production functions that still contain a bug the harness found by their proposed fix. Each patch
    applies only while the production source still has the faulty construct, so a fixed pipeline runs unpatched."""
    # The two bugs found so far (windows.read_events probing with isDeltaTable, pipeline._fill_unknown going
    # through to_pandas) are fixed in the pipeline itself; no patch is open.
    applied: list[str] = []
    return applied


def worker_main(role: str, kind: str, result_fd: int, broken: bool, patched: bool) -> int:
    """A long-lived worker: each task is one Dagster-like run with a fresh pipeline (``prepare()``)."""
    import cdc_assets.lake.adopt as adopt_module
    import cdc_assets.lake.maintenance as maintenance_module
    import cdc_assets.lake.mirror as mirror_module
    import cdc_assets.lake.watermark_window as window_module
    import cdc_assets.pipeline as pipeline_module
    from cdc_assets.engine import faults
    from cdc_assets.lake.spark import SHORT_LIVED_DRIVER_OPTIONS, spark_session
    from cdc_assets.sources import open_source

    channel = os.fdopen(result_fd, "w")
    original = faults.fault_point

    def traced(name: str) -> None:  # the harness learns which point a SIGKILL came from
        _emit(channel, {"point": name})
        original(name)

    # every module that calls a fault point (each imported the function by name)
    for module in (pipeline_module, window_module, maintenance_module, adopt_module, mirror_module):
        module.fault_point = traced  # type: ignore[attr-defined]
    # every mirror takes its batches as one of 256 MB or more (the harness's are a few MB): new keys appended, then
    # two statements, so the kills between them (``stream.between_append_and_merge``,
    # ``stream.between_mirror_merges``) are exercised, and deletion vectors rather than rewritten files
    mirror_module.TWO_STATEMENTS_FROM_BYTES = 0
    mirror_module.REWRITE_FILES_BELOW_BYTES = 0
    patches = apply_patches() if patched else []
    torture = source_kind(kind)
    if broken and role == "stream":
        torture.break_settled_rule()
    # short-lived drivers (killed at random); its own collector replaces the default's: the JVM refuses two. A heap
    # of ``WORKER_DRIVER_MEMORY``, not the default quarter of the machine: the harness's data is a few MB, and its
    # three drivers run beside a whole test suite whose own driver needs its default heap (the big-values tests)
    conf = {"spark.driver.extraJavaOptions": SHORT_LIVED_DRIVER_OPTIONS, "spark.driver.memory": WORKER_DRIVER_MEMORY}
    spark = spark_session(SparkConfig(master=WORKER_MASTER, conf=conf))
    warm_up(spark)
    _emit(channel, {"ready": True, "patches": patches})
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        task = json.loads(line)
        try:
            config = torture.build_config(task["source"])
            pipeline = open_source(config, config.sources[0])
            tables = pipeline.prepare() if task["op"] != "verify" else {}
            if task["op"] == "snapshot":
                report = pipeline.snapshot(spark, tables[task["table"]], task["chunks"], task["run"])
                _emit(channel, {"ok": True, "rows": report.rows, "hw": report.hw})
            elif task["op"] == "verify":
                _emit(channel, {"ok": True, **torture.verify(spark, task["source"], task["check"])})
            elif task["op"] == "stream":
                batch = pipeline.stream_batch(spark, task["recorded"], task["run"])
                position = torture.offset_position(batch.offset)
                _emit(channel, {"ok": True, "offset": batch.offset, "position": position, "changes": batch.changes,
                                "lag": batch.lag_bytes,
                                "waiting": batch.waiting_windows, "reconciled": len(batch.reconciled),
                                "phases": batch.phase_seconds})  # fmt: skip
                if json.loads(sys.stdin.readline() or "{}").get("op") != "ack":
                    return 0
                traced("stream.after_offset_record")  # offset recorded by the harness; now the slot may follow
                pipeline.acknowledge(batch.offset)
                if task.get("upkeep"):  # between batches, as the Dagster stream run does
                    maintenance_module.maintain_lake(spark, pipeline.lake, tables, 64 * 1024 * 1024, task["upkeep"])
                _emit(channel, {"ok": True, "advanced": position})
            else:
                raise ValueError(f"unknown task {task['op']!r}")
        except Exception as error:
            text = f"{type(error).__name__}: {error}".strip().replace("\n", " ")
            _emit(channel, {"ok": False, "error": text[:600]})


class WorkerDied(RuntimeError):
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class TaskFailed(RuntimeError):
    pass


class Proc:
    """One worker process: a Spark driver, warmed up, answering tasks (see ``worker_main``)."""

    def __init__(self, role: str, number: int, options: Options, log_dir: Path) -> None:
        self.role = role
        self.name = f"{role}-{number}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for name in ("CDC_FAULTS", "CDC_FAULT_PROBABILITY", "CDC_FAULT_SEED"):
            env.pop(name, None)
        probability = options.snapshot_fault_p if role == "snapshot" else options.stream_fault_p
        if options.faults and probability > 0:
            env["CDC_FAULTS"] = ",".join(SNAPSHOT_POINTS if role == "snapshot" else STREAM_POINTS)
            env["CDC_FAULT_PROBABILITY"] = str(probability)
            env["CDC_FAULT_SEED"] = f"{options.run_seed}-{self.name}"
        read_end, write_end = os.pipe()
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", role, "--source", options.source,
                   "--result-fd", str(write_end)]  # fmt: skip
        if options.broken:
            command.append("--broken-reconciliation")
        if not options.patched:
            command.append("--unpatched")
        with open(log_dir / f"{self.name}.log", "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=log, env=env, cwd=ROOT, pass_fds=(write_end,),
                start_new_session=True,
            )  # fmt: skip
        os.close(write_end)
        self.channel = os.fdopen(read_end, "r")
        self.last_point: str | None = None
        self.dead = False

    def wait_ready(self) -> None:
        message = self.receive(timeout=600)
        if not message.get("ready"):
            raise WorkerDied(f"worker did not start: {message}")
        self.patches: list[str] = message.get("patches", [])

    def receive(self, timeout: float) -> dict[str, Any]:
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self.kill()

        watchdog = threading.Timer(timeout, expire)
        watchdog.start()
        try:
            while True:
                line = self.channel.readline()
                if not line:
                    rc = self.process.wait()
                    self.kill()
                    self.channel.close()
                    cause = f"exit {rc}"
                    if expired.is_set():
                        cause = f"no answer in {timeout:.0f}s"
                    elif rc == -signal.SIGKILL and self.last_point:
                        cause = self.last_point
                    raise WorkerDied(cause)
                message = json.loads(line)
                if "point" in message:
                    self.last_point = message["point"]
                    continue
                return message
        finally:
            watchdog.cancel()

    def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except (OSError, ValueError):  # ValueError: stdin already closed by ``stop`` (the command is ending)
            pass  # the death shows on the result channel

    def kill(self) -> None:
        """SIGKILL the worker's own session (the worker, its JVM, Spark's Python workers)."""
        self.dead = True
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()

    def stop(self) -> None:
        if self.dead:
            return
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        self.channel.close()

    def python_workers(self) -> list[psutil.Process]:
        """Spark's Python worker processes (forked by ``pyspark.daemon``) under this worker's driver."""
        found = []
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            return []
        for child in children:
            try:  # zombies and processes that just ended raise
                parent = child.parent()
                if (
                    parent is not None
                    and "pyspark.daemon" in " ".join(child.cmdline())
                    and "pyspark.daemon" in " ".join(parent.cmdline())
                ):
                    found.append(child)
            except psutil.Error:
                continue
        return found


class Worker:
    """A worker slot: runs one task at a time in a process; a killed process is replaced by a fresh one (as a
    Dagster retry runs in a new process)."""

    def __init__(self, name: str, role: str, pool: WorkerPool) -> None:
        self.name = name
        self.role = role
        self.pool = pool
        self.proc: Proc | None = None
        self.busy_since: float | None = None

    def call(self, task: dict[str, Any], on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Run one task; ``on_result`` (stream) records the offset before the worker may advance the slot."""
        if self.proc is None or self.proc.dead:
            self.proc = self.pool.take(self.role)
        proc = self.proc
        proc.last_point = None
        self.busy_since = time.monotonic()
        try:
            proc.send(task)
            result = proc.receive(timeout=self.pool.options.task_timeout)
            if not result.get("ok"):
                raise TaskFailed(result.get("error", "unknown error"))
            if on_result is not None:
                on_result(result)
                proc.send({"op": "ack"})
                advanced = proc.receive(timeout=self.pool.options.task_timeout)
                if not advanced.get("ok"):
                    raise TaskFailed(advanced.get("error", "unknown error"))
            return result
        finally:
            self.busy_since = None

    def python_workers(self) -> list[psutil.Process]:
        proc = self.proc
        return [] if proc is None or proc.dead else proc.python_workers()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None


class WorkerPool:
    """The worker slots: ``--snapshot-workers`` snapshot slots and one stream slot (kept across seeds)."""

    def __init__(self, options: Options, log_dir: Path) -> None:
        self.options = options
        self.log_dir = log_dir
        self.snapshots = [Worker(f"snapshot{i}", "snapshot", self) for i in range(options.snapshot_workers)]
        self.stream = Worker("stream", "stream", self)
        self.lock = threading.Lock()
        self.numbers: Counter[str] = Counter()
        self.patches: set[str] = set()

    def _new(self, role: str) -> Proc:
        with self.lock:
            self.numbers[role] += 1
            return Proc(role, self.numbers[role], self.options, self.log_dir)

    def take(self, role: str) -> Proc:
        """A new, ready process for ``role`` (a new Dagster run process after a kill)."""
        proc = self._new(role)
        proc.wait_ready()
        self.patches.update(proc.patches)
        return proc

    def start(self) -> None:
        workers = [*self.snapshots, self.stream]
        procs = [self._new(w.role) for w in workers]
        for worker, proc in zip(workers, procs, strict=True):
            proc.wait_ready()
            self.patches.update(proc.patches)
            worker.proc = proc

    def stop(self) -> None:
        for worker in [*self.snapshots, self.stream]:
            worker.stop()


# ----------------------------------------------------------------------------------------------------------------
# One seed


@dataclass
class Options:
    source: str
    duration: float
    min_transactions: int
    broken: bool
    faults: bool
    snapshot_workers: int
    scale: float
    rate: float
    writers: int
    chunk_size: int
    snapshot_fault_p: float
    stream_fault_p: float
    task_timeout: float
    catch_up_timeout: float
    work_dir: Path
    drop_failed: bool
    run_seed: str
    patched: bool


def workload_done(
    elapsed: float, duration: float, initial_runs_left: int, transactions: int, min_transactions: int
) -> bool:
    """Contract: a seed's workload stops once it lasted ``duration`` seconds, every chunk was snapshotted once (no
    initial snapshot run left) and at least ``min_transactions`` write transactions were committed; all three."""
    return elapsed >= duration and initial_runs_left <= 0 and transactions >= min_transactions


@dataclass
class SeedResult:
    seed: int
    passed: bool
    seconds: float
    message: str


class SeedRun:
    def __init__(self, seed: int, options: Options, source: TortureSource, pool: WorkerPool) -> None:
        self.seed = seed
        self.options = options
        self.source = source
        self.pool = pool
        self.lake = options.work_dir / f"lake-{seed}"
        self.seed_source: SeedSource | None = None  # made by run()
        self.faults: Counter[str] = Counter()
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.windows = 0
        self.initial_left = 0
        self.stop_snapshots = threading.Event()
        self.catch_up = threading.Event()
        self.caught_up = threading.Event()
        self.failure: str | None = None
        self.recorded: dict[str, Any] | None = None
        self.batches = 0
        self.ctx = WorkloadContext(Tally())

    @property
    def spec(self) -> dict[str, Any]:
        """The seed's source spec, which every task carries (the workers build the pipeline's config from it)."""
        if self.seed_source is None:
            raise RuntimeError(f"seed {self.seed}: no source yet (run() creates it)")
        return self.seed_source.spec

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = message

    def note_fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] += 1

    def run_task(self, worker: Worker, task: dict[str, Any], on_result: Callable[[dict[str, Any]], None] | None = None
                 ) -> dict[str, Any] | None:  # fmt: skip
        """Run a task like a Dagster run with a retry policy: a killed or failed run is re-run."""
        brief = {k: v for k, v in task.items() if k != "source"}
        for attempt in range(1, TASK_ATTEMPTS + 1):
            began = time.monotonic()
            try:
                result = worker.call({**task, "run": f"{task['run']}-a{attempt}"}, on_result)
                log(f"seed {self.seed} {worker.name}: {brief} -> {result} in {time.monotonic() - began:.1f}s")
                return result
            except WorkerDied as death:
                log(
                    f"seed {self.seed} {worker.name}: {brief} died ({death.cause}) "
                    f"after {time.monotonic() - began:.1f}s"
                )
                injected = death.cause in (*SNAPSHOT_POINTS, *STREAM_POINTS, *RUN_KILLS)
                self.note_fault(death.cause if injected else "crash")
                if not injected:
                    self.errors.append(f"{worker.name}: died ({death.cause})")
            except TaskFailed as error:
                log(f"seed {self.seed} {worker.name}: {brief} failed after {time.monotonic() - began:.1f}s: {error}")
                self.errors.append(f"{worker.name}: {error}")
                time.sleep(min(10.0, 0.5 * 2**attempt))
        self.fail(f"{task['op']} run {task['run']} failed {TASK_ATTEMPTS} times; last error: {self.errors[-1]}")
        return None

    # -- pipeline loops ----------------------------------------------------------------------------------------
    def upkeep_steps(self) -> list[str]:
        """The upkeep steps after the batch about to run; none in a run that must fail on its broken rule (it
        gains nothing from them, and they cost it about a minute per call)."""
        if self.options.broken:
            return []
        due = {"compact": COMPACT_EVERY, "vacuum": VACUUM_EVERY}
        return [step for step, every in due.items() if self.batches % every == every - 1]

    def stream_loop(self) -> None:
        worker = self.pool.stream
        started_catch_up: float | None = None
        while self.failure is None:
            if self.catch_up.is_set() and started_catch_up is None:
                started_catch_up = time.monotonic()

            def record(result: dict[str, Any]) -> None:
                self.recorded = dict(result["offset"])  # "materialization metadata": then the slot may follow

            result = self.run_task(
                worker,
                {"op": "stream", "source": self.spec, "recorded": self.recorded, "run": f"b{self.batches}",
                 "upkeep": self.upkeep_steps()},
                record,
            )  # fmt: skip
            self.batches += 1
            if result is None:
                return
            if started_catch_up is not None:
                done = result["changes"] == 0 and result["waiting"] == 0 and result["lag"] == 0
                if done:
                    self.caught_up.set()
                    return
                if time.monotonic() - started_catch_up > self.options.catch_up_timeout:
                    self.fail(f"stream did not catch up in {self.options.catch_up_timeout:.0f}s: last batch {result}")
                    return
                time.sleep(0.3)

    def snapshot_loop(self, worker: Worker, tasks: queue.Queue[tuple[str, list[int], bool]],
                      plans: dict[str, int], r: random.Random) -> None:  # fmt: skip
        while self.failure is None:
            try:
                name, chunks, initial = tasks.get_nowait()
            except queue.Empty:
                if self.stop_snapshots.is_set():
                    return
                name = r.choice(sorted(plans))  # re-materialize a random partition while the workload runs
                start = r.randrange(plans[name])
                chunks, initial = list(range(start, min(plans[name], start + r.randint(1, 2)))), False
            task = {"op": "snapshot", "source": self.spec, "table": name, "chunks": chunks,
                    "run": f"{worker.name}-{name}-{chunks[0]}"}  # fmt: skip
            if self.run_task(worker, task) is None:
                return
            with self.lock:
                self.windows += len(chunks)
                if initial:
                    self.initial_left -= 1

    def chaos(self, seed_source: SeedSource, r: random.Random, duration: float) -> None:
        """Scheduled events: the source's schema events, a source restart, executor losses, run kills."""
        started = time.monotonic()
        events = seed_source.schema_events(r)
        kills = random.Random(f"{self.seed}:kills")  # its own stream: the other events keep their seeded times
        if self.options.faults:
            if self.source.restart_fault is not None:  # a source that can restart without losing its data
                events.append((r.uniform(0.45, 0.65), "restart"))
            events += [(r.uniform(0.05, 0.9), "executor") for _ in range(3)]
            events += [(kills.uniform(0.05, 0.9), kind) for kind, count in RUN_KILLS.items() for _ in range(count)]
        events.sort()
        try:
            for at, event in events:
                while time.monotonic() - started < at * duration:
                    if self.ctx.stop.is_set():
                        return
                    time.sleep(0.2)
                log(f"seed {self.seed} event {event}")
                if event == "restart":
                    self.source.restart()
                    self.note_fault(str(self.source.restart_fault))
                elif event == "executor":
                    self.lose_executor(r)
                elif event in RUN_KILLS:
                    self.kill_run(event, kills)
                else:
                    seed_source.run_event(event, self.ctx, r)
        except BaseException:
            self.ctx.fatal(f"events: {traceback.format_exc(limit=3)}")

    def lose_executor(self, r: random.Random) -> None:
        """SIGKILL a Spark Python worker of a busy snapshot worker (a lost executor during a chunk read)."""
        while not self.ctx.stop.is_set():  # until a chunk run is busy and has a Spark Python worker
            busy = [w for w in self.pool.snapshots if w.busy_since is not None]
            if busy:
                worker = r.choice(busy)
                time.sleep(r.uniform(0.2, 1.5))  # somewhere inside the run, ideally inside the chunk read
                victims = worker.python_workers()
                if victims:
                    try:
                        r.choice(victims).send_signal(signal.SIGKILL)
                        self.note_fault("executor")
                        return
                    except psutil.Error:
                        pass
            time.sleep(0.3)

    def kill_run(self, kind: str, r: random.Random) -> None:
        """SIGKILL a busy run of ``kind``'s role (``snapshot`` or ``stream``) 0.3-6 s into its work; the run is re-run
        (``run_task``) and the death counted as ``kind``. A run that ends before the kill is spared and the next
        busy one is chosen."""
        candidates = self.pool.snapshots if kind.startswith("snapshot.") else [self.pool.stream]
        while not self.ctx.stop.is_set():
            busy = [(w, w.busy_since) for w in candidates if w.busy_since is not None]
            if busy:
                worker, began = r.choice(busy)
                time.sleep(r.uniform(0.3, 6.0))
                proc = worker.proc
                if worker.busy_since == began and proc is not None and not proc.dead:
                    proc.last_point = kind  # the cause ``receive`` reports for this SIGKILL
                    proc.kill()
                    return
            time.sleep(0.3)

    # -- the seed ----------------------------------------------------------------------------------------------
    def run(self) -> SeedResult:
        started = time.monotonic()
        r = random.Random(self.seed)
        shutil.rmtree(self.lake, ignore_errors=True)
        seed_source = self.source.create(self.seed, r, self.options.scale, self.lake, self.options.chunk_size)
        self.seed_source = seed_source
        plans = self.plan_chunks(seed_source)
        tasks: queue.Queue[tuple[str, list[int], bool]] = queue.Queue()
        groups: list[tuple[str, list[int], bool]] = []
        for name, count in sorted(plans.items()):
            index = 0
            while index < count:
                size = r.randint(1, 3)
                groups.append((name, list(range(index, min(count, index + size))), True))
                index += size
        r.shuffle(groups)
        for group in groups:
            tasks.put(group)
        self.initial_left = len(groups)
        self.ctx = WorkloadContext(Tally())
        duration = self.options.duration
        threads = seed_source.workload(self.ctx, self.seed, duration, self.options.rate, self.options.writers)
        events = random.Random(f"{self.seed}:events")
        threads.append(threading.Thread(target=self.chaos, args=(seed_source, events, duration), daemon=True))
        for thread in threads:
            thread.start()
        stream = threading.Thread(target=self.stream_loop, daemon=True)
        stream.start()
        snapshots = [
            threading.Thread(
                target=self.snapshot_loop, args=(w, tasks, plans, random.Random(f"{self.seed}:{w.name}")), daemon=True
            )
            for w in self.pool.snapshots
        ]
        for thread in snapshots:
            thread.start()
        log(f"seed {self.seed}: plans {plans}, {len(groups)} initial snapshot runs, workload started")
        while self.failure is None and not self.ctx.errors:
            elapsed, transactions = time.monotonic() - started, self.ctx.tally.transactions
            if workload_done(elapsed, duration, self.initial_left, transactions, self.options.min_transactions):
                break
            time.sleep(0.5)
        self.ctx.stop.set()
        self.stop_snapshots.set()
        for thread in threads:
            thread.join(60)
        for thread in snapshots:
            thread.join(self.options.task_timeout * TASK_ATTEMPTS)
        self.catch_up.set()
        log(f"seed {self.seed}: workload stopped ({self.ctx.tally.transactions} transactions); catching up")
        stream.join(self.options.catch_up_timeout + self.options.task_timeout * TASK_ATTEMPTS)
        if self.ctx.errors:
            self.fail(f"workload error: {self.ctx.errors[0]}")
        if self.failure is None and not self.caught_up.is_set():
            self.fail("stream loop ended without catching up")
        summary = ""
        if self.failure is None:
            verdict = self.run_task(
                self.pool.stream,
                {"op": "verify", "source": self.spec, "check": seed_source.verify_args(), "run": "verify"},
            )  # fmt: skip
            if verdict is not None:
                failures = verdict["failures"] + self.check_tally(verdict["decoded"])
                if failures:
                    self.fail(failures[0])
            faults = " ".join(f"{k}={v}" for k, v in sorted(self.faults.items()))
            summary = (
                f"chunks={sum(plans.values())} windows={self.windows} batches={self.batches} "
                f"changes={verdict['changes'] if verdict else '?'} transactions={self.ctx.tally.transactions} "
                f"faults={sum(self.faults.values())}{f' ({faults})' if faults else ''} errors={len(self.errors)}"
            )
            if verdict is not None:
                summary += f" largest_value={verdict['largest_value']}"
            if self.pool.patches:
                summary += f" patched={','.join(sorted(self.pool.patches))}"
        seconds = time.monotonic() - started
        if self.failure is None:
            self.cleanup()
            return SeedResult(self.seed, True, seconds, summary)
        if self.options.drop_failed:
            self.cleanup()
        else:
            self.failure += f" [kept: {seed_source.name}, lake {self.lake}]"
        return SeedResult(self.seed, False, seconds, self.failure)

    def plan_chunks(self, seed_source: SeedSource) -> dict[str, int]:
        """Every table's chunk count, planned (and stored) once as the first Dagster run would, re-run when it fails
        (MongoDB's test server fails a ``$sample`` now and then)."""
        from cdc_assets.sources import open_source

        config = self.source.build_config(seed_source.spec)
        for attempt in range(1, TASK_ATTEMPTS + 1):
            try:
                pipeline = open_source(config, config.sources[0])
                return {name: len(pipeline.plan(table).chunks) for name, table in pipeline.prepare().items()}
            except Exception as error:
                if attempt == TASK_ATTEMPTS:
                    raise
                log(f"seed {self.seed}: planning failed: {type(error).__name__}: {str(error)[:300]}")
                self.errors.append(f"planning: {type(error).__name__}")
                time.sleep(min(10.0, 0.5 * 2**attempt))
        raise AssertionError("unreachable")

    def check_tally(self, decoded: dict[str, int]) -> list[str]:
        """The oracle against the workload's own count: acknowledged <= decoded <= acknowledged + in doubt."""
        failures = []
        tally = self.ctx.tally
        for name, count in sorted(decoded.items()):
            short = name.rsplit(".", 1)[-1]
            low, doubt = tally.committed[short], tally.in_doubt[short]
            if not low <= count <= low + doubt:
                failures.append(
                    f"table {name}: the source's own log reports {count} changes; the workload committed {low} "
                    f"(+{doubt} in doubt)"
                )
        return failures

    def cleanup(self) -> None:
        if self.seed_source is not None:
            self.seed_source.drop()
        shutil.rmtree(self.lake, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# Driver


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        seeds += list(range(int(low), int(high) + 1)) if high else [int(low)]
    return seeds


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The runner's options, then those of the chosen source kind (``TortureSource.add_arguments``)."""
    chosen = argparse.ArgumentParser(add_help=False)
    chosen.add_argument("--source", choices=SOURCE_KINDS, default="postgres")
    kind = chosen.parse_known_args(argv)[0].source
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seeds", default="1", help="seeds: '1-5', '3' or '1,4,9'")
    parser.add_argument("--source", choices=SOURCE_KINDS, default="postgres", help="the source database's kind")
    parser.add_argument("--duration", type=float, default=60, help="workload seconds per seed (at least)")
    parser.add_argument(
        "--min-transactions",
        type=int,
        default=0,
        help="the workload lasts at least until this many write transactions were committed",
    )
    parser.add_argument("--broken-reconciliation", action="store_true",
                        help="stream workers treat every transaction as settled: the checks must fail")  # fmt: skip
    parser.add_argument("--no-faults", action="store_true", help="no SIGKILLs, executor losses or restarts")
    parser.add_argument("--snapshot-workers", type=int, default=2)
    parser.add_argument("--scale", type=float, default=1.0, help="seeded rows (1.0: about 6000 rows, 30 chunks)")
    parser.add_argument("--rate", type=float, default=20, help="short write transactions per second (all writers)")
    parser.add_argument("--writers", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=300)
    parser.add_argument("--snapshot-fault-probability", type=float, default=0.2)
    parser.add_argument("--stream-fault-probability", type=float, default=0.04)
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".state" / "torture", help="lakes and worker logs")
    parser.add_argument("--verbose", action="store_true", help="progress lines on stderr")
    parser.add_argument("--unpatched", action="store_true",
                        help="run without the harness's patch for the window-log bug (fixed_read_events)")  # fmt: skip
    parser.add_argument("--drop-failed", action="store_true", help="drop a failing seed's database and lake too")
    parser.add_argument("--worker", choices=["snapshot", "stream"], help=argparse.SUPPRESS)
    parser.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    source_kind(kind).add_arguments(parser.add_argument_group(f"--source {kind}"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker_main(args.worker, args.source, args.result_fd, args.broken_reconciliation, not args.unpatched)
    options = Options(
        source=args.source,
        duration=args.duration,
        min_transactions=args.min_transactions,
        broken=args.broken_reconciliation,
        faults=not args.no_faults,
        snapshot_workers=args.snapshot_workers,
        scale=args.scale,
        rate=args.rate,
        writers=args.writers,
        chunk_size=args.chunk_size,
        snapshot_fault_p=args.snapshot_fault_probability,
        stream_fault_p=args.stream_fault_probability,
        task_timeout=600,
        catch_up_timeout=900,
        work_dir=args.work_dir.resolve(),
        drop_failed=args.drop_failed,
        run_seed=args.seeds,
        patched=not args.unpatched,
    )
    # SIGTERM (a test session ending early) runs the cleanup below: workers stopped, the cluster stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    server = source_kind(args.source).from_args(args)
    server_was_running = server.running()
    server.start()
    log_dir = options.work_dir / "logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_to(open(log_dir / "harness.log", "w"))
    if args.verbose:
        log_to(sys.stderr)
    pool = WorkerPool(options, log_dir)
    results: list[SeedResult] = []
    try:
        pool.start()
        for seed in parse_seeds(args.seeds):
            try:
                result = SeedRun(seed, options, server, pool).run()
            except Exception as error:
                result = SeedResult(seed, False, 0.0, f"harness error: {type(error).__name__}: {error}")
                traceback.print_exc()
            results.append(result)
            if result.passed:
                print(f"seed {seed}: PASS {result.seconds:.0f}s {result.message}", flush=True)
            else:
                print(f"seed {seed}: FAIL {result.message} ({result.seconds:.0f}s)", flush=True)
    finally:
        pool.stop()
        if not server_was_running:
            server.stop()  # leave nothing running that this command started
    passed = sum(r.passed for r in results)
    print(f"{passed} passed, {len(results) - passed} failed", flush=True)
    return 0 if results and passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
