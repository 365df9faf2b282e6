"""Warming a stream run's Spark driver while another run of the source still streams.

A stream run's first batch in a fresh driver JVM runs several times slower than the next ones: Spark compiles the
code of each query shape on first use, the JVM compiles Delta's and Spark's hot paths, and each mirror's and
changelog's Delta log is read for the first time (bench.freshness, 2026-12-05: a successor's first batch 10.5 s,
changelog 3.6 s and MERGE 5.6 s against 0.35 and 1.48 s, after a warm-up MERGE of another shape). A successor run
started before its predecessor ends pays that while it waits for the source's lake-write pool: it rehearses the batch
of each table on a scratch copy, with the same code (``append_changelog``, ``apply_changes``), the same columns and
the changelog's latest rows.

Contract: writes only scratch Delta tables under the source's control folder (``_cdc/warm_up/<run_id>``), removed
before returning; a folder there of a run not in ``live_run_ids`` (one killed while warming) is removed too. Reads the
mirrors' and changelogs' Delta logs and the changelogs' latest rows; never writes a mirror, a changelog or the source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.lake.files import LakePath
from cdc_assets.lake.layout import SourceLake, TablePaths
from cdc_assets.lake.mirror import append_changelog, apply_changes, last_applied_position

REHEARSAL_ROWS = 500  # of the changelog's latest batch: enough for every branch of the MERGE, little to write


@dataclass
class WarmUp:
    seconds: float = 0.0
    rehearsed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # table -> error: a warm-up never fails the run
    stopped: bool = False  # the pool became free before the warm-up ended: the stream went on at once


@contextmanager
def scratch_folder(lake: SourceLake, run_id: str, live_run_ids: set[str]) -> Iterator[LakePath]:
    """``_cdc/warm_up/<run_id>``, removed on exit; other runs' folders there are removed first unless live."""
    folder = lake.control / "warm_up"
    for entry in folder.entries():
        if entry.name not in live_run_ids | {run_id}:
            entry.path.rmtree()
    try:
        yield folder / run_id
    finally:
        (folder / run_id).rmtree()


def latest_changes(spark: SparkSession, changelog: str, rows: int = REHEARSAL_ROWS) -> tuple[int, DataFrame] | None:
    """The changelog's latest batch position and up to ``rows`` of its changes (their files found from the position
    statistics), or None when there is no changelog yet."""
    position = last_applied_position(spark, changelog)
    if position is None:
        return None
    return position, spark.read.format("delta").load(changelog).where(F.col("_cdc_position") == position).limit(rows)


def rehearse_batch(
    spark: SparkSession,
    scratch: LakePath,
    paths: TablePaths,
    fields: Sequence[T.StructField],
    key_columns: Sequence[str],
    still_waiting: Callable[[], bool] = lambda: True,
) -> bool:
    """Apply the changelog's latest changes of one table to a scratch changelog and mirror twice (the first time the
    scratch mirror is empty: inserts; the second, matched rows), and read the real mirror's log. False when the
    table has no changelog yet. Between its steps it stops as soon as ``still_waiting()`` is False (the pool is free:
    the stream must not wait for a warm-up)."""
    latest = latest_changes(spark, paths.changelog)
    if latest is None:
        return False
    position, changes = latest[0], latest[1].cache()
    try:
        changes.count()
        unchanged = {name for row in changes.select("_cdc_unchanged").distinct().collect() for name in row[0] or []}
        if not still_waiting():
            return False
        append_changelog(spark, str(scratch / "changelog"), changes, position)
        for _ in range(2):
            if not still_waiting():
                return False
            apply_changes(spark, str(scratch / "mirror"), changes, fields, key_columns, unchanged)
    finally:
        changes.unpersist()
    if DeltaTable.isDeltaTable(spark, paths.mirror):
        DeltaTable.forPath(spark, paths.mirror).toDF().schema  # noqa: B018 - reads the log into the driver's cache
    return True
