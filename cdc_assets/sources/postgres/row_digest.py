"""Row digests that PostgreSQL and Spark compute alike: the database-side half of the consistency check.

Contract:
- ``source_row_digest(columns)`` is a SQL expression over a source table's columns and ``mirror_row_digest(columns)``
  a Spark column over the mirror's columns (typed values plus ``_cdc_unrepresentable``). For a mirror row that
  holds what the snapshot or the stream decoded from a source row (``pg_values``), both give the same signed 64-bit
  integer; a different value in any column gives a different one (up to 64-bit hash collisions). Summed over rows
  (``numeric`` / ``decimal(38,0)``) they make an order-independent checksum that each side computes in its own
  engine: PostgreSQL renders and hashes its rows, and only a count and a sum leave the server.
- A row's digest is the first 64 bits of the MD5 of its columns' texts in column order, each written as
  ``<octet length>:<text>`` or ``~`` for NULL (self-delimiting, so no text can shift into its neighbour).
- A column's text is PostgreSQL's text output under ``SESSION_SETTINGS``: the source side calls the type's output
  function; the mirror side takes the exact text from ``_cdc_unrepresentable`` when the row has it, else rebuilds
  the text from the typed value (dates, timestamps with trailing fractional zeros dropped, ``t``/``f``, ``\\x``
  hex, array literals with PostgreSQL's quoting). Two kinds differ from the plain text, on both sides alike, where
  the mirror cannot keep the text: numeric values (scalars and array elements) drop trailing fractional zeros (a
  ``decimal(38,18)`` has no display scale), and float4/float8 values are their IEEE bits in hex (``NaN`` for any
  NaN; Java prints floats differently from PostgreSQL). A float array is written element by element when it is
  one-dimensional with lower bound 1 (the only shape the mirror types), else as its text.
- ``source_key_text`` / ``mirror_key_text`` render only the key columns the same way (no hash): a key that both
  engines spell alike, to exclude keys and to name the first difference.
- ``source_column_texts`` / ``mirror_column_texts`` are the per-column texts, to show both sides of a difference.
"""

from __future__ import annotations

from collections.abc import Sequence

from psycopg import sql
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.lake.digest import mirror_digest, mirror_part
from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN, PgColumn, spark_schema

_BOX = 603
_NUMERIC_TRAILING_ZEROS = r"(\.[0-9]*[1-9])0+(?=[,}]|$)"
_NUMERIC_ZERO_FRACTION = r"\.0+(?=[,}]|$)"
_FRACTION_TRAILING_ZEROS = r"(\.[0-9]*[1-9])0+$"
_ZERO_FRACTION = r"\.0+$"


def _is_float(data_type: T.DataType) -> bool:
    return isinstance(data_type, T.FloatType | T.DoubleType)


def _element_type(data_type: T.DataType) -> T.DataType | None:
    return data_type.elementType if isinstance(data_type, T.ArrayType) else None


def _delimiter(column: PgColumn) -> str:
    return ";" if column.elem_oid == _BOX else ","


# -- PostgreSQL ------------------------------------------------------------------------------------------------
def _source_float(value: sql.Composable, data_type: T.DataType) -> sql.Composable:
    send = "float8send" if isinstance(data_type, T.DoubleType) else "float4send"
    return sql.SQL("case when {v} = 'NaN' then 'NaN' else encode({send}({v}), 'hex') end").format(
        v=value, send=sql.SQL(send)
    )


def _source_numeric(text: sql.Composable) -> sql.Composable:
    trimmed = sql.SQL("regexp_replace({}, {}, '\\1', 'g')").format(text, sql.Literal(_NUMERIC_TRAILING_ZEROS))
    return sql.SQL("regexp_replace({}, {}, '', 'g')").format(trimmed, sql.Literal(_NUMERIC_ZERO_FRACTION))


def _source_text(column: PgColumn, data_type: T.DataType) -> sql.Composable:
    value = sql.Identifier(column.name)
    text = sql.SQL("case when {v} is not null then concat({v}) end").format(v=value)  # the output function's text
    element = _element_type(data_type)
    if _is_float(data_type):
        return _source_float(value, data_type)
    if element is not None and _is_float(element):
        elements = sql.SQL(
            "(select string_agg(coalesce({e}, 'NULL'), ',' order by o) from unnest({v}) with ordinality u(e, o))"
        ).format(e=_source_float(sql.Identifier("u", "e"), element), v=value)
        return sql.SQL(
            "case when {v} is null then null when cardinality({v}) = 0 then '{{}}' "
            "when array_ndims({v}) = 1 and array_lower({v}, 1) = 1 then '{{' || {elements} || '}}' else {text} end"
        ).format(v=value, elements=elements, text=text)
    if isinstance(data_type, T.DecimalType) or isinstance(element, T.DecimalType):
        return _source_numeric(text)
    return text


def _source_part(text: sql.Composable) -> sql.Composable:
    return sql.SQL("case when ({t}) is null then '~' else octet_length({t})::text || ':' || ({t}) end").format(t=text)


def source_column_texts(columns: Sequence[PgColumn]) -> list[sql.Composable]:
    schema = spark_schema(list(columns))
    return [_source_text(c, schema[c.name].dataType) for c in columns]


def _in_key_order(columns: Sequence[PgColumn], key_columns: Sequence[str]) -> list[PgColumn]:
    """The key's columns in the key's order: both engines spell a key from the same sequence."""
    by_name = {c.name: c for c in columns}
    return [by_name[name] for name in key_columns]


def source_key_text(columns: Sequence[PgColumn], key_columns: Sequence[str]) -> sql.Composable:
    return sql.SQL(" || ").join(_source_part(t) for t in source_column_texts(_in_key_order(columns, key_columns)))


def source_row_digest(columns: Sequence[PgColumn]) -> sql.Composable:
    row = sql.SQL(" || ").join(_source_part(t) for t in source_column_texts(columns))
    return sql.SQL("('x' || left(md5({}), 16))::bit(64)::bigint").format(row)


# -- Spark -----------------------------------------------------------------------------------------------------
def _mirror_float(value: Column, data_type: T.DataType) -> Column:
    if isinstance(data_type, T.DoubleType):
        bits = F.java_method(F.lit("java.lang.Double"), F.lit("doubleToRawLongBits"), value).cast("long")
        digits = F.lpad(F.lower(F.hex(bits)), 16, "0")
    else:
        bits = F.java_method(F.lit("java.lang.Float"), F.lit("floatToRawIntBits"), value).cast("long")
        digits = F.lpad(F.lower(F.hex(bits.bitwiseAND(F.lit(0xFFFFFFFF)))), 8, "0")
    return F.when(value.isNull(), F.lit(None)).when(F.isnan(value), F.lit("NaN")).otherwise(digits)


def _without_trailing_fraction_zeros(text: Column) -> Column:
    return F.regexp_replace(F.regexp_replace(text, _FRACTION_TRAILING_ZEROS, "$1"), _ZERO_FRACTION, "")


def _mirror_scalar(value: Column, data_type: T.DataType) -> Column:
    """PostgreSQL's text output of a typed (representable) value."""
    if isinstance(data_type, T.StringType):
        return value
    if isinstance(data_type, T.BooleanType):
        return F.when(value, F.lit("t")).when(~value, F.lit("f"))
    if isinstance(data_type, T.DateType):
        return F.date_format(value, "yyyy-MM-dd")
    if isinstance(data_type, T.TimestampNTZType | T.TimestampType):
        text = _without_trailing_fraction_zeros(F.date_format(value, "yyyy-MM-dd HH:mm:ss.SSSSSS"))
        return F.concat(text, F.lit("+00")) if isinstance(data_type, T.TimestampType) else text
    if isinstance(data_type, T.BinaryType):
        return F.concat(F.lit("\\x"), F.lower(F.hex(value)))
    if _is_float(data_type):
        return _mirror_float(value, data_type)
    return value.cast("string")  # integers, decimals


def _array_element(text: Column, delimiter: str) -> Column:
    """PostgreSQL's array_out quoting: quoted when empty, ``NULL`` in any case, or holding a brace, a quote, a
    backslash, the delimiter or white space; quotes and backslashes escaped with a backslash."""
    special = '[{}"\\\\' + delimiter + " \\t\\n\\r\\x0B\\f]"
    quoted = (text == "") | text.rlike(special) | (F.lower(text) == "null")
    escaped = F.regexp_replace(text, r'(["\\])', r"\\$1")
    return F.when(quoted, F.concat(F.lit('"'), escaped, F.lit('"'))).otherwise(text)


def _mirror_text(column: PgColumn, data_type: T.DataType, unrepresentable: Column | None) -> Column:
    value = F.col(f"`{column.name}`")
    element = _element_type(data_type)
    if element is not None:
        delimiter = _delimiter(column)
        if _is_float(element):
            elements = F.transform(value, lambda x: _mirror_float(x, element))
        else:
            elements = F.transform(value, lambda x: _array_element(_mirror_scalar(x, element), delimiter))
        rebuilt = F.concat(F.lit("{"), F.array_join(elements, delimiter, "NULL"), F.lit("}"))
    else:
        rebuilt = _mirror_scalar(value, data_type)
    text = rebuilt if unrepresentable is None else F.coalesce(unrepresentable[column.name], rebuilt)
    if isinstance(data_type, T.DecimalType) or isinstance(element, T.DecimalType):
        text = F.regexp_replace(F.regexp_replace(text, _NUMERIC_TRAILING_ZEROS, "$1"), _NUMERIC_ZERO_FRACTION, "")
    return text


def mirror_column_texts(columns: Sequence[PgColumn], with_unrepresentable: bool = True) -> list[Column]:
    """Per-column texts of mirror rows; without ``_cdc_unrepresentable`` for frames that lack it (e.g. keys
    taken from a changelog image)."""
    schema = spark_schema(list(columns))
    unrepresentable = F.col(UNREPRESENTABLE_COLUMN) if with_unrepresentable else None
    return [_mirror_text(c, schema[c.name].dataType, unrepresentable) for c in columns]


def mirror_key_text(
    columns: Sequence[PgColumn], key_columns: Sequence[str], with_unrepresentable: bool = True
) -> Column:
    texts = mirror_column_texts(_in_key_order(columns, key_columns), with_unrepresentable)
    return F.concat(*[mirror_part(t) for t in texts])


def mirror_row_digest(columns: Sequence[PgColumn]) -> Column:
    return mirror_digest(mirror_column_texts(columns))
