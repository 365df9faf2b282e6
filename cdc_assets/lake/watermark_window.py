"""One watermark window, written once for every source kind (DESIGN.md; Flink CDC's ``AbstractScanFetchTask``).

Contract: ``run_window(spark, lake, table, chunks, attempt, watermarks, read)``:
1. ``watermarks.low_watermark()``: the source's position just before it (for diagnosis, and for the re-snapshot
   rule after lost history: ``engine.windows.read_before``) and the low watermark's text (opaque here; the source's
   ``SettledRule`` reads it, ``cdc_assets.lake.settled``). Every read of step 2 starts after both.
2. ``read(start)`` stages the rows of ``chunks`` under ``attempt`` (``cdc_assets.lake.staging``) and returns the
   rows staged per chunk; it returns when every read has finished. ``start`` (``WindowStart``: the position of step 1
   and the time it was taken) is what a chunk's staged rows carry as the mirror's row columns.
3. ``watermarks.high_watermark()``: a position of the change stream taken after every read finished.
4. Fault point ``snapshot.before_window_record``, then one ``staged`` event per chunk in the window log (a file of
   the run's own, ``cdc_assets.lake.windows.record_staged``: snapshot runs run in parallel, in no pool), and each
   chunk marked waiting (``SourceLake.mark_waiting``, after fault point ``snapshot.before_waiting_markers``) for the
   stream, which reconciles the window once it has passed the high watermark. A run killed before step 4 leaves
   staged rows that no window names: never read, and dropped by the upkeep after a day
   (``cdc_assets.engine.windows.unrecorded_attempts``). A run killed between the record and the markers leaves a
   recorded window with no marker: the staged file asks for the stream batch itself (``CdcPipeline.pending_work``
   reads the staged files' high watermarks too), and that batch folds it and marks it waiting if still open.
Returns the recorded windows. Used for a snapshot's chunks, a fill window (chunk ``FILL_CHUNK``) and an ad-hoc
snapshot of chosen rows (chunk ``ROWS_CHUNK``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Protocol

from pyspark.sql import SparkSession

from cdc_assets.engine.faults import fault_point
from cdc_assets.engine.windows import ChunkWindow, WindowStart
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.layout import SourceLake


class Watermarks(Protocol):
    """The source's two watermarks of one window, taken on the session the reads are ordered against."""

    def low_watermark(self) -> tuple[int, str]: ...

    def high_watermark(self) -> int: ...


def run_window(
    spark: SparkSession,
    lake: SourceLake,
    table: str,
    chunks: Sequence[int],
    attempt: str,
    watermarks: Watermarks,
    read: Callable[[WindowStart], dict[int, int]],
) -> list[ChunkWindow]:
    low_position, low_watermark = watermarks.low_watermark()
    counts = read(WindowStart(low_position, datetime.now(UTC)))
    high_watermark = watermarks.high_watermark()
    fault_point("snapshot.before_window_record")
    now = datetime.now(UTC)
    windows = [
        ChunkWindow(table, chunk, attempt, low_position, low_watermark, high_watermark, counts.get(chunk, 0), now)
        for chunk in chunks
    ]
    window_log.record_staged(lake.windows, windows)  # a file of its own: snapshot runs write in parallel
    fault_point("snapshot.before_waiting_markers")
    for window in windows:
        lake.mark_waiting(window.table, window.chunk, window.hw)
    return windows
