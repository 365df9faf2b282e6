"""The source's chunk window log, an append-only Delta table (``SourceLake.windows``).

Contract: ``record(spark, path, event, windows, counts)`` appends one event row per window (blind appends: parallel
snapshot runs never conflict, a lost creation race is retried); ``read_events(spark, path)`` returns every event
as ``WindowEvent``s for ``cdc_assets.engine.windows``. Rows carry the low watermark (``low_watermark``: the source's
text of it; ``lw_lsn``: the position taken just before it), the high watermark, the chunk's staged row count, and for
``reconciled`` the kept/dropped/deleted counts. Logs written before the low watermark became the source's text hold
PostgreSQL's snapshot as ``xmin``, ``xmax``, ``xip`` (then the only source kind): read as that snapshot's text; new
rows leave those columns out (NULL in such a log), and the first new append adds ``low_watermark`` (schema merge).
"""

from __future__ import annotations

from datetime import UTC, datetime

from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_assets.engine.windows import ChunkWindow, WindowEvent
from cdc_assets.lake.delta_tables import is_missing_table
from cdc_assets.lake.retry import commit_with_retry

SCHEMA = T.StructType(
    [
        T.StructField("table", T.StringType()),
        T.StructField("chunk", T.IntegerType()),
        T.StructField("attempt", T.StringType()),
        T.StructField("event", T.StringType()),
        T.StructField("lw_lsn", T.LongType()),
        T.StructField("hw", T.LongType()),
        T.StructField("rows", T.LongType()),
        T.StructField("kept", T.LongType()),
        T.StructField("dropped", T.LongType()),
        T.StructField("deleted", T.LongType()),
        T.StructField("at", T.TimestampType()),
        T.StructField("low_watermark", T.StringType()),
    ]
)


def record(
    spark: SparkSession,
    path: str,
    event: str,
    windows: list[ChunkWindow],
    counts: dict[tuple[str, int], tuple[int, int, int]] | None = None,
) -> None:
    if not windows:
        return
    now = datetime.now(UTC)
    rows = []
    for w in windows:
        kept, dropped, deleted = (counts or {}).get((w.table, w.chunk), (None, None, None))
        rows.append(
            (w.table, w.chunk, w.attempt, event, w.lw_lsn, w.hw, w.rows,
             kept, dropped, deleted, w.at if event == "staged" else now, w.low_watermark)
        )  # fmt: skip
    frame = spark.createDataFrame(rows, SCHEMA)
    writer = frame.write.format("delta").mode("append").option("mergeSchema", "true")
    commit_with_retry(lambda: writer.save(path), f"window log {path}")


def _low_watermark(row: dict[str, object]) -> str:
    text = row.get("low_watermark")
    if isinstance(text, str):
        return text
    xip = ",".join(str(x) for x in sorted(row["xip"] or ()))  # a log written before: PostgreSQL's snapshot columns
    return f"{row['xmin']}:{row['xmax']}:{xip}"


def read_events(spark: SparkSession, path: str) -> list[WindowEvent]:
    """Every window event; none when the log does not exist yet (read, not probed: see
    ``cdc_assets.lake.delta_tables``)."""
    try:
        rows = spark.read.format("delta").load(path).collect()
    except AnalysisException as error:
        if is_missing_table(error):
            return []
        raise
    events = []
    for r in rows:
        window = ChunkWindow(
            table=r["table"],
            chunk=r["chunk"],
            attempt=r["attempt"],
            lw_lsn=r["lw_lsn"],
            low_watermark=_low_watermark(r.asDict()),
            hw=r["hw"],
            rows=r["rows"] or 0,
            at=r["at"],
        )
        events.append(WindowEvent(r["event"], window))
    return events
