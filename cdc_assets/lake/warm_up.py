"""Warming a stream run's Spark driver while another run of the source still streams.

A stream run's first batch in a fresh driver JVM runs several times slower than the next ones: Spark compiles the
code of each query shape on first use, the JVM compiles Delta's and Spark's hot paths, and each mirror's and
changelog's Delta state (checkpoint and log) is read for the first time. A successor run started before its
predecessor ends pays that while it waits for the source's lake-write pool: it rehearses the batch of each table,
with the same code (``append_changelog``, ``apply_changes``), the same columns and the changelog's latest rows moved
to the next positions, twice, on **shallow clones** of the table's changelog and mirror (Delta's ``SHALLOW CLONE``: a
new log whose data files are the real table's, read in place; what a clone's commits write goes to its own folder).
So the rehearsal reads the real tables' state and files as the batch will.

Measured on the bench's 50k-row table (``bench.freshness`` lake, idle machine, a fresh JVM per variant, one batch of
2,000 latest changes, changelog + MERGE seconds; steady batches 0.8 + 2.6 s): cold 2.86 + 7.16; after a rehearsal on
new empty scratch tables (the first version of this module) 2.21 + 5.07; after three of them 1.55 + 4.47; after a
rehearsal on shallow clones 1.58 + 3.13, after two 1.24 + 2.38.

Contract: writes only scratch Delta tables under the source's control folder (``_cdc/warm_up/<run_id>``), removed
before returning; a folder there of a run not in ``live_run_ids`` (one killed while warming) is removed too. A clone's
folder holds only its own log and the files its commits wrote; the real table's files it lists are read, never
written, moved or removed (removing the folder removes nothing of the real table). Reads the mirrors' and changelogs'
Delta logs and files; never writes a mirror, a changelog or the source. A real table's files vacuumed away during a
rehearsal fail that rehearsal only (the caller logs it).
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
    """Clone the table's changelog and mirror (shallow) under ``scratch``, then append the changelog's latest changes
    to the changelog's clone and apply them to the mirror's clone, twice, each time at a position after every change
    the clones hold (so each MERGE matches and rewrites rows as a batch does). False when the table has no changelog
    yet. Between its steps it stops as soon as ``still_waiting()`` is False (the pool is free: the stream must not wait
    for a warm-up)."""
    latest = latest_changes(spark, paths.changelog)
    if latest is None:
        return False
    position, changes = latest[0], latest[1].cache()
    changelog, mirror = str(scratch / "changelog"), str(scratch / "mirror")
    try:
        changes.count()
        unchanged = {name for row in changes.select("_cdc_unchanged").distinct().collect() for name in row[0] or []}
        for real, clone in ((paths.changelog, changelog), (paths.mirror, mirror)):
            if not still_waiting():
                return False
            if DeltaTable.isDeltaTable(spark, real):  # a mirror not made yet: apply_changes makes the clone's
                DeltaTable.forPath(spark, real).clone(clone, isShallow=True)
        for step in (1, 2):
            if not still_waiting():
                return False
            moved = changes.withColumn("_cdc_position", F.lit(position + step).cast(T.LongType()))
            append_changelog(spark, changelog, moved, position + step)
            apply_changes(spark, mirror, moved, fields, key_columns, unchanged)
    finally:
        changes.unpersist()
    return True
