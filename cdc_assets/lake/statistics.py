"""Which columns of a mirror or a changelog Delta collects file statistics (min, max, null count) on.

Delta's statistics tracker keeps a column's running minimum and maximum as whole values while it writes a file, and
copies the current one into its buffer for every row written after it. One big text value that is its column's
minimum or maximum in a task's file thus costs a copy of that value per later row: a 20 MB value and 20,000 rows
took 128 s to write against 5.1 s without statistics on that column, and a demo's stream batch over a 60 MB value
ran for over 15 minutes without finishing (the statistics kept after the write are 32-character prefixes anyway).

Contract:
- ``statistics_columns(schema, always)``: ``always`` (a table's key columns) when their type has statistics, then
  every other top-level column of a fixed-size type Delta keeps statistics of (numbers, dates, timestamps). Text,
  binary, arrays, maps and structs of a source's values get none: their size has no bound. The key columns keep
  theirs (a MERGE and a chunk's reconciliation prune the files by the key's range), so a text key of a huge value
  would still pay that copy; keys are short in practice (a B-tree entry of PostgreSQL holds at most about 2.7 kB).
- ``ensure_statistics_columns(spark, path, columns)`` sets ``delta.dataSkippingStatsColumns`` to ``columns`` when
  the table's property differs (one metadata commit; none when it is already so; asked of the table once per
  process and value): tables made before this rule (every column then) and tables whose columns were added since
  get it on their next write. Files written earlier keep their statistics; a compaction rewrites them with the new
  set.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_assets.lake.retry import commit_with_retry

STATS_COLUMNS = "delta.dataSkippingStatsColumns"
# Delta refuses statistics columns of other fixed-size types (DELTA_COLUMN_DATA_SKIPPING_NOT_SUPPORTED_TYPE: booleans)
FIXED_SIZE_TYPES = (
    T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.DecimalType, T.DateType,
    T.TimestampType, T.TimestampNTZType,
)  # fmt: skip
# types Delta keeps statistics of (a string key's are 32-character prefixes)
WITH_STATISTICS = (*FIXED_SIZE_TYPES, T.StringType)
# the value each table was found with or given in this process: asked of the table once, not at every batch (only
# this rule sets the property, and a table's columns only grow)
_ENSURED: dict[str, str] = {}


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def statistics_columns(schema: T.StructType, always: Sequence[str] = ()) -> list[str]:
    """The columns of ``schema`` to collect statistics on (module docstring), in the schema's order."""
    wanted = set(always)
    return [
        f.name
        for f in schema.fields
        if isinstance(f.dataType, FIXED_SIZE_TYPES) or (f.name in wanted and isinstance(f.dataType, WITH_STATISTICS))
    ]


def property_value(columns: Sequence[str]) -> str:
    return ",".join(_quoted(c) for c in columns)


def created_with_statistics_columns(path: str, columns: Sequence[str]) -> None:
    """Note that the table at ``path`` was just created with ``columns`` as its statistics columns (no read of its
    properties by ``ensure_statistics_columns`` then: 2.9 s on a cold driver)."""
    _ENSURED[path] = property_value(columns)


def ensure_statistics_columns(spark: SparkSession, path: str, columns: Sequence[str]) -> bool:
    """Set the table's statistics columns to ``columns`` unless they are so already; whether it committed."""
    from delta.tables import DeltaTable

    wanted = property_value(columns)
    if _ENSURED.get(path) == wanted:
        return False
    current = DeltaTable.forPath(spark, path).detail().first()["properties"].get(STATS_COLUMNS)
    if current == wanted:
        _ENSURED[path] = wanted
        return False
    literal = wanted.replace("\\", "\\\\").replace("'", "\\'")
    commit_with_retry(
        lambda: spark.sql(f"ALTER TABLE delta.{_quoted(path)} SET TBLPROPERTIES ('{STATS_COLUMNS}' = '{literal}')"),
        f"statistics columns of {path}",
    )
    _ENSURED[path] = wanted
    return True
