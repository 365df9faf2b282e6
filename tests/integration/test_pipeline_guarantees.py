"""Issue #2's guarantees on real PostgreSQL, Spark and Delta, through the pipeline's own operations.

- snapshot of every chunk under a concurrent writer (inserts, updates, deletes, primary-key updates, SAVEPOINT /
  ROLLBACK TO, TOAST values left unchanged, one transaction open across several chunk windows): exact mirrors and
  a changelog without duplicates;
- an idle table's chunk is reconciled without any write to the source, also when a second run stages the same
  chunk while a batch reconciles the first;
- a transaction in the low watermark's ``xip`` whose commit record is already in the WAL (held by a synchronous
  standby) is applied by the stream and not overwritten by the read that could not see it;
- runs killed (SIGKILL) before a window is recorded and after the lake commit but before the offset is recorded:
  the rerun is exact and appends nothing twice;
- a 200k-change transaction streams through batches bounded by change count with bounded driver memory.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import psycopg
import pytest
from pyspark.sql import functions as F

from cdc_assets.config import CdcConfig
from cdc_assets.dialect import Offset
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.delta_tables import table_or_none
from cdc_assets.source import StreamReport
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from cdc_assets.sources.postgres.stream import current_flush_lsn, slot_position
from tests.integration.support import (
    commit_held_by_absent_standby,
    mirror_rows,
    pipeline_config,
    seeded_source,
    source_rows,
)
from tests.pipeline_support import Killed

ROOT = Path(__file__).resolve().parents[2]
DATABASE = "pipe_guarantees"


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path):
    with seeded_source(postgres_server, DATABASE) as (admin, admin_dsn):
        yield admin, admin_dsn, pipeline_config(DATABASE, tmp_path / "lake", chunk_size=400, max_changes=20000)


def flushed_past(pipeline: PostgresPipeline, high_watermarks: Iterable[int]) -> None:
    """Wait until the source's flush position passes every one of ``high_watermarks`` (a batch then reads up to
    them); raises if it does not within 10 s."""
    wanted = list(high_watermarks)
    for _ in range(100):
        with pipeline.connect() as conn:
            if all(hw <= current_flush_lsn(conn) for hw in wanted):
                return
        time.sleep(0.1)
    raise AssertionError(f"the flush LSN did not pass the high watermarks {wanted}")


def stream_once(pipeline: PostgresPipeline, spark, recorded: Offset | None) -> tuple[Offset, StreamReport]:
    report = pipeline.stream_batch(spark, recorded, "test")
    offset = report.offset  # "recorded", then the slot follows
    pipeline.acknowledge(offset)
    return offset, report


def catch_up(pipeline: PostgresPipeline, spark, recorded: Offset | None, rounds: int = 20) -> Offset | None:
    """Stream until everything committed so far is applied and no chunk window is open.

    (The server's WAL is shared with other databases, so "lag 0" is not a criterion: the target is the flush
    position when catching up starts.)"""
    with pipeline.connect() as conn:
        target = current_flush_lsn(conn)
    for _ in range(rounds):
        recorded, report = stream_once(pipeline, spark, recorded)
        if pipeline.position(recorded) >= target and report.waiting_windows == 0 and report.changes == 0:
            return recorded
        time.sleep(0.3)
    raise AssertionError(f"stream did not catch up in {rounds} batches: last {report}")


def assert_exact(pipeline: PostgresPipeline, spark, config: CdcConfig) -> None:
    for name, table in pipeline.tables.items():
        paths = pipeline.lake.table(name)
        mirror = mirror_rows(spark, paths.mirror, table)
        expected = source_rows(config.sources[0], table)
        differ = sorted(mirror ^ expected, key=str)
        if differ:
            first = differ[0][0]
            key = table.key_columns[0]
            meta = spark.read.format("delta").load(paths.mirror).where(F.col(key) == first)
            detail = [r.asDict() for r in meta.select("_cdc_op", "_cdc_position", "_cdc_unknown").collect()]
            changes: list[dict] | str = "none: the stream never applied a change of the table"
            if table_or_none(spark, paths.changelog) is not None:
                history = (
                    spark.read.format("delta")
                    .load(paths.changelog)
                    .where((F.col(f"after.{key}") == first) | (F.col(f"before.{key}") == first))
                )
                changes = [
                    r.asDict()
                    for r in history.select("_cdc_op", "_cdc_position", "_cdc_seq", "_cdc_xid", "_cdc_unchanged")
                    .orderBy("_cdc_position", "_cdc_seq")
                    .collect()
                ]
            short = [tuple(str(v)[:40] for v in row) for row in differ[:4]]
            raise AssertionError(f"{name}: {len(differ)} rows differ, e.g. {short}; mirror {detail}; log {changes}")
        unknown = spark.read.format("delta").load(paths.mirror).where(F.col("_cdc_unknown").isNotNull()).count()
        assert unknown == 0, f"{name}: {unknown} rows with unknown values"
        log = spark.read.format("delta").load(paths.changelog)
        duplicates = log.groupBy("_cdc_commit_lsn", "_cdc_seq").count().where("count > 1").count()
        assert duplicates == 0, f"{name}: {duplicates} duplicate changes in the changelog"


class Writer(threading.Thread):
    """Random committed and rolled-back writes on all three tables until stopped."""

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute("set synchronous_commit = on")
        self.random = random.Random(seed)
        self.stop = threading.Event()
        self.done = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.step()
                self.done += 1
                time.sleep(0.02)  # ~40 writes/s: a busy table, not a bulk load
        except BaseException as error:  # reported by the test
            self.error = error

    def step(self) -> None:
        r, c = self.random, self.conn
        n = r.randrange(1, 2600)
        choice = r.random()
        if choice < 0.2:
            c.execute(
                "insert into items (id, name, price, big, created, doc, tags) values (%s, %s, %s, %s, now(), %s, %s) "
                "on conflict (id) do nothing",
                [100000 + r.randrange(10**6), f"w{n}\n'\"", n / 4, "NaN" if n % 7 == 0 else n, '{"w": 1}', ["a", None]],
            )
        elif choice < 0.4:
            c.execute("update items set qty = qty + 1, note = %s, at_time = now()::time where id = %s", [str(n), n])
        elif choice < 0.5:
            c.execute("delete from items where id = %s", [n])
        elif choice < 0.6:  # primary-key update
            c.execute(
                "update items set id = id + 5000000 where id = %s and not exists "
                "(select from items where id = %s + 5000000)",
                [n, n],
            )
        elif choice < 0.7:  # savepoint: the rolled-back part must never appear
            with c.transaction():
                c.execute("update pairs set amount = amount + 1 where region = %s and code = %s", [n % 9, f"c{n}"])
                c.execute("savepoint s1")
                c.execute("delete from pairs where region = %s", [n % 9])
                c.execute("update items set name = 'rolled back' where id = %s", [n])
                c.execute("rollback to savepoint s1")
                c.execute("update pairs set label = 'sp' || amount where region = %s and code = %s", [n % 9, f"c{n}"])
        elif choice < 0.8:  # composite primary-key update
            c.execute(
                "update pairs set code = code || 'x' where region = %s and code = %s and length(code) < 12",
                [n % 9, f"c{n}"],
            )
        elif choice < 0.9:  # docs: TOAST body unchanged, sometimes with a key change
            if r.random() < 0.5:
                c.execute("update docs set title = title || '+' where id = (select id from docs order by id limit 1 "
                          "offset %s)", [n % 250])  # fmt: skip
            else:
                c.execute("update docs set id = gen_random_uuid() where id = (select id from docs order by id "
                          "limit 1 offset %s)", [n % 250])  # fmt: skip
        else:
            c.execute("insert into pairs values (%s, %s, %s, 'new') on conflict do nothing", [n % 9, f"n{n}", n])


def test_snapshot_under_concurrent_writes_is_exact(source, spark) -> None:
    _, admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    tables = pipeline.prepare()
    dsn = f"{admin_dsn} dbname={DATABASE}"
    writer = Writer(dsn, seed=7)
    long_txn = psycopg.connect(dsn)
    long_txn.execute("set synchronous_commit = on")
    long_txn.execute("update items set name = 'long 1' where id between 1 and 1200 and id % 11 = 0")
    writer.start()
    recorded = None
    groups = []
    for _name, table in sorted(tables.items()):
        count = len(pipeline.plan(table).chunks)
        groups += [(table, list(range(start, min(start + 3, count)))) for start in range(0, count, 3)]
    for step, (table, indexes) in enumerate(groups):
        pipeline.snapshot(spark, table, indexes, f"run{step}")
        recorded, _ = stream_once(pipeline, spark, recorded)
        if step == len(groups) // 3:
            long_txn.execute("delete from items where id between 1300 and 1500 and id % 3 = 0")
            long_txn.execute("update docs set title = 'long' where title like 't2%'")
        if step == 2 * len(groups) // 3:
            long_txn.commit()  # open across several chunk windows
    writer.stop.set()
    writer.join(30)
    long_txn.close()
    assert writer.error is None, writer.error
    assert writer.done > 50
    catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)


def test_idle_table_chunk_is_reconciled_without_writes(source, spark) -> None:
    _, _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    table = pipeline.prepare()["public.pairs"]
    recorded = catch_up(pipeline, spark, None)  # the seed rows arrive by stream; from now on nobody writes
    report = pipeline.snapshot(spark, table, [0, 1], "idle")
    assert report.rows > 0
    assert set(pipeline.lake.waiting_markers()) == {("public.pairs", 0), ("public.pairs", 1)}
    reconciled = []
    for _ in range(10):  # the flush LSN alone closes the window: no write to the source is needed
        recorded, batch = stream_once(pipeline, spark, recorded)
        assert batch.changes == 0
        reconciled += batch.reconciled
        if batch.waiting_windows == 0:
            break
        time.sleep(0.5)
    assert sorted((r["table"], r["chunk"]) for r in reconciled) == [("public.pairs", 0), ("public.pairs", 1)]
    assert sum(r["kept"] for r in reconciled) == report.rows
    assert not pipeline.lake.waiting_markers()
    mirror = mirror_rows(spark, pipeline.lake.table("public.pairs").mirror, table)
    assert mirror == source_rows(config.sources[0], table)


def test_a_chunk_staged_again_while_a_batch_reconciles_it_keeps_its_marker_and_is_reconciled_next(
    source, spark, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs of one chunk (a backfill's and a planner's, in the orphaned-run test of 2026-12-06): the second
    stages its window just after a stream batch read the window log, and that batch reconciles the first window. On
    an idle source nothing else asks for a batch, so the second window's marker must survive that batch: the
    streaming sensor's ``pending_work`` then asks for the batch that reconciles it."""
    _, _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    table = pipeline.prepare()["public.pairs"]
    recorded = catch_up(pipeline, spark, None)  # from now on nobody writes to this database
    pipeline.snapshot(spark, table, [0], "first")

    def flushed_past_markers() -> None:
        flushed_past(pipeline, pipeline.lake.waiting_markers().values())

    flushed_past_markers()
    read_log = window_log.pending_staged
    staged_again = []

    def log_read_then_the_chunk_staged_again(*args, **kwargs):
        pending = read_log(*args, **kwargs)
        if not staged_again:
            staged_again.append(pipeline.snapshot(spark, table, [0], "second"))
        return pending

    monkeypatch.setattr(window_log, "pending_staged", log_read_then_the_chunk_staged_again)
    recorded, batch = stream_once(pipeline, spark, recorded)
    monkeypatch.undo()
    assert staged_again and [(r["table"], r["chunk"]) for r in batch.reconciled] == [("public.pairs", 0)], batch
    assert set(pipeline.lake.waiting_markers()) == {("public.pairs", 0)}  # the second window's
    flushed_past_markers()
    assert pipeline.pending_work() == "a chunk window can close"  # what the streaming sensor asks
    recorded, batch = stream_once(pipeline, spark, recorded)
    assert [(r["table"], r["chunk"]) for r in batch.reconciled] == [("public.pairs", 0)] and batch.waiting_windows == 0
    assert not pipeline.lake.waiting_markers() and pipeline.pending_work() is None
    mirror = mirror_rows(spark, pipeline.lake.table("public.pairs").mirror, table)
    assert mirror == source_rows(config.sources[0], table)


def test_a_run_killed_between_its_window_record_and_its_marker_still_gets_its_batch_on_an_idle_source(
    source, spark, faults
) -> None:
    """A snapshot run killed after recording its window, before marking its chunk waiting: on a source nobody
    writes to, nothing else asks for a stream batch, so the streaming sensor's ``pending_work`` must find the window
    from its staged file; the batch it asks for reconciles it."""
    _, _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    table = pipeline.prepare()["public.pairs"]
    recorded = catch_up(pipeline, spark, None)  # from now on nobody writes to this database
    faults.armed.add("snapshot.before_waiting_markers")
    with pytest.raises(Killed):
        pipeline.snapshot(spark, table, [0], "killed")
    assert faults.fired == ["snapshot.before_waiting_markers"] and not pipeline.lake.waiting_markers()
    [high_watermark] = window_log.staged_high_watermarks(pipeline.lake.windows)
    flushed_past(pipeline, [high_watermark])
    assert pipeline.pending_work() == "a chunk window can close"  # what the streaming sensor asks
    recorded, batch = stream_once(pipeline, spark, recorded)
    assert [(r["table"], r["chunk"]) for r in batch.reconciled] == [("public.pairs", 0)] and batch.waiting_windows == 0
    assert not window_log.staged_high_watermarks(pipeline.lake.windows) and not pipeline.lake.waiting_markers()
    assert pipeline.pending_work() is None
    mirror = mirror_rows(spark, pipeline.lake.table("public.pairs").mirror, table)
    assert mirror == source_rows(config.sources[0], table)


def test_resnapshot_of_a_chunk_the_source_emptied_deletes_the_mirror_rows_left_there(source, spark) -> None:
    """A chunk whose rows are all gone at the source reads no row; its reconciliation must still delete the rows
    the mirror holds in its range (drift: here, rows appended to the mirror by hand) and report them deleted."""
    admin, _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    table = pipeline.prepare()["public.items"]
    chunk = pipeline.plan(table).chunks[1]
    lo, hi = int(chunk.lo[0]), int(chunk.hi[0])
    admin.execute("delete from items where id >= %s and id < %s", [lo, hi])
    recorded = catch_up(pipeline, spark, None)  # the seed rows arrive by stream, without the chunk's
    mirror_path = pipeline.lake.table("public.items").mirror
    mirror = spark.read.format("delta").load(mirror_path)
    assert mirror.where(f"id >= {lo} and id < {hi}").count() == 0
    below = mirror.where(f"id < {lo}").orderBy("id").limit(3)
    first = below.agg(F.min("id")).first()[0]
    phantoms = below.withColumn("id", F.col("id") - F.lit(first) + F.lit(lo))  # the seed's keys are dense
    phantoms.write.format("delta").mode("append").save(mirror_path)
    assert spark.read.format("delta").load(mirror_path).where(f"id >= {lo} and id < {hi}").count() == 3

    report = pipeline.snapshot(spark, table, [1], "emptied")
    assert report.rows == 0
    reconciled = []
    for _ in range(10):
        recorded, batch = stream_once(pipeline, spark, recorded)
        reconciled += batch.reconciled
        if batch.waiting_windows == 0:
            break
        time.sleep(0.5)
    assert [(r["chunk"], r["kept"], r["dropped"], r["deleted"]) for r in reconciled] == [(1, 0, 0, 3)]
    assert mirror_rows(spark, mirror_path, table) == source_rows(config.sources[0], table)


def test_commit_held_at_the_low_watermark_is_not_overwritten_by_the_read(source, spark) -> None:
    """A commit record can precede the low watermark while its transaction is still in the snapshot's ``xip``
    (the commit waits for a WAL flush or a synchronous standby). The read cannot see it, the stream applies it: the
    key must be dropped from the chunk however early in the WAL that commit lies."""
    _, admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    items = pipeline.prepare()["public.items"]
    recorded = catch_up(pipeline, spark, None)
    chunks = list(range(len(pipeline.plan(items).chunks)))
    statement = "update items set name = 'held commit', qty = -7 where id = 7"
    with commit_held_by_absent_standby(admin_dsn, DATABASE, statement):
        report = pipeline.snapshot(spark, items, chunks, "held")
        assert report.rows > 0
        recorded = catch_up(pipeline, spark, recorded)  # applies the held commit, then reconciles every chunk
    recorded = catch_up(pipeline, spark, recorded)
    mirror = spark.read.format("delta").load(pipeline.lake.table("public.items").mirror).where("id = 7")
    assert [(r.name, r.qty) for r in mirror.collect()] == [("held commit", -7)]
    assert mirror_rows(spark, pipeline.lake.table("public.items").mirror, items) == source_rows(
        config.sources[0], items
    )


CRASH_SCRIPT = """
import json
import sys
from pathlib import Path
from cdc_assets.config import SparkConfig
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from cdc_assets.lake.spark import spark_session
from tests.integration.support import pipeline_config

lake, step, recorded = sys.argv[1], sys.argv[2], sys.argv[3]
config = pipeline_config("pipe_guarantees", Path(lake), chunk_size=400, max_changes=20000)
pipeline = PostgresPipeline(config, config.sources[0])
spark = spark_session(SparkConfig(master="local[2]"))
if step == "snapshot":
    table = pipeline.prepare()["public.items"]
    pipeline.snapshot(spark, table, [0, 1, 2], "doomed")
else:
    pipeline.stream_batch(spark, json.loads(recorded), "doomed")
print("survived")
"""


def run_killed(lake: Path, step: str, fault: str, recorded: Offset | None) -> None:
    env = {**os.environ, "CDC_FAULTS": fault, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", CRASH_SCRIPT, str(lake), step, json.dumps(recorded)],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == -9, f"expected SIGKILL at {fault}: rc={result.returncode}\n{result.stderr[-3000:]}"
    assert "survived" not in result.stdout


def test_killed_runs_rerun_exactly_once(source, spark) -> None:
    admin, _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    tables = pipeline.prepare()
    lake = config.lake_root
    # 1. a chunk run killed after staging its rows, before recording its window: the rows are never used
    run_killed(lake, "snapshot", "snapshot.before_window_record", None)
    assert not pipeline.lake.waiting_markers()
    for table in tables.values():
        pipeline.snapshot(spark, table, list(range(len(pipeline.plan(table).chunks))), "rerun")
    admin.execute("update items set qty = 7 where id % 5 = 0")
    admin.execute("delete from pairs where region = 4")
    admin.execute("update docs set id = gen_random_uuid() where title like 't3%'")
    # 2. a batch killed after its lake commit, before the offset is recorded: the rerun appends nothing twice
    confirmed_before = slot_of(pipeline)
    run_killed(lake, "stream", "stream.after_lake_commit", None)
    assert slot_of(pipeline) == confirmed_before  # the slot never moves ahead of a recorded offset
    log = pipeline.lake.table("public.items").changelog
    written_by_killed_run = spark.read.format("delta").load(log).count()
    assert written_by_killed_run > 0
    # 3. one killed after the changelog append, before the mirror merge
    admin.execute("update items set qty = 8 where id % 6 = 0")
    run_killed(lake, "stream", "stream.after_changelog", None)
    catch_up(pipeline, spark, None)
    assert_exact(pipeline, spark, config)


def slot_of(pipeline: PostgresPipeline) -> int:
    with pipeline.connect() as conn:
        return slot_position(conn, pipeline.source.slot)[0]


def test_one_huge_transaction_streams_with_bounded_driver_memory(source, spark) -> None:
    admin, _, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    recorded = catch_up(pipeline, spark, None)
    admin.execute(
        "insert into items (id, name, qty, doc) select g, repeat('x', 200) || g, g % 100, '{\"k\": 1}' "
        "from generate_series(1000000, 1199999) g"
    )  # 200k changes in one transaction; the batch bound is 20000 changes
    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = baseline
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        report = pipeline.stream_batch(spark, recorded, "huge")
    finally:
        stop.set()
        sampler.join()
    assert report.changes == 200_000  # upto_nchanges stops only at a transaction boundary
    assert report.per_table["public.items"]["spill_parts"] >= 40  # spilled every 5000 rows, never held whole
    growth_mb = (peak - baseline) / 2**20
    raw_mb = 200_000 * 260 / 2**20
    assert growth_mb < 2 * raw_mb, f"driver grew {growth_mb:.0f} MB for {raw_mb:.0f} MB of change text"
    pipeline.acknowledge(report.offset)
    mirror = spark.read.format("delta").load(pipeline.lake.table("public.items").mirror)
    assert mirror.where("id >= 1000000").count() == 200_000
