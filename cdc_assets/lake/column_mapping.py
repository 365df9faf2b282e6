"""Column names Delta refuses by default, kept as they are with Delta column mapping.

Contract: a Delta table without column mapping refuses column names (also nested struct field names) holding any of
`` ,;{}()\\n\\t=`` (``DELTA_INVALID_CHARACTERS_IN_COLUMN_NAMES``). PostgreSQL accepts them, so a mirror or changelog
of a table with such a column gets ``delta.columnMapping.mode = name``: the column keeps its real name in the
table's schema (Parquet files use physical names; every Delta reader of protocol reader 2 / writer 5 and up reads
the logical names). Tables whose names Delta accepts stay as they were (no protocol upgrade).
- ``refused_names(schema)`` lists the field names (nested too) Delta would refuse without mapping.
- ``column_mapping_properties(schema)`` is the table properties to create a table of ``schema`` with.
- ``enable_column_mapping(spark, path, schema)`` turns mapping on for an existing table before fields of ``schema``
  that need it are added (``ALTER TABLE ... SET TBLPROPERTIES``, which upgrades the protocol); a no-op when mapping
  is on or not needed.
"""

from __future__ import annotations

import re

from pyspark.sql import SparkSession
from pyspark.sql import types as T

REFUSED_CHARACTERS = re.compile(r"[ ,;{}()\n\t=]")
MODE = "delta.columnMapping.mode"


def refused_names(schema: T.StructType) -> list[str]:
    names: list[str] = []

    def visit(data_type: T.DataType, prefix: str) -> None:
        if isinstance(data_type, T.StructType):
            for field in data_type.fields:
                if REFUSED_CHARACTERS.search(field.name):
                    names.append(prefix + field.name)
                visit(field.dataType, f"{prefix}{field.name}.")
        elif isinstance(data_type, T.ArrayType):
            visit(data_type.elementType, prefix)
        elif isinstance(data_type, T.MapType):
            visit(data_type.keyType, prefix)
            visit(data_type.valueType, prefix)

    visit(schema, "")
    return names


def column_mapping_properties(schema: T.StructType) -> dict[str, str]:
    return {MODE: "name"} if refused_names(schema) else {}


def enable_column_mapping(spark: SparkSession, path: str, schema: T.StructType) -> None:
    from delta.tables import DeltaTable

    if not refused_names(schema):
        return
    details = DeltaTable.forPath(spark, path).detail().select("properties").first()
    properties = details["properties"] if details is not None else {}
    if (properties or {}).get(MODE, "none") != "none":
        return
    escaped = "`" + path.replace("`", "``") + "`"
    spark.sql(f"ALTER TABLE delta.{escaped} SET TBLPROPERTIES ('{MODE}' = 'name')")
