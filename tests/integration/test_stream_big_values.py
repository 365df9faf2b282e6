"""Issue #23 on real PostgreSQL, Spark and Delta, with the driver heap left at its default: memory bounded in bytes.

- one transaction updating 200 rows with 10 MB values each, a single 100 MB ``text`` value and a single 100 MB
  ``bytea`` value stream through (batches bounded by bytes, spill parts of a few rows): the mirror is exact (MD5 of
  every value compared with the source's) and the driver's Python process stays under ``PYTHON_BOUND_MB`` (never
  the batch) and its JVM under ``JVM_BOUND_MB`` (its default heap plus 3 GB);
- a snapshot chunk of rows with 5 MB values each is read, staged and reconciled within the same bound;
- a batch forced to fail (``CDC_FAULTS=stream.batch_over=N``) is retried smaller, the stream goes on, and the
  bounds grow back after successes;
- a batch re-read smaller after its process died past the lake commit appends no change to the changelog twice.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import psycopg
import pytest
from psycopg import sql
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_assets.config import CdcConfig, StreamConfig
from cdc_assets.dialect import Offset
from cdc_assets.engine.batch_bounds import recover_in_flight, with_in_flight
from cdc_assets.lake.spark import default_driver_memory, memory_megabytes
from cdc_assets.sources.postgres.pipeline import PostgresPipeline, StreamBatchError
from cdc_assets.sources.postgres.stream import current_flush_lsn
from tests.integration.support import READER_PASSWORD, drop_source, pipeline_config

DATABASE = "pipe_big_values"
MB = 2**20
# The driver's Python process holds a few copies of one message (a 100 MB bytea value is a 200 MB hex message; 2.3 GB
# measured) and of one spill part, never a batch (the batches below hold 2 GB: 200 x 10 MB in one transaction).
PYTHON_BOUND_MB = 3000
# Its JVM takes what Spark's memory manager lets it (sorts keep rows in the heap until it is full, then spill): its
# default heap, plus direct buffers of the Parquet codecs that only a full collection frees (the size of one page:
# Parquet writers check their size after every row, ``cdc_assets.lake.spark.BASE_CONF``), plus code, metaspace and
# threads; its Python workers are counted with it. With the 6 GB default heap of a 24 GB machine the first test's
# JVM peaked at 6.9-7.3 GB in four runs, the second's at 7.0-7.8 GB in two (10.8 GB in the first when parquet-mr
# estimated its next page check: pages of many big values; earlier figures of up to 21 GB counted the JVM twice, see
# ``counted_children``). The bound, the heap plus 3 GB, leaves 1.3 GB above the highest of those.
HEAP_MB = memory_megabytes(default_driver_memory())
JVM_BOUND_MB = HEAP_MB + 3072

SCHEMA_SQL = """
create table blobs (id int primary key, label text, body text, raw bytea);
"""


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path) -> Iterator[tuple[psycopg.Connection, CdcConfig]]:
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    drop_source(admin_dsn, DATABASE)
    role = f"{DATABASE}_reader"
    with psycopg.connect(f"{admin_dsn} dbname=postgres", autocommit=True) as root:
        root.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
        root.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))
        root.execute(
            sql.SQL("create role {} login replication password {}").format(
                sql.Identifier(role), sql.Literal(READER_PASSWORD)
            )
        )
        root.execute(sql.SQL("alter role {} set default_transaction_read_only = on").format(sql.Identifier(role)))
    admin = psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True)
    try:
        admin.execute(SCHEMA_SQL)
        admin.execute(sql.SQL("grant select on all tables in schema public to {}").format(sql.Identifier(role)))
        admin.execute(sql.SQL("create publication {} for table blobs").format(sql.Identifier(DATABASE)))
        admin.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [DATABASE])
        admin.execute("set synchronous_commit = on")
        yield admin, pipeline_config(DATABASE, tmp_path / "lake", chunk_size=1000)
    finally:
        admin.close()
        drop_source(admin_dsn, DATABASE)


TRACE = os.environ.get("CDC_RSS_TRACE")


def anonymous_rss(process: psutil.Process) -> int:
    """Resident memory that is the process's own (anonymous: heap, stacks, direct buffers), not pages of files it
    maps (Spark reads blocks it keeps on disk through memory maps; those pages are the page cache's)."""
    info = process.memory_info()
    return info.rss - info.shared


def counted_children(jvm: psutil.Process) -> list[psutil.Process]:
    """The Spark driver's JVM and its descendants (its Python workers), less a JVM's child still running the JVM's
    program: the JVM starts commands (Hadoop's ``Shell``) by ``posix_spawn``, whose child shares the JVM's memory
    until it executes the command, so reading its RSS counts the JVM a second time (single samples at exactly twice
    the JVM's figure were seen in every run). Such a child has the JVM's executable and the name of the JVM thread
    that started it, not ``java``. Only the driver's JVM: the test process has other children in a whole-suite run
    (the MongoDB test server holding large documents, the torture harness's runs with their own drivers), and
    counting them made this bound fail in CI (a JVM figure of 9,992 MB)."""
    counted = [jvm]
    for child in jvm.children(recursive=True):
        try:
            parent = child.parent()
            if parent is not None and parent.name() == "java" and child.exe() == parent.exe():
                continue
        except psutil.Error:
            continue
        counted.append(child)
    return counted


@contextmanager
def peak_rss(spark: SparkSession) -> Iterator[dict[str, float]]:
    """Samples the resident memory of this process plus the Spark driver's JVM (``counted_children``) every 50 ms;
    yields a dict whose ``peak_mb`` holds the highest sum seen."""
    process = psutil.Process()
    jvm = psutil.Process(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    result = {"peak_mb": 0.0, "python_mb": 0.0, "jvm_mb": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            python = anonymous_rss(process)
            children = 0
            counted = counted_children(jvm)
            for child in counted:
                try:
                    children += anonymous_rss(child)
                except psutil.NoSuchProcess:
                    pass
            if TRACE:
                with open(TRACE, "a") as trace:
                    trace.write(f"{time.strftime('%H:%M:%S')} {python / MB:.0f} {children / MB:.0f} {len(counted)}\n")
            result["python_mb"] = max(result["python_mb"], python / MB)
            result["jvm_mb"] = max(result["jvm_mb"], children / MB)
            result["peak_mb"] = max(result["peak_mb"], (python + children) / MB)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()


def assert_driver_memory_bounded(rss: dict[str, float]) -> None:
    assert rss["python_mb"] < PYTHON_BOUND_MB, f"the driver's Python process peaked at {rss['python_mb']:.0f} MB"
    print(f"the driver's JVM peaked at {rss['jvm_mb']:.0f} MB anonymous memory (default heap {HEAP_MB} MB)")
    assert rss["jvm_mb"] < JVM_BOUND_MB, f"the driver's JVM peaked at {rss['jvm_mb']:.0f} MB (bound {JVM_BOUND_MB})"


def catch_up(
    pipeline: PostgresPipeline, spark, recorded: Offset | None, rounds: int = 30
) -> tuple[Offset | None, list]:
    with pipeline.connect() as conn:
        target = current_flush_lsn(conn)
    reports = []
    for _ in range(rounds):
        report = pipeline.stream_batch(spark, recorded, "big")
        recorded = report.offset
        pipeline.acknowledge(recorded)
        reports.append(report)
        if pipeline.position(recorded) >= target and report.waiting_windows == 0 and report.changes == 0:
            return recorded, reports
    raise AssertionError(f"stream did not catch up in {rounds} batches: last {reports[-1]}")


def assert_mirror_exact(admin: psycopg.Connection, pipeline: PostgresPipeline, spark) -> None:
    """Every row's label and the MD5 of its big values, in the source and in the mirror."""
    source = {
        row[0]: row[1:]
        for row in admin.execute("select id, label, md5(body), md5(raw), length(body), length(raw) from blobs")
    }
    mirror = spark.read.format("delta").load(pipeline.lake.table("public.blobs").mirror)
    lake = {
        row[0]: tuple(row[1:])
        for row in mirror.select(
            "id", "label", F.md5("body"), F.md5("raw"), F.length("body"), F.length("raw")
        ).collect()
    }
    assert lake == source


def test_big_values_stream_through_with_bounded_driver_memory(source, spark) -> None:
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    admin.execute("insert into blobs (id, label) select g, 'row ' || g from generate_series(1, 200) g")
    recorded, _ = catch_up(pipeline, spark, None)
    # one transaction: 200 rows of 10 MB each (2 GB of values); then a 100 MB text and a 100 MB bytea value
    admin.execute("update blobs set body = repeat(md5(id::text), 10 * 1024 * 1024 / 32), label = 'big ' || id")
    admin.execute("insert into blobs (id, label, body) values (1000, 'text', repeat('0123456789abcdef', 6553600))")
    admin.execute("insert into blobs (id, label, raw) values (1001, 'bytea', decode(repeat('0f1e', 52428800), 'hex'))")
    with peak_rss(spark) as rss:
        recorded, reports = catch_up(pipeline, spark, recorded)
    changes = [r.changes for r in reports]
    assert changes[0] == 200  # the whole transaction in one batch: a bound never splits one
    assert reports[0].bytes > 2000 * MB and reports[0].per_table["public.blobs"]["spill_parts"] >= 50
    # the 256 MB byte bound cut the batches after the big transaction (or the bound of max_changes did not)
    assert sum(changes) == 202
    assert_mirror_exact(admin, pipeline, spark)
    assert_driver_memory_bounded(rss)
    print(f"big values: driver peak RSS {rss}; batches {changes}; phases {[r.phase_seconds for r in reports]}")


def test_snapshot_chunk_of_big_rows_is_read_and_reconciled_with_bounded_memory(source, spark) -> None:
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    admin.execute(
        "insert into blobs (id, label, body) "
        "select g, 'row ' || g, repeat(md5(g::text), 5 * 1024 * 1024 / 32) from generate_series(1, 120) g"
    )  # 600 MB of values in one chunk (chunk_size 1000)
    tables = pipeline.prepare()
    table = tables["public.blobs"]
    assert len(pipeline.plan(table).chunks) == 1
    with peak_rss(spark) as rss:
        pipeline.snapshot(spark, table, [0], "big")
        _, reports = catch_up(pipeline, spark, None)
    assert sum(len(r.reconciled) for r in reports) == 1
    assert_mirror_exact(admin, pipeline, spark)
    assert_driver_memory_bounded(rss)
    print(f"big snapshot chunk: driver peak RSS {rss}")


def test_a_failing_batch_is_retried_smaller_and_the_stream_goes_on(source, spark, monkeypatch) -> None:
    admin, config = source
    settings = config.sources[0].stream
    config = pipeline_config(DATABASE, config.lake_root, chunk_size=1000)
    stream_settings = StreamConfig(**{**settings.__dict__, "max_changes": 1000, "max_batch_bytes": 64 * MB})
    config = CdcConfig(config.lake_root, config.spark, (config.sources[0].__class__(
        **{**config.sources[0].__dict__, "stream": stream_settings}),))  # fmt: skip
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    for start in range(0, 120, 10):  # 12 transactions of 10 inserts
        admin.execute(
            "insert into blobs (id, label) select g, 'row ' || g from generate_series(%s::int, %s::int) g",
            [start, start + 9],
        )
    monkeypatch.setenv("CDC_FAULTS", "stream.batch_over=60")
    recorded = None
    failures: list[str] = []
    sizes: list[int] = []
    shrunk_reasons: list[str] = []
    for _ in range(40):
        try:
            report = pipeline.stream_batch(spark, recorded, "shrink")
        except StreamBatchError as error:
            failures.append(str(error))
            continue
        recorded = report.offset
        pipeline.acknowledge(recorded)
        sizes.append(report.changes)
        if report.bounds["shrunk"]:
            shrunk_reasons.append(str(report.bounds["reason"]))
        if report.changes == 0:
            break
    # 120 changes > 60: fails; then at most 60 (half of what it held; the slot's rows count begin and commit too):
    # passes; the bounds double after each cut batch that passed, halve after each failure
    assert len(failures) >= 1
    first = failures[0]
    assert "failed in phase changelog" in first and "120 changes" in first and "stream.max_batch_bytes" in first
    assert "spark.driver.memory" in first and "at most 60 changes" in first
    assert sum(sizes) == 120 and max(sizes) <= 60
    assert shrunk_reasons and all("stream.batch_over" in reason for reason in shrunk_reasons)
    # the last batch read everything there was: the bounds are the configured ones again
    assert pipeline.batch_bounds() == pipeline.configured_bounds()
    monkeypatch.delenv("CDC_FAULTS")
    admin.execute("insert into blobs (id, label) select g, 'row ' || g from generate_series(500, 509) g")
    catch_up(pipeline, spark, recorded)
    assert_mirror_exact(admin, pipeline, spark)


def test_a_batch_re_read_smaller_after_two_kills_appends_no_change_twice(source, spark) -> None:
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    for start in range(0, 100, 10):  # 10 transactions of 10 inserts
        admin.execute(
            "insert into blobs (id, label) select g, 'row ' || g from generate_series(%s::int, %s::int) g",
            [start, start + 9],
        )
    # a batch applied to the lake whose process died before its offset was recorded: the slot did not move, and
    # the bounds file still marks it in flight (what SIGKILL after the lake commit leaves)
    killed = pipeline.stream_batch(spark, None, "killed")
    assert killed.changes == 100
    first_death = with_in_flight(pipeline.batch_bounds(), killed.changes, killed.bytes)
    pipeline.store_bounds(first_death)
    # one death may be an operator's kill: the same batch once more, at the same bounds
    again = pipeline.stream_batch(spark, None, "again")
    assert again.changes == 100 and not again.bounds["shrunk"] and again.bounds["failures"] == 1
    # it died too, after its lake commit: it leaves its own in-flight record, made from the bounds it read with
    pipeline.store_bounds(with_in_flight(recover_in_flight(first_death), again.changes, again.bytes))
    smaller = pipeline.stream_batch(spark, None, "rerun")  # re-reads from the same slot position, half as much
    assert smaller.bounds["shrunk"] and 0 < smaller.changes <= 50
    recorded = smaller.offset
    pipeline.acknowledge(recorded)
    catch_up(pipeline, spark, recorded)
    changelog = spark.read.format("delta").load(pipeline.lake.table("public.blobs").changelog)
    assert changelog.count() == 100  # a commit of the smaller batch's lower offset: its successor appends twice
    assert changelog.select("_cdc_commit_lsn", "_cdc_seq").distinct().count() == 100
    assert_mirror_exact(admin, pipeline, spark)
