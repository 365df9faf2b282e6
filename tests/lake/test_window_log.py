"""The window log (``cdc_assets.lake.windows``) on a real Delta table: the low watermark is the source's text, kept as
it was given; a log written before that (PostgreSQL's ``xmin``/``xmax``/``xip`` columns, no ``low_watermark``) is
read as the same snapshot's text, and the first new record adds the column without losing an old row."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from delta.tables import DeltaTable
from pyspark.sql import types as T

from cdc_assets.engine.windows import RECONCILED, STAGED, ChunkWindow, open_windows
from cdc_assets.lake import windows as window_log

AT = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
OLD_SCHEMA = T.StructType(
    [
        *[
            T.StructField(n, t)
            for n, t in (
                ("table", T.StringType()),
                ("chunk", T.IntegerType()),
                ("attempt", T.StringType()),
                ("event", T.StringType()),
            )
        ],
        T.StructField("lw_lsn", T.LongType()),
        T.StructField("xmin", T.LongType()),
        T.StructField("xmax", T.LongType()),
        T.StructField("xip", T.ArrayType(T.LongType())),
        *[T.StructField(n, T.LongType()) for n in ("hw", "rows", "kept", "dropped", "deleted")],
        T.StructField("at", T.TimestampType()),
    ]
)  # the window log's schema before the low watermark became the source's text


def test_a_log_of_before_the_text_column_reads_as_postgres_text_and_takes_new_rows(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "windows")
    old_row = ("public.t", 0, "a-old", STAGED, 90, 100, 110, [103, 105], 500, 7, None, None, None, AT)
    spark.createDataFrame([old_row], OLD_SCHEMA).write.format("delta").save(path)
    opaque = 'any text a source gives: {"token": "8263A1"}'
    new = ChunkWindow("public.t", 1, "a-new", 95, opaque, 600, 3, AT)
    window_log.record(spark, path, STAGED, [new])
    events = {e.window.attempt: e.window for e in window_log.read_events(spark, path)}
    assert events["a-old"].low_watermark == "100:110:103,105"
    assert (events["a-old"].hw, events["a-old"].rows, events["a-old"].lw_lsn) == (500, 7, 90)
    assert replace(events["a-new"], at=AT) == new  # Spark returns the timestamp without its zone
    assert [w.attempt for w in open_windows(window_log.read_events(spark, path))] == ["a-old", "a-new"]


def test_staged_files_are_events_until_folded_into_the_table_once(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "windows")
    assert window_log.read_events(spark, path) == [] and window_log.fold_staged(spark, path) == (0, [])
    first = [ChunkWindow("public.t", c, "run1-a", 90, "100:110:", 500 + c, 7, AT) for c in (0, 1)]
    second = [ChunkWindow("public.t", 0, "run2-b", 95, "101:111:", 600, 8, AT.replace(hour=13))]
    window_log.record_staged(path, first)  # two snapshot runs, each its own file: nothing shared is written
    window_log.record_staged(path, second)
    assert len(window_log.staged_folder(path).glob("*.json")) == 2
    events = window_log.read_events(spark, path)
    assert sorted((e.event, e.window.chunk, e.window.attempt) for e in events) == [
        (STAGED, 0, "run1-a"), (STAGED, 0, "run2-b"), (STAGED, 1, "run1-a")
    ]  # fmt: skip
    assert [(w.chunk, w.attempt) for w in open_windows(events)] == [(0, "run2-b"), (1, "run1-a")]
    by_attempt = {(e.window.attempt, e.window.chunk): e.window for e in events}
    assert replace(by_attempt[("run1-a", 1)], at=AT) == first[1]
    assert by_attempt[("run1-a", 1)].at.tzinfo is None  # as Spark returns the table's timestamps
    # the stream folds them into the table: read again, the same events, once, and from the table
    appended, after_fold = window_log.fold_staged(spark, path)
    assert appended == 3 and sorted(after_fold, key=repr) == sorted(events, key=repr)  # the events, from one read
    assert window_log.staged_folder(path).glob("*.json") == []
    folded = window_log.read_events(spark, path)
    assert sorted((e.window.chunk, e.window.attempt, e.window.at) for e in folded) == sorted(
        (e.window.chunk, e.window.attempt, e.window.at) for e in events
    )
    assert spark.read.format("delta").load(path).count() == 3
    # a run killed after the fold's append, before its deletes: the file's events are read once, appended never again
    window_log.record_staged(path, second)
    assert len(window_log.read_events(spark, path)) == 3
    assert window_log.fold_staged(spark, path)[0] == 0 and window_log.staged_folder(path).glob("*.json") == []
    assert spark.read.format("delta").load(path).count() == 3


def test_the_reconciliation_folds_staged_events_into_its_own_record(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "windows")
    staged = [ChunkWindow("public.t", c, "run1-a", 90, "100:110:", 500, 7, AT) for c in (0, 1)]
    window_log.record_staged(path, staged)
    pending = window_log.pending_staged(spark, path)
    assert [(w.chunk, w.attempt) for w in pending.new] == [(0, "run1-a"), (1, "run1-a")]
    assert not DeltaTable.isDeltaTable(spark, path)  # nothing written by the read
    # chunk 0 reconciled: its record carries both staged events, in one commit
    window_log.record(spark, path, RECONCILED, [staged[0]], {("public.t", 0): (7, 0, 0)}, staged=pending.new)
    pending.drop_files()
    assert window_log.staged_folder(path).glob("*.json") == []
    assert DeltaTable.forPath(spark, path).history().count() == 1
    rows = sorted((r["event"], r["chunk"], r["kept"]) for r in spark.read.format("delta").load(path).collect())
    assert rows == [(RECONCILED, 0, 7), (STAGED, 0, None), (STAGED, 1, None)]
    events = window_log.read_events(spark, path)
    assert [(w.chunk, w.attempt) for w in open_windows(events)] == [(1, "run1-a")]
    assert window_log.pending_staged(spark, path).new == []
