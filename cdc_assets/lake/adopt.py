"""Staged chunk files landed in the mirror whole: a Delta commit that adds them, without rewriting a row.

Contract: ``adopt_windows(spark, mirror_path, staging_path, windows, key_columns)`` adds every staged file of
``windows`` (chunk windows whose every staged row the reconciliation keeps, into key ranges the mirror holds no row
of: the rows an append would write, ``cdc_assets.lake.mirror``) to the mirror in one Delta commit, and returns the
windows it landed; the caller appends the others' rows as before. A window is landed only when each of its files is
a mirror file already (``adoptable_file``): written by a chunk's read with the mirror's row columns
(``cdc_assets.lake.staging.ROW_FIELDS``), ``_cdc_position`` equal to the window's ``lw_lsn`` in every row (its
Parquet statistics), and every column of the file that the mirror has of the same Spark type as there (a column the
mirror has and the file lacks is NULL in those rows, as an append gives it; a column the file has and the mirror
lacks other than ``_cdc_chunk`` refuses the window). Nothing is landed when the mirror uses column mapping (its
files hold physical column names) or partitions, or when the session has no JVM (Spark Connect).

Landing a window: each of its files is placed under the mirror's folder as ``cdc-snapshot-<attempt>-chunk-<n>-part-
<k>.parquet`` (a hard link on a local disk, else a copy: a server-side copy in an object store; the staged file stays
until the upkeep drops its attempt, so a rerun still finds and counts it), then one commit adds them all with Delta's
own transaction (``OptimisticTransaction.commit`` of ``WRITE`` add actions; its ``userMetadata`` is the session's, as
for any other write of the batch), with statistics: the row count, and minimum, maximum and NULL count of the
integer key columns and ``_cdc_position`` from the files' Parquet statistics (Delta prunes a MERGE's files by them;
other columns have none, which Delta reads as "may hold anything"). Change Data Feed reads the added files as
inserts, as an append's. A run killed between placing and committing leaves files no commit names: the rerun finds
the key range still empty and places them again under the same names; if it does not land them, they stay unnamed
in the mirror's folder until ``VACUUM`` removes them. Fault point ``stream.after_adopted_files``: placed, not
committed.

Why the rows may carry the window's start position (``lw_lsn``) and not its high watermark, as a rewritten row does:
a landed window's key range had no mirror row when the stream had passed the high watermark, and no change from a
transaction unsettled at the low watermark touched a key the read saw. So every change the stream applied in the
range before the high watermark came from a settled transaction, visible to the read, and left no row; every later
change to these keys has a position above the high watermark. A change is applied to a mirror row only when it is
newer than the row (``_cdc_position``), so both positions order every later change the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_assets.engine.faults import fault_point
from cdc_assets.engine.windows import ChunkWindow
from cdc_assets.lake import staging
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.retry import commit_with_retry
from cdc_assets.lake.schema import spark_type

POSITION_COLUMN = "_cdc_position"
ADOPTED_PREFIX = "cdc-snapshot-"


@dataclass(frozen=True)
class AdoptedFile:
    source: LakePath
    name: str  # under the mirror's folder
    rows: int
    stats: dict[str, object]


def _column_bounds(metadata: pq.FileMetaData, name: str) -> tuple[object, object, int] | None:
    """(min, max, null count) of a top-level primitive column over every row group, or ``None`` when a row group has
    no statistics on it."""
    leaves = [i for i in range(metadata.num_columns) if metadata.schema.column(i).path == name]
    if len(leaves) != 1:
        return None
    index = leaves[0]  # a leaf's index: nested columns before it have several leaves
    lowest = highest = None
    nulls = 0
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(index).statistics
        if stats is None or not stats.has_null_count:
            return None
        nulls += stats.null_count
        if not stats.has_min_max:
            if stats.null_count != metadata.row_group(group).num_rows:
                return None
            continue
        lowest = stats.min if lowest is None else min(lowest, stats.min)
        highest = stats.max if highest is None else max(highest, stats.max)
    return lowest, highest, nulls


def adoptable_file(
    path: LakePath, window: ChunkWindow, mirror_types: dict[str, T.DataType], key_columns: Sequence[str]
) -> AdoptedFile | None:
    """The file as a mirror file (its statistics), or ``None`` when it is not one (module docstring)."""
    metadata = pq.read_metadata(path.path, filesystem=path.filesystem)
    schema: pa.Schema = metadata.schema.to_arrow_schema()
    names = schema.names
    if any(column not in names for column in staging.ROW_COLUMNS):
        return None
    for field in schema:
        if field.name == staging.CHUNK_COLUMN:
            continue
        wanted = mirror_types.get(field.name)
        try:
            if wanted is None or spark_type(field.type) != wanted:
                return None
        except KeyError:  # a type the lake's mapping does not know
            return None
    statistics: dict[str, dict[str, object]] = {"minValues": {}, "maxValues": {}, "nullCount": {}}
    for name in (*key_columns, POSITION_COLUMN):
        if not pa.types.is_integer(schema.field(name).type):
            continue
        bounds = _column_bounds(metadata, name)
        if bounds is None:
            if name == POSITION_COLUMN:
                return None
            continue
        lowest, highest, nulls = bounds
        if lowest is not None:
            statistics["minValues"][name] = int(lowest)
            statistics["maxValues"][name] = int(highest)
        statistics["nullCount"][name] = nulls
    if metadata.num_rows and (
        statistics["minValues"].get(POSITION_COLUMN) != window.lw_lsn
        or statistics["maxValues"].get(POSITION_COLUMN) != window.lw_lsn
        or statistics["nullCount"].get(POSITION_COLUMN) != 0
    ):
        return None
    name = f"{ADOPTED_PREFIX}{window.attempt}-{path.name}"
    stats = {"numRecords": metadata.num_rows, **statistics, "tightBounds": True}
    return AdoptedFile(path, name, metadata.num_rows, stats)


def _place(source: LakePath, target: LakePath) -> None:
    """``source`` under ``target``'s name: a hard link on a local disk (a copy across devices), else a copy."""
    local_source, local_target = source.local_path, target.local_path
    if local_source is not None and local_target is not None:
        temporary = local_target.with_name(f".{local_target.name}.tmp")
        temporary.unlink(missing_ok=True)
        try:
            os.link(local_source, temporary)
        except OSError:
            shutil.copyfile(local_source, temporary)
        os.replace(temporary, local_target)
        return
    source.filesystem.copy_file(source.path, target.path)


def _transaction(spark: SparkSession, mirror_path: str) -> Any:
    """A Delta transaction on the mirror (a py4j object), or ``None`` where files cannot be landed (module
    docstring)."""
    jvm, session = getattr(spark, "_jvm", None), getattr(spark, "_jsparkSession", None)
    if jvm is None or session is None:
        return None
    transaction = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(session, mirror_path).startTransaction()
    metadata = transaction.metadata()
    if metadata.columnMappingMode().name() != "none" or not metadata.partitionColumns().isEmpty():
        return None
    return transaction


def _commit_added(spark: SparkSession, mirror_path: str, files: Sequence[AdoptedFile], sizes: dict[str, int]) -> None:
    """One commit adding ``files`` (each in the mirror's folder under its ``name``, of ``sizes[name]`` bytes)."""
    transaction = _transaction(spark, mirror_path)
    if transaction is None:
        raise RuntimeError(f"{mirror_path}: the mirror can no longer take files whole (column mapping or partitions)")
    jvm = spark._jvm
    action = getattr(getattr(jvm.org.apache.spark.sql.delta.actions, "Action$"), "MODULE$")
    now = int(time.time() * 1000)
    actions = jvm.java.util.ArrayList()
    for file in files:
        add = {
            "path": file.name, "partitionValues": {}, "size": sizes[file.name], "modificationTime": now,
            "dataChange": True, "stats": json.dumps(file.stats, separators=(",", ":")),
        }  # fmt: skip
        actions.add(action.fromJson(json.dumps({"add": add})))
    none = jvm.scala.Option.empty()
    append = jvm.org.apache.spark.sql.SaveMode.Append
    operation = jvm.org.apache.spark.sql.delta.DeltaOperations.Write(append, none, none, none)
    transaction.commit(jvm.scala.jdk.javaapi.CollectionConverters.asScala(actions).toList(), operation)


def adopt_windows(
    spark: SparkSession,
    mirror_path: str,
    staging_path: str,
    windows: Sequence[ChunkWindow],
    mirror_fields: Sequence[T.StructField],
    key_columns: Sequence[str],
) -> list[ChunkWindow]:
    if not windows or _transaction(spark, mirror_path) is None:
        return []
    mirror_types = {f.name: f.dataType for f in mirror_fields}
    landed: list[ChunkWindow] = []
    files: list[AdoptedFile] = []
    listed: dict[str, list[tuple[int, LakePath]]] = {}  # an attempt's folder is listed once for all its chunks
    for window in windows:
        if window.attempt not in listed:
            listed[window.attempt] = staging.part_files(staging_path, window.attempt)
        found = [path for chunk, path in listed[window.attempt] if chunk == window.chunk]
        adopted = [adoptable_file(path, window, mirror_types, key_columns) for path in found]
        if not found or any(a is None for a in adopted) or sum(a.rows for a in adopted) != window.rows:
            continue
        landed.append(window)
        files += [a for a in adopted if a is not None and a.rows]
    if not files:
        return landed
    mirror = LakePath(mirror_path)
    sizes = {}
    for file in files:
        target = mirror / file.name
        _place(file.source, target)
        sizes[file.name] = target.size()
    fault_point("stream.after_adopted_files")
    commit_with_retry(
        lambda: _commit_added(spark, mirror_path, files, sizes), f"reconcile (landed files) into {mirror_path}"
    )
    return landed
