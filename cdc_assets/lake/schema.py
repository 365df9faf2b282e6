"""The source columns' types as the lake holds them: Arrow in the read tasks, Spark in the lake.

Contract: a source dialect describes a table's columns as an Arrow schema (its own type mapping), ending with
``UNREPRESENTABLE_COLUMN`` (``UNREPRESENTABLE_TYPE``: column name -> the source's exact text, for values the Arrow
type cannot hold). ``spark_fields(schema)`` are the same columns as Spark fields, every one nullable: timestamps
without a zone as ``TimestampNTZ``, with one as ``Timestamp``; lists as arrays, maps as maps. The engine and the lake
know columns only through these fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql.types import DataType, StructField

UNREPRESENTABLE_COLUMN: Final = "_cdc_unrepresentable"
UNREPRESENTABLE_TYPE: Final = pa.map_(pa.string(), pa.string())


def spark_type(arrow: pa.DataType) -> DataType:
    from pyspark.sql import types as T

    if pa.types.is_list(arrow):
        return T.ArrayType(spark_type(arrow.value_type), containsNull=True)
    if pa.types.is_map(arrow):
        return T.MapType(spark_type(arrow.key_type), spark_type(arrow.item_type), valueContainsNull=True)
    if pa.types.is_decimal(arrow):
        return T.DecimalType(arrow.precision, arrow.scale)
    if pa.types.is_timestamp(arrow):
        return T.TimestampType() if arrow.tz is not None else T.TimestampNTZType()
    simple = {
        pa.int16(): T.ShortType(),
        pa.int32(): T.IntegerType(),
        pa.int64(): T.LongType(),
        pa.float32(): T.FloatType(),
        pa.float64(): T.DoubleType(),
        pa.bool_(): T.BooleanType(),
        pa.date32(): T.DateType(),
        pa.binary(): T.BinaryType(),
        pa.string(): T.StringType(),
    }
    return simple[arrow]


def spark_fields(schema: pa.Schema) -> list[StructField]:
    from pyspark.sql import types as T

    return [T.StructField(f.name, spark_type(f.type), nullable=True) for f in schema]
