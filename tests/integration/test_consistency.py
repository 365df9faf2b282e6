"""Per-chunk consistency checks: no false alarm under concurrent writes (nor for a commit held at the check's low
watermark); drift is found in the right chunk and repaired by re-materializing that chunk; the keys a check leaves
out are those of one changelog version however the stream appends meanwhile."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F
from pyspark.sql.types import LongType

from cdc_assets.consistency import _touched_keys
from cdc_assets.sources.postgres.consistency import PostgresCheckSession
from cdc_assets.sources.postgres.pipeline import SETTLED_RULE, PostgresPipeline
from cdc_assets.sources.postgres.snapshot import take_low_watermark
from tests.integration.support import (
    commit_held_by_absent_standby,
    mirror_rows,
    pipeline_config,
    seeded_source,
    source_rows,
)
from tests.integration.test_pipeline_guarantees import Writer, catch_up, stream_once

DATABASE = "pipe_checks"


class Streamer(threading.Thread):
    """The stream running beside the checks, one batch at a time, as the streaming sensor runs it."""

    def __init__(self, pipeline: PostgresPipeline, spark, recorded: int | None) -> None:
        super().__init__(daemon=True)
        self.pipeline, self.spark, self.recorded = pipeline, spark, recorded
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.recorded, _ = stream_once(self.pipeline, self.spark, self.recorded)
                time.sleep(0.5)
        except BaseException as error:
            self.error = error

    def finish(self) -> int | None:
        self.stop.set()
        self.join(300)
        assert self.error is None, self.error
        return self.recorded


def not_matching(results: dict) -> list[str]:
    """The results that are not a conclusive match, in full (a dict of all would be cut short in the report)."""
    return [repr(r) for r in results.values() if not (r.conclusive and r.matches)]


def check_all(pipeline: PostgresPipeline, spark, table, chunks: int, recorded: int | None) -> tuple[dict, int | None]:
    """Every chunk checked in one window (``check_chunks``) while the stream runs; inconclusive results (the stream
    is behind the check's window) are retried, never an alarm."""
    streamer = Streamer(pipeline, spark, recorded)
    streamer.start()
    try:
        results: dict = {}
        pending = list(range(chunks))
        for _ in range(4):
            for result in pipeline.check_chunks(spark, table, pending, wait_seconds=120):
                results[result.chunk] = result
            pending = [i for i in pending if not results[i].conclusive]
            if not pending:
                break
    finally:
        recorded = streamer.finish()
    return results, recorded


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path):
    with seeded_source(postgres_server, DATABASE) as (admin, admin_dsn):
        admin.execute("delete from items where id = 100000")  # dense keys: the even split gives chunks that hold rows
        yield admin_dsn, pipeline_config(DATABASE, tmp_path / "lake", chunk_size=500)


def test_checks_find_drift_in_the_right_chunk_and_resnapshot_repairs_it(source, spark, monkeypatch) -> None:
    admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    items = pipeline.prepare()["public.items"]
    chunks = len(pipeline.plan(items).chunks)
    assert chunks >= 4
    pipeline.snapshot(spark, items, list(range(chunks)), "initial")
    recorded = catch_up(pipeline, spark, None)

    # concurrent writes around the checks' window (before its low watermark, between its reads, after its high
    # watermark): no false alarm. The writer stops a few seconds after the window closed, so the stream the check
    # waits for has a bounded backlog (a writer going on through the wait made the stream's target move: the check
    # then retried for minutes on a busy machine without testing more)
    writer = Writer(f"{admin_dsn} dbname={DATABASE}", seed=3)
    window_closed = threading.Event()
    take_high_watermark = PostgresCheckSession.high_watermark

    def high_watermark(session: PostgresCheckSession) -> int:
        position = take_high_watermark(session)
        window_closed.set()
        return position

    def stop_writer_after_the_window() -> None:
        window_closed.wait(600)
        time.sleep(3)
        writer.stop.set()

    monkeypatch.setattr(PostgresCheckSession, "high_watermark", high_watermark)
    stopper = threading.Thread(target=stop_writer_after_the_window, daemon=True)
    writer.start()
    stopper.start()
    try:
        results, recorded = check_all(pipeline, spark, items, chunks, recorded)
    finally:
        writer.stop.set()
        writer.join(30)
    assert writer.error is None
    assert window_closed.is_set() and writer.done > 0
    assert not not_matching(results), not_matching(results)
    recorded = catch_up(pipeline, spark, recorded)

    # drift: a changed row in chunk 1, a deleted row in chunk 2, a phantom row in chunk 3
    plan = pipeline.plan(items)
    mirror = DeltaTable.forPath(spark, pipeline.lake.table("public.items").mirror)
    frame = spark.read.format("delta").load(pipeline.lake.table("public.items").mirror)

    def bounds(index: int) -> tuple[int | None, int | None]:
        """The chunk's key range; the first chunk has no lower and the last no upper bound."""
        chunk = plan.chunks[index]
        return (
            None if chunk.lo is None else int(chunk.lo[0]),
            None if chunk.hi is None else int(chunk.hi[0]),
        )

    def ids_in(index: int) -> list[int]:
        lo, hi = bounds(index)
        rows = frame
        if lo is not None:
            rows = rows.where(F.col("id") >= lo)
        if hi is not None:
            rows = rows.where(F.col("id") < hi)
        return sorted(r.id for r in rows.select("id").collect())

    changed, deleted = ids_in(1)[0], ids_in(2)[0]
    present = set(ids_in(3))
    lo3, hi3 = bounds(3)
    candidates = range(lo3, hi3) if hi3 is not None else range(max(present) + 1, max(present) + 1_000_000)
    phantom_id = next(i for i in candidates if i not in present)
    mirror.update(F.col("id") == changed, {"name": F.lit("tampered")})
    mirror.delete(F.col("id") == deleted)
    row = spark.read.format("delta").load(pipeline.lake.table("public.items").mirror).where(f"id = {changed}")
    row.withColumn("id", F.lit(phantom_id).cast("long")).withColumn("name", F.lit("phantom")).write.format(
        "delta"
    ).mode("append").save(pipeline.lake.table("public.items").mirror)
    results, recorded = check_all(pipeline, spark, items, chunks, recorded)
    failing = sorted(i for i, r in results.items() if not r.matches)
    assert failing == [1, 2, 3], {i: r.first_difference for i, r in results.items()}
    assert f"id={changed}" in results[1].first_difference and "tampered" in results[1].first_difference
    assert f"id={deleted}" in results[2].first_difference and "mirror=absent" in results[2].first_difference
    assert "phantom" in results[3].first_difference

    # repair: re-materialize the failing partitions (a new window each), then the stream reconciles them: the mirror
    # equals the source row by row (a third round of checks after it cost 20-60 s and proved less)
    pipeline.snapshot(spark, items, failing, "repair")
    catch_up(pipeline, spark, recorded)
    repaired = mirror_rows(spark, pipeline.lake.table("public.items").mirror, items)
    expected = source_rows(config.sources[0], items)
    assert repaired == expected, sorted(repaired ^ expected, key=str)[:3]


def test_commit_held_at_the_check_low_watermark_is_no_false_alarm(source, spark) -> None:
    """A transaction in the check's ``xip`` whose commit record precedes the low watermark (held by a synchronous
    standby): the source side cannot see it, the stream applies it; its key is left out on both sides."""
    admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    items = pipeline.prepare()["public.items"]
    pipeline.snapshot(spark, items, [0], "initial")
    recorded = catch_up(pipeline, spark, None)
    with commit_held_by_absent_standby(admin_dsn, DATABASE, "update items set name = 'held commit' where id = 7"):
        results, recorded = check_all(pipeline, spark, items, 1, recorded)
    assert not not_matching(results), not_matching(results)
    assert results[0].excluded_keys >= 1
    recorded = catch_up(pipeline, spark, recorded)
    results, _ = check_all(pipeline, spark, items, 1, recorded)
    assert not not_matching(results), not_matching(results)


def test_left_out_keys_are_those_of_one_changelog_version_while_the_stream_appends(source, spark) -> None:
    """The check evaluates its left-out keys several times (source list, mirror anti-join, first difference): all
    must see one changelog version although the stream appends meanwhile (a Delta frame, cached or not, would
    see the appends)."""
    admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    recorded = catch_up(pipeline, spark, None)
    with pipeline.connect() as conn:
        low_watermark = take_low_watermark(conn)
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        admin.execute("set synchronous_commit = on")  # the test cluster's default is off: catch_up needs the flush
        admin.execute("update items set qty = 1 where id = 1")
        recorded = catch_up(pipeline, spark, recorded)
        touched = _touched_keys(
            spark, pipeline.lake.table("public.items"), SETTLED_RULE, low_watermark.text(), ["id"], {"id": LongType()}
        )
        assert touched is not None
        touched = touched.cache()
        first = sorted(r.id for r in touched.collect())
        admin.execute("update items set qty = 2 where id = 2")
        catch_up(pipeline, spark, recorded)
        again = sorted(r.id for r in touched.collect())
    assert first == again == [1]


def test_columns_added_after_the_run_described_the_table_are_checked_and_a_default_is_repaired(source, spark) -> None:
    """The check compares the columns the table has at its low watermark, not those the run described: a column
    added without a default, that no write has brought to the mirror yet, matches (NULL on both sides); one added
    with a ``DEFAULT``, which no change carries to rows written before it (docs/known-limits.md), is reported for
    every chunk holding such rows, and re-materializing those chunks (a run that described the table before the
    column existed) repairs them."""
    admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    items = pipeline.prepare()["public.items"]  # described before both columns exist
    chunks = len(pipeline.plan(items).chunks)
    pipeline.snapshot(spark, items, list(range(chunks)), "initial")
    recorded = catch_up(pipeline, spark, None)
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        admin.execute("alter table items add column plain integer")
    results, recorded = check_all(pipeline, spark, items, chunks, recorded)
    assert not not_matching(results), not_matching(results)

    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        admin.execute("alter table items add column tier text not null default 'on'")
        holding_rows = {
            i for i, chunk in enumerate(pipeline.plan(items).chunks)
            if admin.execute(
                "select exists (select from items where id >= %s and id < %s)",
                [int(chunk.lo[0]) if chunk.lo else -(2**62), int(chunk.hi[0]) if chunk.hi else 2**62],
            ).fetchone()[0]
        }  # fmt: skip
    results, recorded = check_all(pipeline, spark, items, chunks, recorded)
    failing = sorted(i for i, r in results.items() if r.conclusive and not r.matches)
    assert failing == sorted(holding_rows), not_matching(results)
    assert all("differing columns: tier" in (results[i].first_difference or "") for i in failing), not_matching(results)

    pipeline.snapshot(spark, items, failing, "repair")
    recorded = catch_up(pipeline, spark, recorded)
    results, _ = check_all(pipeline, spark, items, chunks, recorded)
    assert not not_matching(results), not_matching(results)


def test_a_check_on_an_idle_source_is_conclusive_with_the_stream_as_deployed(source, spark) -> None:
    """The stream as deployed runs a batch only when ``pending_work`` says one is due. On a source nobody writes to
    (the daily sweep at night), the server's WAL still moves (other databases, checkpoints, snapshots of running
    transactions), so the check's high watermark is ahead of the slot and no change is waiting: the check must ask
    for a batch, as a staged chunk does, and be conclusive."""
    admin_dsn, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    items = pipeline.prepare()["public.items"]
    pipeline.snapshot(spark, items, [0], "initial")
    recorded = catch_up(pipeline, spark, None)
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:  # WAL no publication holds
        admin.execute("create table unpublished_noise (x int)")
        admin.execute("insert into unpublished_noise select generate_series(1, 1000)")
    assert pipeline.pending_work() is None
    stop = threading.Event()
    batches: list[str] = []

    def stream_when_due() -> None:
        nonlocal recorded
        while not stop.is_set():
            reason = pipeline.pending_work()
            if reason is not None:
                batches.append(reason)
                recorded, _ = stream_once(pipeline, spark, recorded)
            time.sleep(0.5)

    streamer = threading.Thread(target=stream_when_due, daemon=True)
    streamer.start()
    try:
        [result] = pipeline.check_chunks(spark, items, [0], wait_seconds=45)
    finally:
        stop.set()
        streamer.join(120)
    assert result.conclusive and result.matches, (result, batches)
    assert "a consistency check waits for the stream" in batches, batches
