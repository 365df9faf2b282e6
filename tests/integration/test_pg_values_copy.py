"""The converter against the real PostgreSQL server: COPY ... TO STDOUT (FORMAT csv) and pgoutput deliver the
same text, decoded into the same typed values. Expected values are written by hand, not computed by the
converter."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pytest
from psycopg import sql

from cdc_assets.sources.postgres.pg_values import (
    UNREPRESENTABLE_COLUMN,
    PgColumn,
    apply_session_settings,
    arrow_schema,
    columns_from_catalog,
    copy_query_to_arrow,
    decode_text_table,
)
from tests.integration.support import PG_PORT, PG_SOCKET

DATABASE = "codec_test"


def _dsn(dbname: str) -> str:
    return f"host={PG_SOCKET} port={PG_PORT} user=postgres dbname={dbname}"


@pytest.fixture(scope="module")
def pg(postgres_server: dict[str, str]) -> Iterator[psycopg.Connection]:
    """Autocommit connection with the session settings to a fresh database ``codec_test`` (dropped after)."""
    admin = psycopg.connect(_dsn("postgres"), autocommit=True)
    admin.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(DATABASE)))
    admin.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
    conn = psycopg.connect(_dsn(DATABASE), autocommit=True)
    apply_session_settings(conn)
    try:
        yield conn
    finally:
        conn.close()
        admin.execute(sql.SQL("drop database {} with (force)").format(sql.Identifier(DATABASE)))
        admin.close()


COLUMNS_SQL = """
    id integer primary key,
    i2 smallint, i4 integer, i8 bigint, o oid, f4 real, f8 double precision, b boolean,
    n numeric(10,2), nu numeric, d date, ts timestamp, tz timestamptz, by bytea,
    u uuid, j json, jb jsonb, t text, vc varchar(10), ch char(4), nm name, tm time, ttz timetz, iv interval,
    ip inet, cr cidr, mac macaddr, m money, x xml, bt bit(4), en mood, rg int4range,
    ai integer[], at text[], an numeric(10,2)[], ad date[], atz timestamptz[], aby bytea[], ab boolean[]
"""

TRICKY_TEXT = 'He said "hi", then\nleft;\r\n\ttab \\ back\\\\slash ünïcödé 😀 日本'

# Input text per row (the server parses it with the column's input function); missing columns are NULL.
ROWS: list[dict[str, str]] = [
    {
        "id": "1",
        "i2": "-32768",
        "i4": "2147483647",
        "i8": "-9223372036854775808",
        "o": "4294967295",
        "f4": "1.1",
        "f8": "0.1",
        "b": "t",
        "n": "12345678.99",
        "nu": "-123.456",
        "d": "2024-02-29",
        "ts": "2024-01-02 03:04:05.123456",
        "tz": "2024-01-02 03:04:05.123456+02",
        "by": "\\x00ff10",
        "u": "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
        "j": '{"b": 1,  "a": [1, 2]}',
        "jb": '{"b": 1,  "a": [1, 2]}',
        "t": "hello",
        "vc": "short",
        "ch": "ab",
        "nm": "a_name",
        "tm": "03:04:05.5",
        "ttz": "03:04:05+05:30",
        "iv": "1 day 2 hours 3.5 seconds",
        "ip": "192.168.0.1/24",
        "cr": "10.0.0.0/8",
        "mac": "08-00-2b-01-02-03",
        "m": "12.5",
        "x": "<a>x</a>",
        "bt": "1010",
        "en": "happy",
        "rg": "(0,4]",
        "ai": "{1,NULL,3}",
        "at": '{"a,b","NULL",NULL,"","x\\"y\\\\z","{}"," sp "}',
        "an": "{1.5,2}",
        "ad": "{2024-01-01,NULL}",
        "atz": '{"2024-01-01 00:00:00.000001+00","2024-06-30 23:59:59.5+00"}',
        "aby": '{"\\\\x00ff",NULL,"\\\\x"}',
        "ab": "{t,f,NULL}",
    },
    {"id": "2"},
    {
        "id": "3",
        "t": "",
        "vc": "",
        "ch": "",
        "nm": "",
        "j": '""',
        "by": "\\x",
        "at": '{""}',
        "ai": "{}",
        "aby": "{}",
    },
    {
        "id": "4",
        "f4": "NaN",
        "f8": "-Infinity",
        "n": "NaN",
        "nu": "NaN",
        "d": "infinity",
        "ts": "-infinity",
        "tz": "infinity",
        "ai": "{{1,2},{3,4}}",
        "at": "[0:1]={a,b}",
        "ad": "{2024-01-01,infinity}",
        "an": "{1.5,NaN}",
    },
    {
        "id": "5",
        "f4": "-Infinity",
        "f8": "1e300",
        "n": "-0.5",
        "nu": "1234567890123456789012345678901234567890",
        "d": "0044-03-15 BC",
        "ts": "9999-12-31 23:59:59.999999",
        "tz": "0001-01-01 00:00:00+00",
        "t": TRICKY_TEXT,
        "by": "\\x00000000ff00",
        "atz": "{infinity}",
        "at": '{"line\nbreak","tab\there",ünï}',
    },
    {
        "id": "6",
        "f8": "NaN",
        "n": "-12345678.99",
        "nu": "0.1234567890123456789",
        "d": "10000-01-01",
        "ts": "0044-03-15 12:00:00 BC",
        "tz": "1999-12-31 23:59:59.999999+00",
    },
    {
        "id": "7",
        "nu": "1.500000000000000000000",
        "n": "1.5",
        "ts": "2024-01-02 03:04:05.000001",
        "tz": "2024-01-02 03:04:05.1+00",
        "d": "0001-01-01",
    },
    {"id": "8", "nu": "Infinity", "ts": "10000-01-01 00:00:00", "tz": "-infinity"},
]

EXPECTED: list[dict[str, Any]] = [
    {
        "id": 1,
        "i2": -32768,
        "i4": 2147483647,
        "i8": -9223372036854775808,
        "o": 4294967295,
        "f4": "float32:1.1",
        "f8": 0.1,
        "b": True,
        "n": Decimal("12345678.99"),
        "nu": Decimal("-123.456"),
        "d": date(2024, 2, 29),
        "ts": datetime(2024, 1, 2, 3, 4, 5, 123456),
        "tz": datetime(2024, 1, 2, 1, 4, 5, 123456, tzinfo=UTC),
        "by": b"\x00\xff\x10",
        "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "j": '{"b": 1,  "a": [1, 2]}',
        "jb": '{"a": [1, 2], "b": 1}',
        "t": "hello",
        "vc": "short",
        "ch": "ab  ",
        "nm": "a_name",
        "tm": "03:04:05.5",
        "ttz": "03:04:05+05:30",
        "iv": "P1DT2H3.5S",
        "ip": "192.168.0.1/24",
        "cr": "10.0.0.0/8",
        "mac": "08:00:2b:01:02:03",
        "m": "$12.50",
        "x": "<a>x</a>",
        "bt": "1010",
        "en": "happy",
        "rg": "[1,5)",
        "ai": [1, None, 3],
        "at": ["a,b", "NULL", None, "", 'x"y\\z', "{}", " sp "],
        "an": [Decimal("1.50"), Decimal("2.00")],
        "ad": [date(2024, 1, 1), None],
        "atz": [
            datetime(2024, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
            datetime(2024, 6, 30, 23, 59, 59, 500000, tzinfo=UTC),
        ],
        "aby": [b"\x00\xff", None, b""],
        "ab": [True, False, None],
    },
    {"id": 2},
    {
        "id": 3,
        "t": "",
        "vc": "",
        "ch": "    ",
        "nm": "",
        "j": '""',
        "by": b"",
        "at": [""],
        "ai": [],
        "aby": [],
    },
    {
        "id": 4,
        "f4": "float32:nan",
        "f8": -math.inf,
        UNREPRESENTABLE_COLUMN: {
            "n": "NaN",
            "nu": "NaN",
            "d": "infinity",
            "ts": "-infinity",
            "tz": "infinity",
            "ai": "{{1,2},{3,4}}",
            "at": "[0:1]={a,b}",
            "an": "{1.50,NaN}",
            "ad": "{2024-01-01,infinity}",
        },
    },
    {
        "id": 5,
        "f4": "float32:-inf",
        "f8": 1e300,
        "n": Decimal("-0.50"),
        "ts": datetime(9999, 12, 31, 23, 59, 59, 999999),
        "tz": datetime(1, 1, 1, tzinfo=UTC),
        "t": TRICKY_TEXT,
        "by": b"\x00\x00\x00\x00\xff\x00",
        "at": ["line\nbreak", "tab\there", "ünï"],
        UNREPRESENTABLE_COLUMN: {
            "nu": "1234567890123456789012345678901234567890",
            "d": "0044-03-15 BC",
            "atz": "{infinity}",
        },
    },
    {
        "id": 6,
        "f8": math.nan,
        "n": Decimal("-12345678.99"),
        "tz": datetime(1999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        UNREPRESENTABLE_COLUMN: {
            "nu": "0.1234567890123456789",
            "d": "10000-01-01",
            "ts": "0044-03-15 12:00:00 BC",
        },
    },
    {
        "id": 7,
        "nu": Decimal("1.5"),
        "n": Decimal("1.50"),
        "ts": datetime(2024, 1, 2, 3, 4, 5, 1),
        "tz": datetime(2024, 1, 2, 3, 4, 5, 100000, tzinfo=UTC),
        "d": date(1, 1, 1),
    },
    {
        "id": 8,
        UNREPRESENTABLE_COLUMN: {"nu": "Infinity", "ts": "10000-01-01 00:00:00", "tz": "-infinity"},
    },
]


@pytest.fixture(scope="module")
def all_types(pg: psycopg.Connection) -> list[PgColumn]:
    pg.execute("create type mood as enum ('sad', 'happy')")
    pg.execute(sql.SQL("create table all_types ({})").format(sql.SQL(COLUMNS_SQL)))
    pg.execute("alter table all_types add column gone integer")
    pg.execute("alter table all_types drop column gone")
    insert_rows(pg, "all_types", ROWS)
    return columns_from_catalog(pg, "public", "all_types")


def insert_rows(conn: psycopg.Connection, table: str, rows: list[dict[str, str]]) -> None:
    """Insert rows given as input text per column (the server parses each with the column's input function)."""
    for row in rows:
        names = sql.SQL(", ").join(sql.Identifier(name) for name in row)
        values = sql.SQL(", ").join(sql.Placeholder() for _ in row)
        conn.execute(sql.SQL("insert into {} ({}) values ({})").format(sql.Identifier(table), names, values),
                     list(row.values()))  # fmt: skip


def _normalized(value: Any) -> Any:
    """NaN and float32 values in a comparable form."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def assert_rows(table: pa.Table, columns: list[PgColumn]) -> None:
    f4_values = table.column("f4").to_numpy(zero_copy_only=False)
    rows = table.to_pylist()
    assert len(rows) == len(EXPECTED)
    for index, (row, expected) in enumerate(zip(rows, EXPECTED, strict=True)):
        for column in [c.name for c in columns] + [UNREPRESENTABLE_COLUMN]:
            want = expected.get(column)
            got = row[column]
            if column == UNREPRESENTABLE_COLUMN and got is not None:
                got = dict(got)
            if isinstance(want, str) and want.startswith("float32:"):
                want_f32 = np.float32(want.split(":", 1)[1])
                got_f32 = f4_values[index]
                assert (np.isnan(want_f32) and np.isnan(got_f32)) or want_f32 == got_f32, (index, column)
                continue
            assert _normalized(got) == _normalized(want), (expected["id"], column, got, want)


def test_columns_from_catalog(pg: psycopg.Connection, all_types: list[PgColumn]) -> None:
    by_name = {c.name: c for c in all_types}
    assert [c.name for c in all_types][:4] == ["id", "i2", "i4", "i8"]
    assert "gone" not in by_name and len(all_types) == 39
    assert by_name["id"].not_null and not by_name["i2"].not_null
    assert (by_name["n"].type_name, by_name["n"].type_oid, by_name["n"].category) == (
        "numeric(10,2)",
        1700,
        "N",
    )
    assert by_name["tz"].type_name == "timestamp with time zone"
    assert (by_name["ai"].type_name, by_name["ai"].category, by_name["ai"].elem_oid) == ("integer[]", "A", 23)
    assert by_name["an"].elem_type_name == "numeric(10,2)"
    assert by_name["en"].category == "E" and by_name["en"].elem_oid is None
    assert by_name["u"].typmod == -1
    with pytest.raises(LookupError):
        columns_from_catalog(pg, "public", "no_such_table")


def test_copy_decodes_every_type(pg: psycopg.Connection, all_types: list[PgColumn]) -> None:
    query = sql.SQL("select * from all_types order by id")
    tables = list(copy_query_to_arrow(pg, query, all_types))
    assert len(tables) == 1
    table = tables[0]
    assert table.schema == arrow_schema(all_types)
    assert table.schema.field("n").type == pa.decimal128(10, 2)
    assert table.schema.field("nu").type == pa.decimal128(38, 18)
    assert table.schema.field("tz").type == pa.timestamp("us", tz="UTC")
    assert table.schema.field("ts").type == pa.timestamp("us")
    assert table.schema.field("aby").type == pa.list_(pa.binary())
    assert table.schema.field("u").type == pa.string()
    assert_rows(table, all_types)


def test_pgoutput_text_decodes_identically(pg: psycopg.Connection, all_types: list[PgColumn]) -> None:
    """The stream path: the same rows, inserted under a logical slot, arrive as pgoutput text and decode to
    the same typed table as the COPY path."""
    from cdc_assets.sources.postgres.pgoutput import PgOutputDecoder, RowChange

    pg.execute("create table all_types_stream (like all_types including all)")
    pg.execute("create publication codec_test_pub for table all_types_stream")
    pg.execute("select pg_create_logical_replication_slot('codec_test_slot', 'pgoutput')")
    try:
        # The test server runs with synchronous_commit=off: peek decodes only flushed WAL.
        pg.execute("set synchronous_commit = on")
        pg.execute("insert into all_types_stream select * from all_types order by id")
        decoder = PgOutputDecoder()
        rows: list[tuple[Any, ...]] = []
        for (data,) in pg.execute(
            "select data from pg_logical_slot_peek_binary_changes('codec_test_slot', null, null, "
            "'proto_version', '1', 'publication_names', 'codec_test_pub')"
        ):
            message = decoder.decode(data)
            if isinstance(message, RowChange):
                assert message.new is not None
                rows.append(message.new)
    finally:
        pg.execute("select pg_drop_replication_slot('codec_test_slot')")
    names = [c.name for c in all_types]
    texts = pa.table({name: pa.array([r[i] for r in rows], pa.string()) for i, name in enumerate(names)})
    streamed = decode_text_table(all_types, texts)
    assert_rows(streamed, all_types)
    (copied,) = copy_query_to_arrow(pg, sql.SQL("select * from all_types order by id"), all_types)
    assert [_normalized_row(r) for r in streamed.to_pylist()] == [_normalized_row(r) for r in copied.to_pylist()]


def _normalized_row(row: dict[str, Any]) -> dict[str, Any]:
    return {key: _normalized(value) for key, value in row.items()}


@pytest.fixture(scope="module")
def many(pg: psycopg.Connection) -> list[PgColumn]:
    pg.execute(
        """
        create table many as
        select g as id, repeat('x', g % 50) || E'\\n"' || g as s, g * 0.01 as n
        from generate_series(1, 2500) g
        """
    )
    pg.execute("alter table many alter column n type numeric(12,2)")
    return columns_from_catalog(pg, "public", "many")


def test_result_larger_than_batch_rows_arrives_in_batches(pg: psycopg.Connection, many: list[PgColumn]) -> None:
    query = sql.SQL("select * from many order by id")
    tables = list(copy_query_to_arrow(pg, query, many, batch_rows=1000, segment_bytes=4096))
    assert [t.num_rows for t in tables] == [1000, 1000, 500]
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    assert ids == list(range(1, 2501))
    texts = [s for t in tables for s in t.column("s").to_pylist()]
    assert texts == [("x" * (g % 50)) + '\n"' + str(g) for g in range(1, 2501)]
    numbers = [n for t in tables for n in t.column("n").to_pylist()]
    assert numbers == [Decimal(g) / 100 for g in range(1, 2501)]
    assert all(t.column(UNREPRESENTABLE_COLUMN).null_count == t.num_rows for t in tables)


def test_row_larger_than_a_segment(pg: psycopg.Connection) -> None:
    big = "y" * 300_000 + "\n" + '"' * 1000
    columns = [
        PgColumn("a", 25, -1, "text", "S", None, None, False),
        PgColumn("b", 17, -1, "bytea", "U", None, None, False),
    ]
    query = sql.SQL("select {}::text, decode(repeat('00ff', 200000), 'hex') from generate_series(1, 3)").format(
        sql.Literal(big)
    )
    tables = list(copy_query_to_arrow(pg, query, columns, segment_bytes=65536))
    assert sum(t.num_rows for t in tables) == 3
    for table in tables:
        assert table.column("a").to_pylist() == [big] * table.num_rows
        assert table.column("b").to_pylist() == [b"\x00\xff" * 200000] * table.num_rows


def test_single_column_nulls_and_empty_strings(pg: psycopg.Connection) -> None:
    columns = [PgColumn("a", 25, -1, "text", "S", None, None, False)]
    query = sql.SQL("select * from (values (null::text), (''), (' '), (null), ('NULL')) v(a)")
    (table,) = copy_query_to_arrow(pg, query, columns)
    assert table.column("a").to_pylist() == [None, "", " ", None, "NULL"]


def test_closing_early_cancels_the_copy(pg: psycopg.Connection, many: list[PgColumn]) -> None:
    batches = copy_query_to_arrow(pg, sql.SQL("select * from many"), many, batch_rows=10, segment_bytes=1024)
    first = next(batches)
    assert first.num_rows == 10
    batches.close()
    assert pg.execute("select 1").fetchone() == (1,)


def test_empty_result(pg: psycopg.Connection, many: list[PgColumn]) -> None:
    assert list(copy_query_to_arrow(pg, sql.SQL("select * from many where false"), many)) == []


def test_domains_decode_as_their_base_type(pg: psycopg.Connection) -> None:
    pg.execute("create domain price as numeric(12,2)")
    pg.execute("create domain price_again as price")
    pg.execute("create domain int_list as integer[]")
    pg.execute("create table with_domains (p price_again, ps price[], il int_list)")
    pg.execute("insert into with_domains values (1.5, '{2.25,NULL}', '{1,2}'), (null, '{}', null)")
    columns = columns_from_catalog(pg, "public", "with_domains")
    p, ps, il = columns
    assert (p.type_name, p.type_oid, p.typmod, p.domain_oid is not None) == (
        "price_again",
        1700,
        786438,
        True,
    )
    assert (ps.type_name, ps.elem_oid, ps.elem_type_name) == ("price[]", 1700, "numeric(12,2)")
    assert (il.type_name, il.type_oid, il.elem_oid) == ("int_list", 1007, 23)
    (table,) = copy_query_to_arrow(pg, sql.SQL("select * from with_domains"), columns)
    assert table.schema == arrow_schema(columns)
    assert table.schema.field("p").type == pa.decimal128(12, 2)
    assert table.to_pydict() == {
        "p": [Decimal("1.50"), None],
        "ps": [[Decimal("2.25"), None], []],
        "il": [[1, 2], None],
        UNREPRESENTABLE_COLUMN: [None, None],
    }


def test_session_settings_survive_a_rollback(postgres_server: dict[str, str]) -> None:
    with psycopg.connect(_dsn("postgres")) as conn:
        apply_session_settings(conn)
        conn.rollback()
        shown = conn.execute(
            """
            select current_setting('DateStyle'), current_setting('TimeZone'),
                   current_setting('IntervalStyle'),
                   current_setting('extra_float_digits'), current_setting('bytea_output'),
                   current_setting('client_encoding'), now()::text
            """
        ).fetchone()
    assert shown is not None
    assert shown[:6] == ("ISO, MDY", "UTC", "iso_8601", "3", "hex", "UTF8")
    assert shown[6].endswith("+00")


def test_byte_order_mark_at_the_start_of_a_value_survives(pg: psycopg.Connection) -> None:
    columns = [
        PgColumn("a", 25, -1, "text", "S", None, None, False),
        PgColumn("b", 23, -1, "integer", "N", None, None, False),
    ]
    query = sql.SQL("select chr(65279) || 'x' || g, g from generate_series(1, 300) g")
    tables = list(copy_query_to_arrow(pg, query, columns, batch_rows=100, segment_bytes=256))
    assert [t.num_rows for t in tables] == [100, 100, 100]
    assert [v for t in tables for v in t.column("a").to_pylist()] == [f"\ufeffx{g}" for g in range(1, 301)]
