"""Unit tests of the PostgreSQL text -> Arrow converter on hand-built string arrays (no database)."""

from __future__ import annotations

import decimal
import math
import random
from datetime import UTC, date, datetime
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest

from cdc_assets.sources.postgres import pg_values as pv
from cdc_assets.sources.postgres.pg_values import (
    SESSION_SETTINGS,
    UNREPRESENTABLE_COLUMN,
    PgColumn,
    arrow_schema,
    arrow_type,
    decode_text_table,
    numeric_precision_scale,
    parse_array_literal,
    spark_schema,
)

INT2, INT4, INT8, OID, FLOAT4, FLOAT8, BOOL, NUMERIC = 21, 23, 20, 26, 700, 701, 16, 1700
DATE, TIMESTAMP, TIMESTAMPTZ, BYTEA, TEXT, UUID, INTERVAL, BOX = 1082, 1114, 1184, 17, 25, 2950, 1186, 603
ARRAY_OF = {INT4: 1007, TEXT: 1009, NUMERIC: 1231, DATE: 1182, TIMESTAMPTZ: 1185, BYTEA: 1001, BOOL: 1000}


def numeric_typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | (scale & 0x7FF)) + 4


def col(name: str, oid: int, typmod: int = -1) -> PgColumn:
    return PgColumn(name, oid, typmod, "", "N", None, None, False)


def array_col(name: str, elem_oid: int, typmod: int = -1) -> PgColumn:
    return PgColumn(name, ARRAY_OF.get(elem_oid, 0), typmod, "", "A", elem_oid, None, False)


def decode(column: PgColumn, texts: list[str | None]) -> tuple[list[object], list[dict[str, str] | None]]:
    """Decode one column; returns its Python values and the unrepresentable map per row."""
    table = decode_text_table([column], pa.table({column.name: pa.array(texts, type=pa.string())}))
    assert table.schema == arrow_schema([column])
    unrepresentable = [
        None if entries is None else dict(entries) for entries in table.column(UNREPRESENTABLE_COLUMN).to_pylist()
    ]
    return table.column(column.name).to_pylist(), unrepresentable


# --- settings and mapping ---


def test_session_settings_are_canonical() -> None:
    assert SESSION_SETTINGS["DateStyle"] == "ISO"
    assert SESSION_SETTINGS["TimeZone"] == "UTC"
    assert SESSION_SETTINGS["IntervalStyle"] == "iso_8601"
    assert SESSION_SETTINGS["extra_float_digits"] == "3"
    assert SESSION_SETTINGS["bytea_output"] == "hex"
    assert SESSION_SETTINGS["client_encoding"] == "UTF8"
    assert "-c DateStyle=ISO" in pv.libpq_options()
    assert "-c TimeZone=UTC" in pv.libpq_options()


@pytest.mark.parametrize(
    ("column", "expected"),
    [
        (col("a", INT2), pa.int16()),
        (col("a", INT4), pa.int32()),
        (col("a", INT8), pa.int64()),
        (col("a", OID), pa.int64()),
        (col("a", FLOAT4), pa.float32()),
        (col("a", FLOAT8), pa.float64()),
        (col("a", BOOL), pa.bool_()),
        (col("a", NUMERIC, numeric_typmod(10, 2)), pa.decimal128(10, 2)),
        (col("a", NUMERIC), pa.decimal128(38, 18)),
        (col("a", NUMERIC, numeric_typmod(38, 0)), pa.decimal128(38, 0)),
        (col("a", NUMERIC, numeric_typmod(40, 2)), pa.decimal128(38, 18)),
        (col("a", DATE), pa.date32()),
        (col("a", TIMESTAMP), pa.timestamp("us")),
        (col("a", TIMESTAMPTZ), pa.timestamp("us", tz="UTC")),
        (col("a", BYTEA), pa.binary()),
        (col("a", TEXT), pa.string()),
        (col("a", UUID), pa.string()),
        (col("a", INTERVAL), pa.string()),
        (col("a", 3802), pa.string()),  # jsonb
        (col("a", 99999), pa.string()),  # an enum or any other type
        (array_col("a", INT4), pa.list_(pa.int32())),
        (array_col("a", NUMERIC, numeric_typmod(5, 1)), pa.list_(pa.decimal128(5, 1))),
        (array_col("a", TIMESTAMPTZ), pa.list_(pa.timestamp("us", tz="UTC"))),
        (array_col("a", UUID), pa.list_(pa.string())),
        (PgColumn("a", 22, -1, "int2vector", "A", INT2, "smallint", False), pa.string()),
    ],
)
def test_arrow_type(column: PgColumn, expected: pa.DataType) -> None:
    assert arrow_type(column) == expected


def test_numeric_precision_scale_edge_typmods() -> None:
    assert numeric_precision_scale(-1) == (38, 18)
    assert numeric_precision_scale(numeric_typmod(5, 5)) == (5, 5)
    assert numeric_precision_scale(numeric_typmod(2, -3)) == (5, 0)  # PostgreSQL 15 negative scale
    assert numeric_precision_scale(numeric_typmod(3, 5)) == (5, 5)  # scale above precision
    assert numeric_precision_scale(numeric_typmod(1000, 2)) == (38, 18)


def test_arrow_and_spark_schema() -> None:
    from pyspark.sql import types as T

    columns = [
        col("s", INT2),
        col("i", INT4),
        col("l", INT8),
        col("f", FLOAT4),
        col("d", FLOAT8),
        col("b", BOOL),
        col("n", NUMERIC, numeric_typmod(10, 2)),
        col("dt", DATE),
        col("ts", TIMESTAMP),
        col("tz", TIMESTAMPTZ),
        col("by", BYTEA),
        col("t", TEXT),
        array_col("a", INT4),
    ]
    schema = arrow_schema(columns)
    assert schema.names == [c.name for c in columns] + [UNREPRESENTABLE_COLUMN]
    assert schema.field(UNREPRESENTABLE_COLUMN).type == pa.map_(pa.string(), pa.string())
    assert all(field.nullable for field in schema)
    assert spark_schema(columns) == T.StructType(
        [
            T.StructField("s", T.ShortType()),
            T.StructField("i", T.IntegerType()),
            T.StructField("l", T.LongType()),
            T.StructField("f", T.FloatType()),
            T.StructField("d", T.DoubleType()),
            T.StructField("b", T.BooleanType()),
            T.StructField("n", T.DecimalType(10, 2)),
            T.StructField("dt", T.DateType()),
            T.StructField("ts", T.TimestampNTZType()),
            T.StructField("tz", T.TimestampType()),
            T.StructField("by", T.BinaryType()),
            T.StructField("t", T.StringType()),
            T.StructField("a", T.ArrayType(T.IntegerType(), True)),
            T.StructField(UNREPRESENTABLE_COLUMN, T.MapType(T.StringType(), T.StringType(), True)),
        ]
    )


def test_reserved_and_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="reserved"):
        arrow_schema([col(UNREPRESENTABLE_COLUMN, INT4)])
    with pytest.raises(ValueError, match="duplicate"):
        arrow_schema([col("a", INT4), col("a", TEXT)])


# --- scalars ---


def test_integers() -> None:
    assert decode(col("a", INT2), ["-32768", "32767", None, "0"]) == ([-32768, 32767, None, 0], [None] * 4)
    assert decode(col("a", INT4), ["-2147483648", "2147483647"])[0] == [-(2**31), 2**31 - 1]
    assert decode(col("a", INT8), ["-9223372036854775808", "9223372036854775807"])[0] == [-(2**63), 2**63 - 1]
    assert decode(col("a", OID), ["4294967295"])[0] == [4294967295]


def test_integer_fallback_keeps_text_it_cannot_parse() -> None:
    values, unrepresentable = decode(col("a", INT2), ["1", "40000", "x", None])
    assert values == [1, None, None, None]
    assert unrepresentable == [None, {"a": "40000"}, {"a": "x"}, None]


def test_floats_keep_nan_and_infinities() -> None:
    values, unrepresentable = decode(
        col("a", FLOAT8), ["NaN", "Infinity", "-Infinity", "1e+300", "-0", "0.1", "1.5e-07", None]
    )
    assert math.isnan(values[0])
    assert values[1:7] == [math.inf, -math.inf, 1e300, 0.0, 0.1, 1.5e-07]
    assert math.copysign(1, values[4]) == -1
    assert values[7] is None
    assert unrepresentable == [None] * 8


def test_float4_shortest_text_is_exact() -> None:
    texts = ["1.1", "3.4028235e+38", "1e-45", "0.1", "NaN", "-Infinity"]
    table = decode_text_table([col("a", FLOAT4)], pa.table({"a": texts}))
    decoded = table.column("a").to_numpy()
    assert decoded.dtype == np.float32
    expected = np.array([np.float32(t) for t in texts], dtype=np.float32)
    assert np.array_equal(decoded, expected, equal_nan=True)


def test_bool() -> None:
    assert decode(col("a", BOOL), ["t", "f", None]) == ([True, False, None], [None, None, None])
    assert decode(col("a", BOOL), ["t", "yes"]) == ([True, None], [None, {"a": "yes"}])


def test_numeric_within_precision_and_scale() -> None:
    column = col("a", NUMERIC, numeric_typmod(10, 2))
    values, unrepresentable = decode(column, ["1.50", "-0.05", "12345678.99", "0.00", "-12345678.99", None])
    assert values == [
        Decimal("1.50"),
        Decimal("-0.05"),
        Decimal("12345678.99"),
        Decimal("0.00"),
        Decimal("-12345678.99"),
        None,
    ]
    assert unrepresentable == [None] * 6


def test_numeric_unrepresentable_is_never_rounded() -> None:
    column = col("a", NUMERIC, numeric_typmod(10, 2))
    texts = ["NaN", "Infinity", "-Infinity", "123456789.00", "1.005", "1.5"]
    values, unrepresentable = decode(column, texts)
    assert values == [None] * 5 + [Decimal("1.50")]
    assert unrepresentable == [{"a": text} for text in texts[:5]] + [None]


def test_unconstrained_numeric() -> None:
    forty_digits = "1234567890123456789012345678901234567890"
    texts = [
        "12345678901234567890.123456789012345678",  # 20 + 18 digits: fits decimal(38, 18)
        "123456789012345678901.5",  # 21 integer digits
        forty_digits,
        "0.1234567890123456789",  # 19 fractional digits
        "1.500000000000000000000000",  # trailing zeros beyond the scale: the value fits exactly
        "-0.000000000000000001",
        "NaN",
    ]
    values, unrepresentable = decode(col("a", NUMERIC), texts)
    assert values == [
        Decimal("12345678901234567890.123456789012345678"),
        None,
        None,
        None,
        Decimal("1.5"),
        Decimal("-0.000000000000000001"),
        None,
    ]
    assert [u and u["a"] for u in unrepresentable] == [None, texts[1], texts[2], texts[3], None, None, "NaN"]


def test_numeric_that_arrow_would_wrap_around_is_unrepresentable() -> None:
    """Alone in its batch (the one-cast path): Arrow's text-to-decimal cast wraps a value whose digits pass 2**127
    after rescaling, or a text of more than 38 digits, instead of refusing it."""
    for column, text in [
        (col("a", NUMERIC), "-3333333333333333333333333333333333333333.5"),  # became 88653375934657485763.83...
        (col("a", NUMERIC), "12345678901234567890123.5"),
        (col("a", NUMERIC, numeric_typmod(10, 2)), "1.5" + "0" * 40),  # became 0.00
        (col("a", NUMERIC, numeric_typmod(38, 0)), "-24.0525388724580178176" + "0" * 18),  # became 0
    ]:
        values, unrepresentable = decode(column, [text])
        exact = Decimal(text)
        if values == [None]:
            assert unrepresentable == [{"a": text}], text
        else:  # only trailing zeros beyond the scale: the value itself
            assert values == [exact] and unrepresentable == [None], text
    array_text = "{-3333333333333333333333333333333333333333.5}"  # array elements take the same path
    assert decode(array_col("a", NUMERIC), [array_text, "{1.5}"]) == (
        [None, [Decimal("1.5")]],
        [{"a": array_text}, None],
    )


def _exact_decimal(text: str, precision: int, scale: int) -> Decimal | None:
    """The oracle: the value of ``text`` in decimal(precision, scale), or None when it does not fit exactly."""
    with decimal.localcontext(decimal.Context(prec=500)):
        value = Decimal(text)
        quantized = value.quantize(Decimal(1).scaleb(-scale))
        if quantized != value or abs(quantized) >= Decimal(10) ** (precision - scale):
            return None
        return quantized


@pytest.mark.parametrize(("precision", "scale"), [(38, 18), (38, 0), (38, 38), (38, 1), (30, 10), (10, 2), (1, 0)])
def test_numeric_decoding_equals_exact_decimal_arithmetic(precision: int, scale: int) -> None:
    """Random texts of 0-45 integer and 0-40 fractional digits, some with trailing zeros, decoded one per batch (the
    one-cast path) and all in one batch: each is its exact value or unrepresentable, as exact arithmetic says."""
    rng = random.Random(precision * 100 + scale)

    def digits(count: int) -> str:
        return "".join(rng.choice("0123456789") for _ in range(count))

    texts = []
    for _ in range(400):
        integer_digits = rng.choice([0, 1, 2, 9, 18, 19, 20, 21, 22, 30, 37, 38, 39, 45])
        integer = "0" if integer_digits == 0 else str(rng.randint(1, 9)) + digits(integer_digits - 1)
        fraction = digits(rng.choice([0, 0, 1, 2, 9, 17, 18, 19, 25, 38, 40])) + "0" * rng.choice([0, 0, 3, 25])
        texts.append(rng.choice(["", "-"]) + integer + (f".{fraction}" if fraction else ""))
    column = col("a", NUMERIC, -1 if (precision, scale) == (38, 18) else numeric_typmod(precision, scale))
    expected = [_exact_decimal(text, precision, scale) for text in texts]
    assert any(value is None for value in expected) and any(value is not None for value in expected)
    batch = decode(column, texts)
    for row, text in enumerate(texts):
        for values, unrepresentable in [decode(column, [text]), ([batch[0][row]], [batch[1][row]])]:
            assert values == [expected[row]], text
            assert unrepresentable == [None if expected[row] is not None else {"a": text}], text


def test_numeric_scale_zero_and_all_fractional() -> None:
    assert decode(col("a", NUMERIC, numeric_typmod(3, 0)), ["999", "-5", "1000"]) == (
        [Decimal(999), Decimal(-5), None],
        [None, None, {"a": "1000"}],
    )
    assert decode(col("a", NUMERIC, numeric_typmod(5, 5)), ["0.12345", "-0.00001", "1.00000"]) == (
        [Decimal("0.12345"), Decimal("-0.00001"), None],
        [None, None, {"a": "1.00000"}],
    )


def test_dates() -> None:
    texts = [
        "2024-01-02",
        "0001-01-01",
        "9999-12-31",
        "infinity",
        "-infinity",
        "0044-03-15 BC",
        "10000-01-01",
    ]
    values, unrepresentable = decode(col("a", DATE), [*texts, None])
    assert values == [date(2024, 1, 2), date(1, 1, 1), date(9999, 12, 31), None, None, None, None, None]
    assert unrepresentable == [None] * 3 + [{"a": t} for t in texts[3:]] + [None]


def test_date_cast_fallback_marks_invalid_text() -> None:
    assert decode(col("a", DATE), ["2024-02-29", "2023-02-29"]) == (
        [date(2024, 2, 29), None],
        [None, {"a": "2023-02-29"}],
    )


def test_timestamp_fractional_seconds_are_exact() -> None:
    texts = [
        "2024-01-02 03:04:05",
        "2024-01-02 03:04:05.1",
        "2024-01-02 03:04:05.000001",
        "2024-01-02 03:04:05.999999",
        "2024-01-02 03:04:05.12345",
        "0001-01-01 00:00:00",
        "9999-12-31 23:59:59.999999",
        None,
    ]
    values, unrepresentable = decode(col("a", TIMESTAMP), texts)
    assert values == [
        datetime(2024, 1, 2, 3, 4, 5),
        datetime(2024, 1, 2, 3, 4, 5, 100000),
        datetime(2024, 1, 2, 3, 4, 5, 1),
        datetime(2024, 1, 2, 3, 4, 5, 999999),
        datetime(2024, 1, 2, 3, 4, 5, 123450),
        datetime(1, 1, 1),
        datetime(9999, 12, 31, 23, 59, 59, 999999),
        None,
    ]
    assert unrepresentable == [None] * 8


def test_timestamp_unrepresentable() -> None:
    texts = [
        "infinity",
        "-infinity",
        "0044-03-15 12:00:00 BC",
        "10000-01-01 00:00:00",
        "2024-01-02 03:04:05+00",
    ]
    values, unrepresentable = decode(col("a", TIMESTAMP), texts)
    assert values == [None] * 5
    assert unrepresentable == [{"a": t} for t in texts]


def test_timestamptz_utc_and_other_offsets() -> None:
    texts = [
        "2024-01-02 03:04:05.123456+00",
        "2024-01-02 03:04:05+00",
        "2024-01-02 03:04:05.5+05:30",  # a session without TimeZone=UTC: per-value fallback
        "1900-01-01 00:00:00-00:09:21",  # historical LMT offsets have seconds
        "0001-01-01 00:30:00+01",  # before year 1 in UTC
        "infinity",
        "0044-03-15 12:00:00+00 BC",
        "2024-01-02 03:04:05",  # no offset: not timestamptz output
        None,
    ]
    values, unrepresentable = decode(col("a", TIMESTAMPTZ), texts)
    assert values == [
        datetime(2024, 1, 2, 3, 4, 5, 123456, tzinfo=UTC),
        datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        datetime(2024, 1, 1, 21, 34, 5, 500000, tzinfo=UTC),
        datetime(1900, 1, 1, 0, 9, 21, tzinfo=UTC),
        None,
        None,
        None,
        None,
        None,
    ]
    assert unrepresentable == [None] * 4 + [{"a": t} for t in texts[4:8]] + [None]


def test_bytea_hex() -> None:
    texts = ["\\x00ff", "\\x", None, "\\x000102feFF", "\\x" + "ab" * 1000]
    values, unrepresentable = decode(col("a", BYTEA), texts)
    assert values == [b"\x00\xff", b"", None, b"\x00\x01\x02\xfe\xff", b"\xab" * 1000]
    assert unrepresentable == [None] * 5


def test_bytea_sliced_input_array() -> None:
    texts = pa.array(["\\x01", None, "\\x0203", "\\x04"]).slice(1)
    table = decode_text_table([col("a", BYTEA)], pa.table({"a": texts}))
    assert table.column("a").to_pylist() == [None, b"\x02\x03", b"\x04"]


def test_bytea_fallback_escape_format_and_invalid() -> None:
    values, unrepresentable = decode(col("a", BYTEA), ["\\x00", "a\\000\\\\b\\377", "\\x0", "ü"])
    assert values == [b"\x00", b"a\x00\\b\xff", None, None]
    assert unrepresentable == [None, None, {"a": "\\x0"}, {"a": "ü"}]


def test_text_survives_exactly() -> None:
    texts = ["", None, 'a "quoted", comma', "back\\slash", "line\nbreak\r\ntab\t", "ünïcödé 😀 日本", "NULL"]
    assert decode(col("a", TEXT), texts) == (texts, [None] * len(texts))


@pytest.mark.parametrize(
    "oid", [UUID, INTERVAL, 114, 3802, 1042, 1043, 19, 1083, 1266, 869, 650, 829, 790, 142, 1560, 3904]
)
def test_other_types_keep_text(oid: int) -> None:
    texts = ["some text", "", None, "{1,2}"]
    assert decode(col("a", oid), texts) == (texts, [None] * 4)


def test_large_string_and_chunked_input() -> None:
    chunked = pa.chunked_array([pa.array(["1", None]), pa.array(["3"])])
    table = decode_text_table(
        [col("a", INT4), col("b", TEXT)],
        pa.table({"a": chunked, "b": pa.chunked_array([pa.array(["x", "y", "z"], type=pa.large_string())])}),
    )
    assert table.to_pydict() == {"a": [1, None, 3], "b": ["x", "y", "z"], UNREPRESENTABLE_COLUMN: [None] * 3}


def test_missing_text_column() -> None:
    with pytest.raises(KeyError, match="b"):
        decode_text_table([col("a", INT4), col("b", INT4)], pa.table({"a": ["1"]}))


# --- arrays ---


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{}", []),
        ("{1,2,3}", ["1", "2", "3"]),
        ("{NULL,1}", [None, "1"]),
        ('{"NULL",NULL,null}', ["NULL", None, "null"]),
        ('{"a,b","","x\\"y\\\\z","{}"," spaced "}', ["a,b", "", 'x"y\\z', "{}", " spaced "]),
        ('{"line\nbreak",ünï}', ["line\nbreak", "ünï"]),
        ('{"2024-01-01 00:00:00+00"}', ["2024-01-01 00:00:00+00"]),
    ],
)
def test_parse_array_literal(text: str, expected: list[str | None]) -> None:
    assert parse_array_literal(text) == expected


@pytest.mark.parametrize("text", ["{{1,2},{3,4}}", "[0:1]={1,2}", "{1,2", '{"a}', '{"a"b}', "{a,,b}"])
def test_parse_array_literal_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_array_literal(text)


def test_parse_array_literal_box_delimiter() -> None:
    assert parse_array_literal("{(1,1),(0,0);(2,2),(1,1)}", ";") == ["(1,1),(0,0)", "(2,2),(1,1)"]


def test_int_array() -> None:
    texts = ["{1,NULL,3}", "{}", None, "{-2147483648}", "{{1,2},{3,4}}", "[0:1]={1,2}"]
    values, unrepresentable = decode(array_col("a", INT4), texts)
    assert values == [[1, None, 3], [], None, [-(2**31)], None, None]
    assert unrepresentable == [None, None, None, None, {"a": texts[4]}, {"a": texts[5]}]


def test_text_array_quoting() -> None:
    texts = ['{"a,b","NULL",NULL,"","x\\"y\\\\z"}', "{plain,words}", '{""}', "{}"]
    values, unrepresentable = decode(array_col("a", TEXT), texts)
    assert values == [["a,b", "NULL", None, "", 'x"y\\z'], ["plain", "words"], [""], []]
    assert unrepresentable == [None] * 4


def test_array_mixes_simple_and_quoted_rows_in_order() -> None:
    texts = ["{a,b}", '{"c d",e}', None, "{f}", '{"g"}', "{}", "{h,NULL}"]
    values, _ = decode(array_col("a", TEXT), texts)
    assert values == [["a", "b"], ["c d", "e"], None, ["f"], ["g"], [], ["h", None]]


def test_array_with_unrepresentable_element_is_unrepresentable() -> None:
    texts = ["{1.50,NaN}", "{2.00,NULL}", "{1.234}"]
    values, unrepresentable = decode(array_col("a", NUMERIC, numeric_typmod(10, 2)), texts)
    assert values == [None, [Decimal("2.00"), None], None]
    assert unrepresentable == [{"a": texts[0]}, None, {"a": texts[2]}]
    values, unrepresentable = decode(array_col("a", DATE), ["{2024-01-01,infinity}", "{2024-01-01}"])
    assert values == [None, [date(2024, 1, 1)]]
    assert unrepresentable == [{"a": "{2024-01-01,infinity}"}, None]


def test_arrays_of_timestamptz_bytea_bool() -> None:
    values, _ = decode(array_col("a", TIMESTAMPTZ), ['{"2024-01-01 00:00:00.5+00",NULL}'])
    assert values == [[datetime(2024, 1, 1, 0, 0, 0, 500000, tzinfo=UTC), None]]
    values, _ = decode(array_col("a", BYTEA), ['{"\\\\x00ff","\\\\x",NULL}'])
    assert values == [[b"\x00\xff", b"", None]]
    values, _ = decode(array_col("a", BOOL), ["{t,f,NULL}"])
    assert values == [[True, False, None]]


def test_box_array_keeps_box_text() -> None:
    column = PgColumn("a", 1020, -1, "box[]", "A", BOX, "box", False)
    assert decode(column, ["{(1,1),(0,0);(2,2),(1,1)}"])[0] == [["(1,1),(0,0)", "(2,2),(1,1)"]]


# --- the unrepresentable map ---


def test_unrepresentable_map_per_row_in_column_order() -> None:
    columns = [col("n", NUMERIC, numeric_typmod(5, 2)), col("t", TEXT), col("d", DATE), array_col("a", INT4)]
    texts = pa.table(
        {
            "n": ["NaN", "1.00", None, "1000.00"],
            "t": ["x", "y", None, "z"],
            "d": ["infinity", "2024-01-01", None, "0001-01-01 BC"],
            "a": ["{1}", "{{1}}", None, "{}"],
        }
    )
    table = decode_text_table(columns, texts)
    assert table.column(UNREPRESENTABLE_COLUMN).to_pylist() == [
        [("n", "NaN"), ("d", "infinity")],
        [("a", "{{1}}")],
        None,
        [("n", "1000.00"), ("d", "0001-01-01 BC")],
    ]
    assert table.column("n").to_pylist() == [None, Decimal("1.00"), None, None]
    assert table.column("t").to_pylist() == ["x", "y", None, "z"]


def test_no_unrepresentable_value_gives_null_map() -> None:
    table = decode_text_table([col("a", INT4)], pa.table({"a": ["1", None]}))
    assert table.column(UNREPRESENTABLE_COLUMN).null_count == 2


def test_empty_table() -> None:
    columns = [col("a", INT4), array_col("b", TEXT), col("c", BYTEA)]
    texts = pa.table({"a": pa.array([], pa.string()), "b": pa.array([], pa.string()), "c": pa.array([], pa.string())})
    table = decode_text_table(columns, texts)
    assert table.num_rows == 0
    assert table.schema == arrow_schema(columns)


# --- CSV segmentation (the COPY path without a database) ---


def test_copy_segments_cut_only_at_row_ends() -> None:
    rows = [b'1,"a\nb"\n', b'2,""\n', b'3,"x "" y\n\n"\n', b"4,\n", b'5,"' + b"z" * 300 + b'"\n']
    data = b"".join(rows)
    # chunks that do not follow rows: the scan finds the boundaries
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    segments = list(pv._copy_segments(chunks, 16))
    assert b"".join(segments) == data
    assert len(segments) > 1
    for segment in segments:
        assert segment.endswith(b"\n")
        assert segment.count(b'"') % 2 == 0
    # one chunk per row (what PostgreSQL sends)
    segments = list(pv._copy_segments(rows, 16))
    assert segments == [rows[0] + rows[1] + rows[2], rows[3] + rows[4]]


def test_csv_segment_distinguishes_null_and_empty_string() -> None:
    segment = b'1,,""\n,"a\r\nb","say ""hi"""\n'
    table = pa.Table.from_batches(list(pv._parse_csv_segment(segment, ["c0", "c1", "c2"])))
    assert table.to_pydict() == {"c0": ["1", None], "c1": [None, "a\r\nb"], "c2": ["", 'say "hi"']}


def test_csv_segment_single_column_null_rows_are_empty_lines() -> None:
    table = pa.Table.from_batches(list(pv._parse_csv_segment(b'\n""\nx\n\n', ["c0"])))
    assert table.column("c0").to_pylist() == [None, "", "x", None]


def test_csv_segment_keeps_a_leading_byte_order_mark() -> None:
    segment = "\ufeffabc,1\n\ufeffdef,2\n".encode()
    table = pa.Table.from_batches(list(pv._parse_csv_segment(segment, ["c0", "c1"])))
    assert table.column("c0").to_pylist() == ["\ufeffabc", "\ufeffdef"]
    single = pa.Table.from_batches(list(pv._parse_csv_segment("\ufeff\n\n".encode(), ["c0"])))
    assert single.column("c0").to_pylist() == ["\ufeff", None]


def test_last_row_end_respects_quotes() -> None:
    assert pv._last_row_end(bytearray(b'1,"a\nb"\n2,"c\nd')) == 8
    assert pv._last_row_end(bytearray(b'1,"a\nb')) == 0
    assert pv._last_row_end(bytearray(b'1,""""\n2,"x""\n')) == 7


def test_decimal_per_value_parser() -> None:
    parse = pv._decimal_parser(10, 2)
    assert parse("1.5") == Decimal("1.5")
    assert parse("12345678.990") == Decimal("12345678.99")
    for text in ["1.005", "123456789.00", "NaN", "-Infinity"]:
        with pytest.raises(ValueError):
            parse(text)
