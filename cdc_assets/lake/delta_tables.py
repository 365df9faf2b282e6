"""Opening a Delta table that may not exist yet.

Contract: ``is_missing_table(error)`` tells whether a Spark ``AnalysisException`` means "no Delta table at this
path" (no folder, or a folder without a Delta log); ``table_or_none(spark, path)`` is ``DeltaTable.forPath`` that
returns ``None`` then. Both ask the storage, not ``DeltaTable.isDeltaTable``: that answers from a cached
``DeltaLog`` and, in a long-lived session that once looked while another process was creating the table, keeps
answering False (found by tools/torture.py).
"""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession

MISSING_TABLE_CONDITIONS = frozenset({"PATH_NOT_FOUND", "DELTA_TABLE_NOT_FOUND", "DELTA_MISSING_DELTA_TABLE"})


def is_missing_table(error: AnalysisException) -> bool:
    return error.getCondition() in MISSING_TABLE_CONDITIONS


def table_or_none(spark: SparkSession, path: str) -> DeltaTable | None:
    try:
        return DeltaTable.forPath(spark, path)
    except AnalysisException as error:
        if is_missing_table(error):
            return None
        raise
