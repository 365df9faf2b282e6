"""Opening a Delta table that may not exist yet.

Contract: ``is_missing_table(error)`` tells whether a Spark ``AnalysisException`` means "no Delta table at this
path" (no folder, or a folder without a Delta log); ``table_or_none(spark, path)`` is ``DeltaTable.forPath`` that
returns ``None`` then. Both ask the storage, not ``DeltaTable.isDeltaTable``: that answers from a cached
``DeltaLog`` and, in a long-lived session that once looked while another process was creating the table, keeps
answering False (found by tools/torture.py).

``clear_interrupted_create(path)``: a process killed while it created a Delta table can leave a ``_delta_log``
folder that holds no commit; ``DeltaTable.createIfNotExists`` then fails for good with ``DELTA_TABLE_NOT_FOUND``
(an append creates the table, a create does not). Called before a missing table is created, it removes such a log
folder (only when no file in it is a commit, a checkpoint or ``_last_checkpoint``); it returns whether it did. Safe
because each lake table has one writer at a time (the stream, serialized by the source's lake-write pool). Found by
the MongoDB torture run in CI: a stream killed while it created a mirror failed every later batch ("stream run b4
failed 8 times ... DELTA_TABLE_NOT_FOUND").

``table_state(spark, table, path)``: the table's current version and the bytes of its files, from Delta's own
snapshot (``DeltaLog.update``: about 10 ms in a warm driver; after a commit, its size rebuilds the table's state in
a Spark job, 0.2-0.7 s for a 50k-row mirror, the rebuild the table's next MERGE would make otherwise: read from the
checksum file instead, the MERGE took that much longer) where the session has a JVM, else from the public
``history(1)`` and ``detail()`` (about 0.15 s together; a Spark Connect session).

``column_upper_bound(spark, path, column)``: a value no row of the table's current files exceeds in ``column``,
from Delta's file statistics (the greatest ``maxValues`` of the column over every file, a file's deleted rows
included, so the bound may be above the greatest live value, never below it; a file whose values of the column
are all NULL holds none): ``ColumnBound(known=True, value=None)`` when the table has no file (or only such files),
``known=False`` when any other file lacks the column's maximum (statistics not collected on it, a file written
without statistics), when the column's type is not one whose statistics are exact (integers, decimals, dates:
strings' are truncated, floats have NaN) or when the session has no JVM to read Delta's snapshot with (an internal
API: another Delta version may lack it). Column mapping: the statistics are read under the column's physical name.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

MISSING_TABLE_CONDITIONS = frozenset({"PATH_NOT_FOUND", "DELTA_TABLE_NOT_FOUND", "DELTA_MISSING_DELTA_TABLE"})


@dataclass(frozen=True)
class TableState:
    version: int
    size_bytes: int


def current_snapshot(spark: SparkSession, path: str) -> Any | None:
    """Delta's own snapshot of the table at ``path`` now (``DeltaLog.update``, a JVM object), or None: a session
    without a JVM (Spark Connect), or an internal API another Delta version may lack."""
    jvm: Any = getattr(spark, "_jvm", None)
    session = getattr(spark, "_jsparkSession", None)
    if jvm is None or session is None:
        return None
    try:
        none = jvm.scala.Option.empty()
        return jvm.org.apache.spark.sql.delta.DeltaLog.forTable(session, path).update(False, none, none)
    except Exception:
        return None


def table_state(spark: SparkSession, table: DeltaTable, path: str) -> TableState:
    """The version and size of ``table`` (at ``path``) now (module Contract)."""
    snapshot = current_snapshot(spark, path)
    if snapshot is not None:
        try:
            return TableState(int(snapshot.version()), int(snapshot.sizeInBytes()))
        except Exception:  # an internal API another Delta version may lack: the public one below
            pass
    version = table.history(1).select("version").first()["version"]
    return TableState(int(version), int(table.detail().select("sizeInBytes").first()[0]))


@dataclass(frozen=True)
class ColumnBound:
    known: bool
    value: Any = None  # with ``known``: None when the table has no file


UNKNOWN_BOUND = ColumnBound(False)
EXACT_STATISTICS_TYPES = (T.IntegralType, T.DecimalType, T.DateType)
PHYSICAL_NAME = "delta.columnMapping.physicalName"


def column_upper_bound(spark: SparkSession, path: str, column: str) -> ColumnBound:
    """The greatest value ``column`` may hold in the table's current files (module Contract)."""
    snapshot = current_snapshot(spark, path)
    if snapshot is None:
        return UNKNOWN_BOUND
    try:
        schema = T.StructType.fromJson(json.loads(snapshot.schema().json()))
        field = next((f for f in schema.fields if f.name == column), None)
        if field is None or not isinstance(field.dataType, EXACT_STATISTICS_TYPES):
            return UNKNOWN_BOUND
        if int(snapshot.numOfFiles()) == 0:
            return ColumnBound(True)
        files = DataFrame(snapshot.allFiles().toDF(), spark)
    except Exception:  # an internal API another Delta version may lack: no bound, the caller merges
        return UNKNOWN_BOUND
    physical = field.metadata.get(PHYSICAL_NAME, column)
    stats = T.StructType([
        T.StructField("numRecords", T.LongType()),
        T.StructField("maxValues", T.StructType([T.StructField(physical, field.dataType)])),
        T.StructField("nullCount", T.StructType([T.StructField(physical, T.LongType())])),
    ])  # fmt: skip
    parsed = F.from_json(F.col("stats"), stats)
    highest = parsed["maxValues"][physical]
    only_nulls = F.coalesce(parsed["nullCount"][physical] == parsed["numRecords"], F.lit(False))
    row = files.agg(F.count_if(highest.isNull() & ~only_nulls).alias("without"), F.max(highest).alias("high")).first()
    if row is None or row["without"]:
        return UNKNOWN_BOUND
    return ColumnBound(True, row["high"])


def is_missing_table(error: AnalysisException) -> bool:
    return error.getCondition() in MISSING_TABLE_CONDITIONS


def table_or_none(spark: SparkSession, path: str) -> DeltaTable | None:
    try:
        return DeltaTable.forPath(spark, path)
    except AnalysisException as error:
        if is_missing_table(error):
            return None
        raise


LOG_ENTRY = re.compile(r"^(\d{20}\.|_last_checkpoint$)")  # a commit, checkpoint or checksum of a version


def clear_interrupted_create(path: str) -> bool:
    parsed = urlparse(path)
    if parsed.scheme not in ("", "file"):  # object stores have no empty folders: a commit is one atomic put
        return False
    log = Path(parsed.path if parsed.scheme else path) / "_delta_log"
    if not log.is_dir() or any(LOG_ENTRY.match(entry.name) for entry in log.iterdir()):
        return False
    shutil.rmtree(log)
    return True
