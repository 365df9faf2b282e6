"""Upkeep of one captured table's lake folders: what a long-running stream needs so the lake does not grow without
bound. The Delta steps are Delta's own operations; none changes what a reader of the latest version sees.

Contract:
- Staged attempts are dropped with ``cdc_assets.lake.staging.drop_attempts`` (their folders are deleted): the
  finished ones (``cdc_assets.engine.windows.finished_attempts``), whose rows no reconciliation reads again, and
  the unrecorded ones older than the grace below.
- ``compact(spark, path, target_bytes)``: Delta ``OPTIMIZE`` (bin-packing) of the files smaller than
  ``target_bytes`` into files of about ``target_bytes``; files whose deletion vectors hide more than Delta's
  ``optimize.maxDeletedRowsRatio`` of their rows are rewritten too. The commit has ``dataChange=false``: no Change
  Data Feed rows, and streaming readers of the table skip it. Returns files removed and added.
- ``vacuum(spark, path)``: Delta ``VACUUM`` with the table's retention (``delta.deletedFileRetentionDuration``:
  Delta's default of 7 days for the mirror, the changelog and the window log unless a user sets it). Files
  younger than that stay, so readers of recent versions and writes in progress are safe. Returns the number of
  files deleted. It costs a few Spark jobs (about 3-4 s per table on 2 cores, even with nothing to delete), and
  files only become deletable days after they were removed, so it is a separate, rarer step.
- ``maintain_lake(spark, lake, tables, target_bytes, steps, unrecorded_grace)`` does the ``steps`` for a source:
  ``"compact"``: for each table, drop the staged rows of finished attempts and of attempts no window names that
  were written more than ``unrecorded_grace`` ago (one day; ``cdc_assets.engine.windows.unrecorded_attempts``), and
  compact the mirror and the changelog, then compact the window log; ``"vacuum"``: vacuum each table's mirror and
  changelog, then the window log. Returns one ``TableUpkeep`` per table.
The caller runs these from the only writer of the mirror and the changelog (the stream run), between batches, so
they never conflict with a merge or a reconciliation; snapshot runs write only their own attempts' folders.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import timedelta

from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from cdc_assets.engine.faults import fault_point
from cdc_assets.engine.windows import finished_attempts, unrecorded_attempts
from cdc_assets.lake import staging
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.delta_tables import table_or_none
from cdc_assets.lake.layout import SourceLake, UpkeepStep
from cdc_assets.lake.retry import commit_with_retry
from cdc_assets.lake.spark import session_conf

# Delta's VACUUM lists the table's folders in a Spark job of this many tasks. Spark's default (10000) made one
# VACUUM of a table of a few files take 40-50 s on 2 cores; 1, 2 and 8 tasks measured alike (3.0-3.9 s). A fixed
# number, not one derived from the SparkContext, so the upkeep also runs over Spark Connect.
LISTING_PARALLELISM = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
LISTING_TASKS = "8"
# a snapshot run records its windows seconds after its staged files are written; an attempt no window names a day
# later was left by a run that died in between
UNRECORDED_GRACE = timedelta(days=1)
OPTIMIZE_FILE_SIZE_CONFS = (
    "spark.databricks.delta.optimize.minFileSize",
    "spark.databricks.delta.optimize.maxFileSize",
)


def _last_metrics(table: DeltaTable, operation: str) -> dict[str, str]:
    row = table.history(1).select("operation", "operationMetrics").first()
    if row is None or row["operation"] != operation:
        return {}
    return dict(row["operationMetrics"] or {})


def compact(spark: SparkSession, path: str, target_bytes: int) -> tuple[int, int]:
    table = table_or_none(spark, path)
    if table is None:
        return 0, 0
    with session_conf(spark, dict.fromkeys(OPTIMIZE_FILE_SIZE_CONFS, str(target_bytes))):
        metrics = commit_with_retry(lambda: table.optimize().executeCompaction().first(), f"compact {path}")
    if metrics is None:
        return 0, 0
    result = metrics["metrics"]
    return int(result["numFilesRemoved"]), int(result["numFilesAdded"])


def vacuum(spark: SparkSession, path: str, retention_hours: float | None = None) -> int:
    table = table_or_none(spark, path)
    if table is None:
        return 0
    with session_conf(spark, {LISTING_PARALLELISM: LISTING_TASKS}):
        commit_with_retry(lambda: table.vacuum(retention_hours), f"vacuum {path}")
    return int(_last_metrics(table, "VACUUM END").get("numDeletedFiles", 0))


@dataclass(frozen=True)
class TableUpkeep:
    table: str
    unrecorded_attempts_dropped: int
    staging_files_dropped: int
    files_compacted: int
    files_written: int
    files_vacuumed: int


def maintain_lake(
    spark: SparkSession, lake: SourceLake, tables: Iterable[str], target_bytes: int,
    steps: Collection[UpkeepStep] = ("compact", "vacuum"), unrecorded_grace: timedelta = UNRECORDED_GRACE,
) -> list[TableUpkeep]:  # fmt: skip
    compacting, vacuuming = "compact" in steps, "vacuum" in steps
    tables = sorted(tables)
    finished: dict[str, set[str]] = {}
    unrecorded: dict[str, set[str]] = {}
    if compacting:
        # an attempt no window names is dropped only when its newest file is older than the grace: a run that is
        # alive records its windows seconds after its staged files are written (and reconcile refuses a window whose
        # staged rows are missing, so a late record cannot make rows vanish from the mirror)
        staged = {name: staging.staged_attempt_times(lake.table(name).staging) for name in tables}
        events = window_log.read_events(spark, lake.windows)
        finished = finished_attempts(events)
        unrecorded = unrecorded_attempts(events, staged, time.time() - unrecorded_grace.total_seconds())
    results = []
    for name in tables:
        paths = lake.table(name)
        dropped, removed, written, vacuumed = 0, 0, 0, 0
        if compacting:
            attempts = finished.get(name, set()) | unrecorded.get(name, set())
            dropped = staging.drop_attempts(paths.staging, attempts)
            fault_point("stream.during_maintenance")
            for path in (paths.mirror, paths.changelog):
                files_removed, files_added = compact(spark, path, target_bytes)
                removed, written = removed + files_removed, written + files_added
        if vacuuming:
            vacuumed = sum(vacuum(spark, path) for path in (paths.mirror, paths.changelog))
        results.append(TableUpkeep(name, len(unrecorded.get(name, ())), dropped, removed, written, vacuumed))
    if compacting:
        compact(spark, lake.windows, target_bytes)
    if vacuuming:
        vacuum(spark, lake.windows)
    return results
