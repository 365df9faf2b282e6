"""The generic pipeline (``cdc_assets.pipeline``) driven by a source that lives in Python lists
(``tests/memory_dialect.py``): no database, real Spark and Delta.

- Every chunk is snapshotted while a writer commits inserts, updates, key changes, deletes and re-inserts of deleted
  keys, between the low watermark and the reads, during the reads and between stream batches; batches are small, so
  windows close over many batches. Runs are "killed" at every fault point of the pipeline and run again: a kill is
  an exception that no ``except Exception`` catches (``Killed``, a ``BaseException``), raised at the named point, so
  nothing after it runs; the clean-up a real SIGKILL would skip (``finally`` blocks) does run here, the PostgreSQL
  suite kills real processes. A batch killed after its lake commit is re-run from the offset recorded before it, and
  one killed after its offset was recorded is not acknowledged. After catch-up each mirror equals its table and no
  change is twice in a changelog.
- The generic consistency check (``cdc_assets.consistency``) with the reference dialect's source half: no alarm
  after changes the stream applies while the check waits, drift planted in the mirror found in the right chunks.
- The same run with a broken settled rule (every transaction settled) resurrects a row deleted after the read: the
  comparison can fail.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F

import cdc_assets.lake.mirror as mirror_module
from cdc_assets.config import CdcConfig, PostgresConnection, SourceConfig, SparkConfig, StreamConfig
from cdc_assets.lake.adopt import ADOPTED_PREFIX
from cdc_assets.pipeline import CdcPipeline
from tests.memory_dialect import MemoryDatabase, MemoryDialect, MemorySettledRule, MemoryTable
from tests.pipeline_support import FaultPoints, Killed, Stream

ITEMS = MemoryTable("public.items", ("id",), pa.schema([("id", pa.int64()), ("name", pa.string()),
                                                       ("qty", pa.int64())]))  # fmt: skip
NOTES = MemoryTable("app.notes", ("code",), pa.schema([("code", pa.string()), ("text", pa.string())]))


def config_for(lake_root: Path, max_changes: int) -> tuple[CdcConfig, SourceConfig]:
    source = SourceConfig(
        name="memory",
        kind="memory",
        connection=PostgresConnection("unused", 1, "unused", "unused", None),
        slot="unused",
        publication="unused",
        startup_mode="initial",
        chunk_size=40,
        read_parallelism=1,
        tables=(),
        include=("*",),
        exclude=(),
        stream=StreamConfig(max_changes=max_changes, spill_rows=1000),
    )
    return CdcConfig(lake_root=lake_root, spark=SparkConfig(), sources=(source,)), source


def seeded_database() -> MemoryDatabase:
    database = MemoryDatabase({ITEMS.qualified_name: ITEMS, NOTES.qualified_name: NOTES})
    database.commit(*[("public.items", "insert", None, {"id": i, "name": f"item {i}", "qty": i % 7})
                      for i in range(1, 121)])  # fmt: skip
    database.commit(*[("app.notes", "insert", None, {"code": f"n{i:03d}", "text": f"note {i}"}) for i in range(40)])
    return database


class Writer:
    """Random transactions of one to three writes over both tables: updates, key changes, deletes, inserts of new
    keys and re-inserts of deleted ones."""

    def __init__(self, database: MemoryDatabase, seed: int) -> None:
        self.database = database
        self.random = random.Random(seed)
        self.deleted: dict[str, list[tuple]] = {"public.items": [], "app.notes": []}
        self.next_id = 10_000 + seed * 100_000  # keys of their own for each writer

    def write(self, transactions: int) -> None:
        for _ in range(transactions):
            writes = []
            touched: set[tuple[str, tuple]] = set()
            for _ in range(self.random.randint(1, 3)):
                write = self._one(touched)
                if write is not None:
                    writes.append(write)
            if writes:
                self.database.commit(*writes)

    def _one(self, touched: set[tuple[str, tuple]]):
        name = self.random.choice(["public.items", "public.items", "app.notes"])
        rows = self.database.rows[name]
        keys = [k for k in rows if (name, k) not in touched]
        kind = self.random.random()
        if not keys:
            return None
        key = self.random.choice(keys)
        touched.add((name, key))
        if name == "public.items":
            row = dict(rows[key])
            if kind < 0.45:
                return (
                    name,
                    "update",
                    key,
                    {**row, "qty": self.random.randint(0, 999), "name": f"v{self.random.random()}"},
                )
            if kind < 0.55:
                self.next_id += 1
                touched.add((name, (self.next_id,)))
                return name, "update", key, {**row, "id": self.next_id}  # a key change
            if kind < 0.7:
                self.deleted[name].append(key)
                return name, "delete", key, None
            if kind < 0.85 and self.deleted[name]:
                again = self.deleted[name].pop(0)
                if again in rows or (name, again) in touched:
                    return None
                touched.add((name, again))
                return name, "insert", None, {"id": again[0], "name": "again", "qty": -1}  # a freed key reused
            self.next_id += 1
            touched.add((name, (self.next_id,)))
            return name, "insert", None, {"id": self.next_id, "name": "new", "qty": 0}
        if kind < 0.6:
            return name, "update", key, {"code": key[0], "text": f"t{self.random.random()}"}
        if kind < 0.8:
            self.deleted[name].append(key)
            return name, "delete", key, None
        code = f"z{self.random.randint(0, 10**6):07d}"
        if (code,) in rows:
            return None
        touched.add((name, (code,)))
        return name, "insert", None, {"code": code, "text": "new"}


def mirror_rows(spark, pipeline: CdcPipeline, table: MemoryTable) -> dict[tuple, dict]:
    frame = spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).mirror)
    assert frame.where(F.col("_cdc_unknown").isNotNull()).count() == 0
    names = list(table.schema.names)
    return {tuple(r[k] for k in table.key_columns): {n: r[n] for n in names} for r in frame.select(*names).collect()}


def assert_exact(spark, pipeline: CdcPipeline, database: MemoryDatabase) -> None:
    for table in (ITEMS, NOTES):
        expected = database.snapshot(table.qualified_name)
        actual = mirror_rows(spark, pipeline, table)
        missing = sorted(set(expected) - set(actual))[:5]
        extra = sorted(set(actual) - set(expected))[:5]
        different = sorted(k for k in set(expected) & set(actual) if expected[k] != actual[k])[:5]
        assert not (missing or extra or different), (table.qualified_name, missing, extra, different)
        changelog = spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).changelog)
        twice = changelog.groupBy("_cdc_position", "_cdc_seq").count().where("count > 1").count()
        assert twice == 0, f"{table.qualified_name}: changes twice in the changelog"


def landed_chunks(spark, mirror: str) -> set[int]:
    """The chunks whose staged files a mirror took whole (``cdc_assets.lake.adopt``), from its current files."""
    files = spark.read.format("delta").load(mirror).inputFiles()
    names = [f.rsplit("/", 1)[-1] for f in files if f.rsplit("/", 1)[-1].startswith(ADOPTED_PREFIX)]
    return {int(name.split("-chunk-")[1].split("-")[0]) for name in names}


def run_scenario(
    spark, tmp_path: Path, faults: FaultPoints, seed: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[CdcPipeline, MemoryDatabase]:
    database = seeded_database()
    config, source = config_for(tmp_path / "lake", max_changes=30)
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=40))
    tables = pipeline.prepare()
    writer = Writer(database, seed)
    stream = Stream(pipeline, spark)
    database.during_read = lambda table, chunk: writer.write(2)  # commits between the reads and the high watermark
    # the first snapshot run dies before it records its window; the first three batches die one after the other,
    # after the changelog append, after a MERGE, after the lake commit (its offset never recorded)
    faults.armed |= {"snapshot.before_window_record", "stream.after_changelog", "stream.after_merge",
                     "stream.after_lake_commit"}  # fmt: skip
    for _, table in sorted(tables.items()):
        chunks = list(range(len(pipeline.plan(table).chunks)))
        for start in range(0, len(chunks), 2):
            writer.write(3)  # before the low watermark
            window = chunks[start : start + 2]
            try:
                pipeline.snapshot(spark, table, window, f"s{start}")
            except Killed:
                pipeline.snapshot(spark, table, window, f"s{start}-rerun")  # the run is retried
            stream.batch()
            writer.write(4)
    assert set(faults.fired) == {"snapshot.before_window_record", "stream.after_changelog", "stream.after_merge",
                                 "stream.after_lake_commit"}, faults.fired  # fmt: skip
    stream.batch(acknowledge=False)  # recorded, killed before the source was told
    writer.write(10)
    database.during_read = None
    # batches die after a mirror's append of keys above every key it holds, and between its MERGE of the keys it
    # holds and its insert of the keys it lacks (every mirror from now on is written as one of 256 MB or more)
    monkeypatch.setattr(mirror_module, "TWO_STATEMENTS_FROM_BYTES", 0)
    monkeypatch.setattr(mirror_module, "REWRITE_FILES_BELOW_BYTES", 0)  # and deletion vectors, as a big one's
    big_mirror_points = {"stream.between_append_and_merge", "stream.between_mirror_merges"}
    faults.armed.update(big_mirror_points)
    stream.catch_up()
    assert set(faults.fired[-2:]) == big_mirror_points, faults.fired
    return pipeline, database


def test_generic_pipeline_mirrors_an_in_memory_source_exactly_through_kills(
    spark, tmp_path: Path, faults, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline, database = run_scenario(spark, tmp_path, faults, seed=7, monkeypatch=monkeypatch)
    assert_exact(spark, pipeline, database)
    assert len(database.log) > 30  # the writer really wrote between windows, reads and batches
    windows = spark.read.format("delta").load(pipeline.lake.windows)
    assert windows.where("event = 'reconciled'").count() == sum(
        len(pipeline.plan(t).chunks) for t in pipeline.tables.values()
    )
    # the generic consistency check, with the reference dialect's source half: changes the stream has not applied
    # when the check starts are waited for, and nothing is reported
    items = pipeline.tables["public.items"]
    chunks = list(range(len(pipeline.plan(items).chunks)))
    Writer(database, seed=11).write(10)
    results = checked(pipeline, spark, items, chunks)
    assert all(r.conclusive and r.matches for r in results), results
    # drift in the mirror (a changed row, a deleted row) is found in the chunks that hold it, and named
    mirror = DeltaTable.forPath(spark, pipeline.lake.table("public.items").mirror)
    keys = sorted(database.rows["public.items"])
    changed, deleted = keys[0][0], keys[-1][0]
    mirror.update(F.col("id") == changed, {"name": F.lit("tampered")})
    mirror.delete(F.col("id") == deleted)
    failing = {r.chunk: r for r in checked(pipeline, spark, items, chunks) if not r.matches}
    assert sorted(failing) == sorted({chunks[0], chunks[-1]}), failing
    assert "tampered" in (failing[chunks[0]].first_difference or "")
    assert "mirror=absent" in (failing[chunks[-1]].first_difference or "")


def test_quiet_chunks_land_whole_and_take_every_later_change(spark, tmp_path: Path, faults) -> None:
    """A chunk no change touched while it was read, into a key range the mirror holds no row of, is landed as its
    staged files (``cdc_assets.lake.adopt``; its rows carry the window's start position, not its high watermark);
    a chunk with a change during its read is appended as before. The first landing dies between placing the files and
    its commit; the rerun lands them. Then updates, key changes, deletes and re-inserts of the landed keys stream in:
    the mirror equals the source."""
    database = seeded_database()
    database.forgotten = database.position  # the stream starts after the seed, as a slot made after the data
    config, source = config_for(tmp_path / "lake", max_changes=30)
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=40))
    items = pipeline.prepare()[ITEMS.qualified_name]
    stream = Stream(pipeline, spark)

    def during_read(table: str, chunk: int) -> None:
        if chunk == 1:  # a change of a key chunk 1's read saw, before the high watermark
            database.commit(("public.items", "update", (45,), {"id": 45, "name": "during", "qty": 1}))

    database.during_read = during_read
    chunks = list(range(len(pipeline.plan(items).chunks)))
    assert len(chunks) == 3
    pipeline.snapshot(spark, items, chunks, "s0")
    database.during_read = None
    faults.armed.add("stream.after_adopted_files")
    stream.catch_up()
    assert faults.fired == ["stream.after_adopted_files"]
    mirror = pipeline.lake.table(ITEMS.qualified_name).mirror
    assert landed_chunks(spark, mirror) == {0, 2}
    positions = spark.read.format("delta").load(mirror).where("_cdc_op = 'r'").groupBy("_cdc_position").count()
    assert positions.count() == 2  # landed rows at the window's start, appended ones at its high watermark
    Writer(database, seed=3).write(60)
    stream.catch_up()
    assert mirror_rows(spark, pipeline, ITEMS) == database.snapshot(ITEMS.qualified_name)


def checked(pipeline: CdcPipeline, spark, table: MemoryTable, chunks: list[int]):
    """``check_chunks`` while a stream runs beside it (as the streaming sensor would)."""
    stream = Stream(pipeline, spark)
    stream.recorded = {"position": pipeline.lake.acknowledged()}
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            stream.batch()
            time.sleep(0.2)

    streamer = threading.Thread(target=run, daemon=True)
    streamer.start()
    try:
        return pipeline.check_chunks(spark, table, chunks, wait_seconds=120)
    finally:
        done.set()
        streamer.join(120)


def test_a_broken_settled_rule_is_caught(spark, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key deleted after the read, before the high watermark: the right rule drops its staged row (the delete is
    not settled at the low watermark); a rule that calls every transaction settled upserts it after the stream
    applied the delete, and the deleted row is back."""
    database = seeded_database()
    config, source = config_for(tmp_path / "lake", max_changes=1000)
    monkeypatch.setattr(MemorySettledRule, "unsettled", lambda self: F.lit(False))
    monkeypatch.setattr(MemorySettledRule, "since_window", lambda self: F.lit(False))
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=1000))
    table = pipeline.prepare()["public.items"]
    stream = Stream(pipeline, spark)
    database.during_read = lambda name, chunk: database.commit(("public.items", "delete", (5,), None))
    pipeline.snapshot(spark, table, [0], "only")
    stream.catch_up()
    assert (5,) not in database.rows["public.items"]
    assert (5,) in mirror_rows(spark, pipeline, ITEMS)  # resurrected: the assertion of the scenario above would fail
    with pytest.raises(AssertionError, match=r"public\.items"):
        assert_exact(spark, pipeline, database)


def test_a_table_created_while_a_run_is_in_flight_is_captured_by_the_batch_that_meets_it(spark, tmp_path: Path) -> None:
    """The generic half of ``CapturedTablesChanged``: the reference dialect meets changes of a table created after the
    pipeline resolved its tables; the pipeline resolves them again, the same batch applies them, and the report
    names the table. A snapshot of it by another pipeline and changes after the snapshot end exact."""
    database = seeded_database()
    config, source = config_for(tmp_path / "lake", max_changes=1000)
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=1000))
    assert sorted(pipeline.prepare()) == ["app.notes", "public.items"]
    stream = Stream(pipeline, spark)
    stream.catch_up()
    tags = MemoryTable("app.tags", ("tag",), pa.schema([("tag", pa.string()), ("uses", pa.int64())]))
    database.create_table(tags)
    database.commit(*[("app.tags", "insert", None, {"tag": f"t{i}", "uses": i}) for i in range(10)])
    snapshotting = CdcPipeline(config, source, MemoryDialect(database, chunk_size=1000))
    snapshotting.snapshot(spark, snapshotting.prepare()["app.tags"], [0], "tags")
    database.commit(("app.tags", "update", ("t1",), {"tag": "t1", "uses": 100}), ("app.tags", "delete", ("t2",), None))
    report = stream.batch()
    assert report is not None and report.newly_captured == ["app.tags"] and report.changes == 12
    stream.catch_up()
    assert mirror_rows(spark, pipeline, tags) == database.snapshot("app.tags")


def test_a_batch_removes_the_spill_a_killed_batch_left_behind(spark, tmp_path: Path) -> None:
    database = seeded_database()
    config, source = config_for(tmp_path / "lake", max_changes=1000)
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=1000))
    pipeline.prepare()
    leftover = pipeline.lake.spill_dir("run-killed-0a1b2c3d") / "public.items" / "part-00000.parquet"
    leftover.write_text("the part of a batch whose process was killed")
    Stream(pipeline, spark).batch()
    assert not leftover.exists() and (pipeline.lake.control / "spill").entries() == []


def test_a_waiting_check_asks_for_batches_only_until_the_stream_passed_its_high_watermark(tmp_path: Path) -> None:
    """Pure (no Spark): the check's marker stays while it compares, after the stream passed its high watermark; the
    stream is due for the check only before that."""
    database = seeded_database()
    config, source = config_for(tmp_path / "lake", max_changes=1000)
    pipeline = CdcPipeline(config, source, MemoryDialect(database, chunk_size=1000))
    database.forgotten = database.position  # nothing waits in the source
    assert pipeline.pending_work() is None
    pipeline.lake.mark_check_waiting("check", database.position)
    assert pipeline.pending_work() == "a consistency check waits for the stream"
    pipeline.lake.record_acknowledged(database.position - 1)
    assert pipeline.pending_work() == "a consistency check waits for the stream"
    pipeline.lake.record_acknowledged(database.position)  # a batch passed it: the check compares now
    assert pipeline.pending_work() is None
    pipeline.lake.clear_check_waiting("check")
    assert pipeline.pending_work() is None


def test_the_reference_dialect_is_what_the_pipeline_asks_for() -> None:
    """Every operation of the dialect interface exists on the in-memory dialect (no PostgreSQL anywhere)."""
    from cdc_assets.dialect import SourceDialect

    operations = [n for n in vars(SourceDialect) if not n.startswith("_") and callable(vars(SourceDialect)[n])]
    assert operations
    for name in operations:
        assert callable(getattr(MemoryDialect, name)), name
    assert "psycopg" not in Path(__file__).with_name("memory_dialect.py").read_text()
