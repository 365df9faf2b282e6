"""The source's chunk window log: an append-only Delta table (``SourceLake.windows``) written by one writer at a
time, and the staged events of snapshot runs as files beside it.

Contract:
- ``record(spark, path, event, windows, counts, staged)`` appends one event row per window to the Delta table (a lost
  creation race is retried), and in the same commit a ``staged`` row per window of ``staged`` (the folded events of
  ``pending_staged``, below); its files carry no statistics (the log is read whole). Only the source's lake-write
  pool writes it (the stream's reconciliation, the snapshot_rows job): one writer at a time, as Delta's S3 log store
  needs (it makes one driver's commits safe, not two drivers' commits of the same version, which both PUT it: one
  commit would vanish).
- ``record_staged(path, windows)`` is how a snapshot run, in no pool, records its staged windows: one new file per
  call, ``<path>-staged/<attempt>.<random>.json`` (written whole or not at all, on every store; no two runs write
  the same name), so parallel snapshot runs never write the same object, on a local disk or an object store.
- ``staged_high_watermarks(path)`` returns the high watermarks of the staged files' windows, without Spark (plain
  files: cheap enough for the streaming sensor's ``pending_work``). A file is there from its run's record until the
  next stream batch folds it, whether or not its run lived to mark its chunks waiting.
- ``read_events(spark, path)`` returns every event: the Delta table's rows and the staged files' windows, each event
  (event, table, chunk, attempt) once, as ``WindowEvent``s for ``cdc_assets.engine.windows``; a staged file's time is
  returned as Spark returns the table's (naive, the process's local time), so both compare.
- ``fold_staged(spark, path)`` appends the staged files' events that the table lacks as ``staged`` rows, then
  deletes the files; it returns the number of events appended and every event (what ``read_events`` returns after
  it, from the same one read). The stream's reconciliation (in the pool) does the same in steps, to save a commit:
  ``pending_staged(spark, path)`` reads them (``PendingStaged``: the windows the table lacks, every event, the
  files), the first ``record`` of the batch's reconciled windows appends them in its commit (or one of their own when
  nothing was reconciled), then ``PendingStaged.drop_files()``. A run killed before the deletes leaves files whose
  events may be in the table already: read once (above), and deleted by the next fold.

Rows carry the low watermark (``low_watermark``: the source's text of it; ``lw_lsn``: the position taken just before
it), the high watermark, the chunk's staged row count, and for ``reconciled`` the kept/dropped/deleted counts. Logs
written before the low watermark became the source's text hold PostgreSQL's snapshot as ``xmin``, ``xmax``, ``xip``
(then the only source kind): read as that snapshot's text; new rows leave those columns out (NULL in such a log),
and the first new append adds ``low_watermark`` (schema merge).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_assets.engine.windows import STAGED, ChunkWindow, WindowEvent
from cdc_assets.lake.delta_tables import is_missing_table
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.retry import commit_with_retry
from cdc_assets.lake.spark import session_conf

COLLECT_STATISTICS = "spark.databricks.delta.stats.collect"

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
    staged: Sequence[ChunkWindow] = (),
) -> None:
    if not windows and not staged:
        return
    now = datetime.now(UTC)
    rows = []
    for kind, w in [*((STAGED, w) for w in staged), *((event, w) for w in windows)]:
        kept, dropped, deleted = (
            (counts or {}).get((w.table, w.chunk), (None, None, None)) if kind == event else (None,) * 3
        )
        rows.append(
            (w.table, w.chunk, w.attempt, kind, w.lw_lsn, w.hw, w.rows,
             kept, dropped, deleted, w.at if kind == STAGED else now, w.low_watermark)
        )  # fmt: skip
    frame = spark.createDataFrame(rows, SCHEMA)
    writer = frame.write.format("delta").mode("append").option("mergeSchema", "true")
    # no file statistics: the log is read whole, and collecting them compiled code for every first append of a
    # process (a first reconciliation's record: 2.7 s with them, 1.4 s without)
    with session_conf(spark, {COLLECT_STATISTICS: "false"}):
        commit_with_retry(lambda: writer.save(path), f"window log {path}")


def _low_watermark(row: dict[str, object]) -> str:
    text = row.get("low_watermark")
    if isinstance(text, str):
        return text
    xip = ",".join(str(x) for x in sorted(row["xip"] or ()))  # a log written before: PostgreSQL's snapshot columns
    return f"{row['xmin']}:{row['xmax']}:{xip}"


def staged_folder(path: str) -> LakePath:
    """The folder of the staged-event files beside the log at ``path``."""
    log = LakePath(path)
    return log.with_name(f"{log.name}-staged")


def record_staged(path: str, windows: list[ChunkWindow]) -> None:
    if not windows:
        return
    attempt = windows[0].attempt  # an attempt id is a file name's letters (cdc_assets.lake.staging)
    data = [
        {
            "table": w.table, "chunk": w.chunk, "attempt": w.attempt, "lw_lsn": w.lw_lsn,
            "low_watermark": w.low_watermark, "hw": w.hw, "rows": w.rows, "at": w.at.astimezone(UTC).isoformat(),
        }
        for w in windows
    ]  # fmt: skip
    (staged_folder(path) / f"{attempt}.{uuid.uuid4().hex[:8]}.json").write_text(json.dumps(data))


def _staged_files(path: str) -> list[tuple[LakePath, list[WindowEvent]]]:
    files = []
    for entry in staged_folder(path).glob("*.json"):
        try:
            data = json.loads(entry.path.read_text())
        except FileNotFoundError:  # folded and deleted meanwhile: its events are in the table now
            continue
        windows = [
            ChunkWindow(
                table=w["table"], chunk=int(w["chunk"]), attempt=w["attempt"], lw_lsn=int(w["lw_lsn"]),
                low_watermark=w["low_watermark"], hw=int(w["hw"]), rows=int(w["rows"]),
                at=datetime.fromisoformat(w["at"]).astimezone().replace(tzinfo=None),  # as Spark returns a timestamp
            )
            for w in data
        ]  # fmt: skip
        files.append((entry.path, [WindowEvent(STAGED, w) for w in windows]))
    return files


def staged_high_watermarks(path: str) -> list[int]:
    """The high watermark of every window in the staged files (not yet folded into the table)."""
    return [item.window.hw for _, staged in _staged_files(path) for item in staged]


def _event_key(item: WindowEvent) -> tuple[str, str, int, str]:
    return item.event, item.window.table, item.window.chunk, item.window.attempt


def read_events(spark: SparkSession, path: str) -> list[WindowEvent]:
    """Every window event (the table's, then the staged files' it lacks); none when nothing was recorded yet (the
    table is read, not probed: see ``cdc_assets.lake.delta_tables``)."""
    table = _table_events(spark, path)
    return table + _not_in(table, _staged_files(path))


def _not_in(table: list[WindowEvent], files: list[tuple[LakePath, list[WindowEvent]]]) -> list[WindowEvent]:
    """The staged files' events that ``table`` lacks, each once."""
    known = {_event_key(e) for e in table}
    new = []
    for _, staged in files:
        for item in staged:
            if _event_key(item) not in known:
                known.add(_event_key(item))
                new.append(item)
    return new


@dataclass(frozen=True)
class PendingStaged:
    new: list[ChunkWindow]  # staged windows of the files that the table lacks
    events: list[WindowEvent]  # every event: the table's, then those
    files: list[LakePath]

    def drop_files(self) -> None:
        for file in self.files:
            file.unlink()


def pending_staged(spark: SparkSession, path: str) -> PendingStaged:
    files = _staged_files(path)
    table = _table_events(spark, path)
    new = _not_in(table, files)
    return PendingStaged([item.window for item in new], table + new, [file for file, _ in files])


def fold_staged(spark: SparkSession, path: str) -> tuple[int, list[WindowEvent]]:
    """Move the staged files' events into the table (see the module's contract); the number of events appended and
    every event."""
    pending = pending_staged(spark, path)
    record(spark, path, STAGED, pending.new)  # nothing when there is nothing new
    pending.drop_files()
    return len(pending.new), pending.events


def _table_events(spark: SparkSession, path: str) -> list[WindowEvent]:
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
