"""The window log (``cdc_assets.lake.windows``) on a real Delta table: the low watermark is the source's text, kept as
it was given; a log written before that (PostgreSQL's ``xmin``/``xmax``/``xip`` columns, no ``low_watermark``) is
read as the same snapshot's text, and the first new record adds the column without losing an old row."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from pyspark.sql import types as T

from cdc_assets.engine.windows import STAGED, ChunkWindow, open_windows
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
