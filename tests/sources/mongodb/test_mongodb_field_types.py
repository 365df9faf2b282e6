"""Declared top-level fields: which BSON values fit which declared type (``typed_fields.convert``), the rows and
Arrow tables they make (typed columns, ``_cdc_unrepresentable`` with the misfits' canonical extended JSON), and the
declarations the configuration accepts and refuses."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from bson.binary import Binary
from bson.datetime_ms import DatetimeMS
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.objectid import ObjectId
from bson.timestamp import Timestamp

from cdc_assets.config import ConfigError, FieldConfig, parse_config
from cdc_assets.sources.mongodb.catalog import CapturedCollection, document_row, rows_table
from cdc_assets.sources.mongodb.consistency import source_texts, typed_text
from cdc_assets.sources.mongodb.stream import Event, _row, change_schema
from cdc_assets.sources.mongodb.typed_fields import MISSING, arrow_type, convert

UTC = dt.UTC
NOON = dt.datetime(2024, 5, 1, 12, 30, 15, 123000)
MIDNIGHT = dt.datetime(2024, 5, 1)

# (declared type, BSON value, typed value that fits)
FITS: list[tuple[str, Any, Any]] = [
    ("string", "héllo", "héllo"),
    ("string", "", ""),
    ("int", 7, 7),
    ("int", Int64(-(2**31)), -(2**31)),
    ("int", Int64(2**31 - 1), 2**31 - 1),
    ("long", 7, 7),
    ("long", Int64(2**62), 2**62),
    ("double", 2.5, 2.5),
    ("double", 3, 3.0),
    ("double", Int64(2**53), float(2**53)),
    ("double", math.inf, math.inf),
    ("decimal(12,2)", Decimal128("12.5"), Decimal("12.50")),
    ("decimal(12,2)", Decimal128("-1234567890.12"), Decimal("-1234567890.12")),
    ("decimal(12,2)", Decimal128("7.000"), Decimal("7.00")),  # zeros beyond the scale carry no value
    ("decimal(12,2)", 42, Decimal("42.00")),
    ("decimal(12,2)", Int64(9999999999), Decimal("9999999999.00")),
    ("decimal(2,2)", Decimal128("0.99"), Decimal("0.99")),
    ("boolean", True, True),
    ("boolean", False, False),
    ("timestamp", NOON, NOON.replace(tzinfo=UTC)),
    ("timestamp", dt.datetime(1, 1, 1), dt.datetime(1, 1, 1, tzinfo=UTC)),
    ("date", MIDNIGHT, dt.date(2024, 5, 1)),
    ("binary", b"\x00\x01", b"\x00\x01"),
    ("binary", Binary(b"\xff", 0), b"\xff"),
]

# (declared type, BSON value, its canonical extended JSON kept in _cdc_unrepresentable)
MISFITS: list[tuple[str, Any, str]] = [
    ("string", 5, '{"$numberInt":"5"}'),
    ("string", ObjectId("0" * 24), '{"$oid":"000000000000000000000000"}'),
    ("string", ["a"], '["a"]'),
    ("int", Int64(2**31), '{"$numberLong":"2147483648"}'),
    ("int", Int64(-(2**31) - 1), '{"$numberLong":"-2147483649"}'),
    ("int", 1.0, '{"$numberDouble":"1.0"}'),
    ("int", True, "true"),
    ("long", "many", '"many"'),
    ("long", 2.0, '{"$numberDouble":"2.0"}'),
    ("long", Decimal128("3"), '{"$numberDecimal":"3"}'),
    ("long", False, "false"),
    ("double", "1.5", '"1.5"'),
    ("double", Int64(2**53 + 1), '{"$numberLong":"9007199254740993"}'),
    ("double", Decimal128("1.5"), '{"$numberDecimal":"1.5"}'),
    ("decimal(12,2)", Decimal128("0.125"), '{"$numberDecimal":"0.125"}'),
    ("decimal(12,2)", Decimal128("12345678901.5"), '{"$numberDecimal":"12345678901.5"}'),
    ("decimal(12,2)", Decimal128("NaN"), '{"$numberDecimal":"NaN"}'),
    ("decimal(12,2)", Decimal128("Infinity"), '{"$numberDecimal":"Infinity"}'),
    ("decimal(12,2)", Decimal128("1E+6000"), '{"$numberDecimal":"1E+6000"}'),
    ("decimal(12,2)", 1.5, '{"$numberDouble":"1.5"}'),
    ("decimal(12,2)", Int64(10**10), '{"$numberLong":"10000000000"}'),
    ("decimal(2,2)", Decimal128("1"), '{"$numberDecimal":"1"}'),
    ("boolean", 1, '{"$numberInt":"1"}'),
    ("boolean", "true", '"true"'),
    ("timestamp", "2024-05-01", '"2024-05-01"'),
    ("timestamp", Timestamp(1, 2), '{"$timestamp":{"t":1,"i":2}}'),
    ("timestamp", DatetimeMS(-62135596800001), '{"$date":{"$numberLong":"-62135596800001"}}'),
    ("date", NOON, '{"$date":{"$numberLong":"1714566615123"}}'),
    ("date", 20240501, '{"$numberInt":"20240501"}'),
    ("binary", "AAE=", '"AAE="'),
    ("binary", Binary(b"\x00" * 16, 4), '{"$binary":{"base64":"AAAAAAAAAAAAAAAAAAAAAA==","subType":"04"}}'),
    ("binary", {"a": 1}, '{"a":{"$numberInt":"1"}}'),
]


@pytest.mark.parametrize(("declared", "value", "typed"), FITS)
def test_a_value_of_a_fitting_bson_type_is_typed_without_text(declared: str, value: Any, typed: Any) -> None:
    result, text = convert(value, declared)
    assert text is None and result == typed and type(result) is type(typed), (result, text)
    # and the Arrow column of the type holds it exactly
    assert pa.array([result], arrow_type(declared)).to_pylist() == [typed]


@pytest.mark.parametrize(("declared", "value", "text"), MISFITS)
def test_a_value_that_does_not_fit_is_null_with_its_extended_json(declared: str, value: Any, text: str) -> None:
    assert convert(value, declared) == (None, text)


@pytest.mark.parametrize("declared", ["string", "int", "long", "double", "decimal(5,1)", "boolean", "timestamp",
                                      "date", "binary"])  # fmt: skip
def test_missing_and_null_are_null_without_text(declared: str) -> None:
    assert convert(MISSING, declared) == (None, None)
    assert convert(None, declared) == (None, None)


def test_nan_fits_double() -> None:
    typed, text = convert(math.nan, "double")
    assert text is None and math.isnan(typed)


def test_arrow_types_of_every_declared_type() -> None:
    assert [str(arrow_type(t)) for t in ("string", "int", "long", "double", "decimal(12,2)", "boolean")] == [
        "string", "int32", "int64", "double", "decimal128(12, 2)", "bool"
    ]  # fmt: skip
    assert [str(arrow_type(t)) for t in ("timestamp", "date", "binary")] == ["timestamp[us, tz=UTC]", "date32[day]",
                                                                            "binary"]  # fmt: skip


FIELDS = (FieldConfig("price", "decimal(12,2)"), FieldConfig("qty", "long"), FieldConfig("name", "string"),
          FieldConfig("updated", "timestamp"))  # fmt: skip
PRODUCTS = CapturedCollection("shop", "products", FIELDS)


def test_rows_carry_typed_columns_and_the_misfits_texts_in_declared_order() -> None:
    document = {"_id": 1, "qty": "many", "name": "lamp", "price": 9.99, "extra": [1]}
    row = document_row(document, FIELDS)
    assert row["price"] is None and row["qty"] is None and row["name"] == "lamp" and row["updated"] is None
    assert row["_cdc_unrepresentable"] == [("price", '{"$numberDouble":"9.99"}'), ("qty", '"many"')]
    assert row["document"] == (
        '{"_id":{"$numberInt":"1"},"qty":"many","name":"lamp","price":{"$numberDouble":"9.99"},'
        '"extra":[{"$numberInt":"1"}]}'
    )
    fitting = document_row({"_id": 2, "qty": Int64(3), "price": Decimal128("1.5"), "updated": NOON}, FIELDS)
    assert fitting["_cdc_unrepresentable"] is None and fitting["qty"] == 3 and fitting["price"] == Decimal("1.50")
    table = rows_table([row, fitting], PRODUCTS.arrow_schema)
    assert table.schema.names == ["_id_key", "_id", "document", "price", "qty", "name", "updated",
                                  "_cdc_unrepresentable"]  # fmt: skip
    assert table.column("qty").to_pylist() == [None, 3]
    assert table.column("_cdc_unrepresentable").to_pylist()[1] is None
    assert PRODUCTS.column_names == ["_id_key", "_id", "document", "price", "qty", "name", "updated"]
    # no declared field: the columns as before
    assert CapturedCollection("shop", "plain").arrow_schema.names == ["_id_key", "_id", "document",
                                                                      "_cdc_unrepresentable"]  # fmt: skip


def test_stream_rows_type_the_after_image_and_a_delete_leaves_the_fields_null() -> None:
    def event(operation: str, **raw: Any) -> Event:
        return Event(PRODUCTS, 1 << 32, None, {"operationType": operation, "clusterTime": Timestamp(1, 0), **raw}, 1)

    update = _row(event("update", fullDocument={"_id": 5, "qty": Int64(2), "price": "cheap"}))
    assert update is not None and update["after"]["qty"] == 2
    assert update["after"]["_cdc_unrepresentable"] == [("price", '"cheap"')]
    delete = _row(event("delete", documentKey={"_id": 5}))
    assert delete is not None and delete["after"] is None
    table = pa.Table.from_pylist([{**update, "_cdc_seq": 0}, {**delete, "_cdc_seq": 1}],
                                 schema=change_schema(PRODUCTS.arrow_schema))  # fmt: skip
    before = table.column("before").to_pylist()[1]
    assert before["qty"] is None and before["price"] is None and before["document"] is None
    assert table.column("after").to_pylist()[0]["qty"] == 2


# -- configuration -------------------------------------------------------------------------------------------------
SOURCE = {
    "name": "shop",
    "kind": "mongodb",
    "connection": {"uri": "${CDC_MONGODB_URI}"},
    "include": ["shop.*"],
}


def parse_tables(tables: list, kind: str = "mongodb"):
    if kind == "mongodb":
        source = {**SOURCE, "tables": tables}
    else:
        source = {"name": "pg", "kind": "postgres", "connection": {"host": "h", "dbname": "d", "user": "u"},
                  "tables": tables}  # fmt: skip
    raw = {"lake_root": "lake", "sources": [source]}
    return parse_config(raw, Path("/tmp"), {"CDC_MONGODB_URI": "mongodb://h/"}).sources[0]


def test_declared_fields_parse_in_order_with_normalized_types() -> None:
    fields = {"price": "decimal( 12 , 2 )", "qty": "long", "name": "string", "updated": "timestamp",
              "active": "BOOLEAN", "score": "double", "n": "int", "born": "date", "blob": "binary"}  # fmt: skip
    source = parse_tables([{"name": "shop.products", "fields": fields}, "shop.orders"])
    products, orders = source.tables
    assert [(f.name, f.type) for f in products.fields] == [
        ("price", "decimal(12,2)"), ("qty", "long"), ("name", "string"), ("updated", "timestamp"),
        ("active", "boolean"), ("score", "double"), ("n", "int"), ("born", "date"), ("blob", "binary"),
    ]  # fmt: skip
    assert orders.fields == ()
    assert parse_tables([{"name": "shop.p", "fields": {"d": "decimal(38,38)"}}]).tables[0].fields[0].type == (
        "decimal(38,38)"
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"qty": "integer"}, r"tables\[0\]\.fields\.qty: type 'integer' is not allowed \(collection shop\.products\); "
                             r"allowed: string, int, long, double, decimal\(p,s\)"),
        ({"qty": "decimal(39,2)"}, r"fields\.qty: type 'decimal\(39,2\)' is not allowed .*allowed: string"),
        ({"qty": "decimal(2,3)"}, r"fields\.qty: type 'decimal\(2,3\)' is not allowed"),
        ({"qty": "decimal(p,s)"}, r"fields\.qty: type 'decimal\(p,s\)' is not allowed"),
        ({"qty": "decimal"}, r"fields\.qty: type 'decimal' is not allowed"),
        ({"qty": None}, r"fields\.qty: type None is not allowed"),
        ({"_id": "string"}, r"fields\._id: field '_id' of collection shop\.products cannot be declared: the _id is"),
        ({"a.b": "long"}, r"fields\.a\.b: field 'a\.b' of collection shop\.products cannot be declared: only top"),
        ({"$x": "long"}, r"fields\.\$x: field '\$x' .* cannot be declared: a field name starting with '\$'"),
        ({"_cdc_op": "string"}, r"fields\._cdc_op: .* cannot be declared: the name is taken by the lake's columns"),
        ({"Document": "string"}, r"fields\.Document: .* cannot be declared: the name is taken"),
        ({"_id_key": "string"}, r"fields\._id_key: .* cannot be declared: the name is taken"),
        ({"qty": "long", "QTY": "int"}, r"fields\.QTY: .* equals 'qty' but for case"),
        (["qty"], r"tables\[0\]\.fields: expected a mapping of top-level field name to type for collection "
                  r"shop\.products, got list; allowed types: string"),
        ({5: "long"}, r"fields: 5 is not a field name \(collection shop\.products\)"),
    ],
)  # fmt: skip
def test_bad_declarations_are_refused_naming_key_collection_and_allowed(fields: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_tables([{"name": "shop.products", "fields": fields}])


def test_fields_are_refused_for_postgres_naming_the_key() -> None:
    with pytest.raises(
        ConfigError,
        match=r"sources\[0\]\.tables\[0\]\.fields: declared typed fields are for MongoDB "
        r"sources only .*Allowed keys here: chunk_size, name, surrogate_key",
    ):
        parse_tables([{"name": "public.t", "fields": {"a": "long"}}], kind="postgres")  # fmt: skip
    assert parse_tables(["public.t"], kind="postgres").tables[0].fields == ()


def test_typed_texts_of_the_consistency_check() -> None:
    """The source side's spelling of typed values (the mirror side spells them alike on Spark; the integration test
    compares both)."""
    assert [typed_text(v) for v in (None, "a", 7, True, False, Decimal("-0.10"), Decimal("0E-10"), b"\x0a\xff")] == [
        None, "a", "7", "true", "false", "-0.10", "0.0000000000", "0aff"
    ]  # fmt: skip
    assert typed_text(1.0) == "3ff0000000000000" and typed_text(-0.0) == "8000000000000000"
    assert typed_text(math.nan) == "NaN"
    assert typed_text(dt.datetime(1970, 1, 1, 0, 0, 1, 5, tzinfo=UTC)) == "1000005"
    assert typed_text(dt.datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)) == "-1000000"
    assert typed_text(dt.date(1970, 1, 3)) == "2" and typed_text(dt.date(1969, 12, 31)) == "-1"
    row = document_row({"_id": 1, "qty": "many", "name": "lamp"}, FIELDS)
    assert source_texts(PRODUCTS, row) == {
        "_id_key": row["_id_key"], "_id": row["_id"], "document": row["document"], "price": None, "qty": '"many"',
        "name": "lamp", "updated": None,
    }  # fmt: skip
