"""Declared top-level fields of a MongoDB collection as typed columns, through the generic pipeline: the MongoDB test
server (``mongo_server``), real Spark and Delta.

- Snapshot (three chunks) and stream with fields of every declared type, under writes that change a field's BSON
  type (``$set: {qty: "many"}``, then a number again), ``$unset`` a field, replace, delete and re-insert: after
  catch-up the mirror's typed columns hold what the source documents give (literal values for a few documents,
  and the conversion over every document), ``_cdc_unrepresentable`` holds the canonical extended JSON of exactly the
  values that do not fit, ``document`` still equals the source, the changelog's after images are typed alike, and
  the consistency check matches.
- A field declared later (the configuration changed): the existing mirror gains the column, rows written before
  hold NULL until their next change, the dialect reports the field as filled without changes (the planner reads
  every chunk again), the consistency check reports those rows naming the columns, and a snapshot of the chunk
  fills them; the check then matches.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import pymongo
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from pyspark.sql import functions as F

from cdc_assets.config import FieldConfig
from cdc_assets.pipeline import CdcPipeline
from cdc_assets.sources.mongodb.catalog import id_key
from cdc_assets.sources.mongodb.dialect import MongoDialect
from cdc_assets.sources.mongodb.typed_fields import MISSING, convert
from tests.integration.test_mongodb_pipeline import assert_exact, source_config
from tests.pipeline_support import Stream

FIELDS = {
    "price": "decimal(12,2)", "qty": "long", "name": "string", "updated": "timestamp", "active": "boolean",
    "score": "double", "small": "int", "born": "date", "blob": "binary",
}  # fmt: skip
NOON = dt.datetime(2024, 5, 1, 12, 30, 15, 123000)


def product(i: int) -> dict[str, Any]:
    return {
        "_id": i, "price": Decimal128(f"{i}.5"), "qty": Int64(i * 10) if i % 2 else i * 10, "name": f"p{i}",
        "updated": NOON + dt.timedelta(days=i), "active": i % 3 == 0, "score": i / 4, "small": i,
        "born": dt.datetime(2000, 1, 1) + dt.timedelta(days=i), "blob": bytes([i]), "other": {"nested": [i]},
    }  # fmt: skip


def expected_rows(collection: pymongo.collection.Collection, fields: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per ``_id_key``: each declared field's typed value (timestamps as microseconds, binary as bytes) and the
    unrepresentable texts, from the source documents through the conversion."""
    rows = {}
    for document in collection.find():
        values: dict[str, Any] = {}
        texts: dict[str, str] = {}
        for name, type_text in fields.items():
            typed, text = convert(document.get(name, MISSING), type_text)
            if isinstance(typed, dt.datetime):
                typed = round(typed.timestamp() * 1_000_000)
            values[name] = typed
            if text is not None:
                texts[name] = text
        rows[id_key(document["_id"])] = {**values, "_cdc_unrepresentable": texts or None}
    return rows


def mirror_rows(spark, pipeline: CdcPipeline, name: str, fields: dict[str, str]) -> dict[str, dict[str, Any]]:
    mirror = spark.read.format("delta").load(pipeline.lake.table(name).mirror)
    columns = [F.unix_micros(n).alias(n) if t == "timestamp" else F.col(n) for n, t in fields.items()]
    rows = {}
    for row in mirror.select("_id_key", *columns, "_cdc_unrepresentable").collect():
        values = row.asDict()
        key = values.pop("_id_key")
        rows[key] = {k: bytes(v) if isinstance(v, bytearray) else v for k, v in values.items()}
    return rows


def assert_typed(spark, pipeline: CdcPipeline, collection: pymongo.collection.Collection, fields: dict[str, str]):
    name = f"{collection.database.name}.{collection.name}"
    actual = mirror_rows(spark, pipeline, name, fields)
    expected = expected_rows(collection, fields)
    assert set(actual) == set(expected)
    different = [(k, expected[k], actual[k]) for k in sorted(expected) if expected[k] != actual[k]][:3]
    assert not different, different
    return actual


def test_declared_fields_are_typed_on_snapshot_and_stream_and_misfits_keep_their_text(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    with pymongo.MongoClient(mongo_server) as client:
        products = client[database_name]["products"]
        products.insert_many([product(i) for i in range(30)])
        # misfits before the snapshot: a string quantity, a decimal with too many digits, a long for an int, a date
        # with a time of day, a double price, a UUID-subtype binary
        products.update_one({"_id": 3}, {"$set": {"qty": "many", "price": Decimal128("1.234")}})
        products.update_one({"_id": 4}, {"$set": {"small": Int64(2**40), "born": NOON, "score": "high"}})
        products.update_one({"_id": 5}, {"$set": {"price": 9.99, "active": 1}})
        tables = [{"name": f"{database_name}.products", "fields": FIELDS}]
        lake = tmp_path / "lake"
        config, source = source_config(mongo_server, lake, database_name, chunk_size=10, tables=tables)
        dialect = MongoDialect(source, lake / "docs" / "_cdc")
        pipeline = CdcPipeline(config, source, dialect)
        table = pipeline.prepare()[f"{database_name}.products"]
        assert table.fields == tuple(FieldConfig(n, t) for n, t in FIELDS.items())
        plan = pipeline.plan(table)
        assert len(plan.chunks) >= 2
        stream = Stream(pipeline, spark)
        for chunk in plan.chunks:
            pipeline.snapshot(spark, table, [chunk.index], f"s{chunk.index}")
            products.update_one({"_id": 6}, {"$set": {"qty": "several"}})  # between the windows: a type change
        stream.catch_up()
        # a type change and back, an unset, a replace, a delete and a re-insert
        products.update_one({"_id": 7}, {"$set": {"qty": "many"}})
        products.update_one({"_id": 8}, {"$set": {"qty": "many"}})
        products.update_one({"_id": 8}, {"$set": {"qty": Int64(81)}})
        products.update_one({"_id": 9}, {"$unset": {"name": "", "price": ""}})
        products.replace_one({"_id": 10}, {"name": 10, "qty": 2.5, "updated": "yesterday", "blob": b"\x0a\x0b"})
        products.delete_one({"_id": 11})
        products.delete_one({"_id": 12})
        products.insert_one(
            {"_id": 12, "qty": Int64(-5), "price": Decimal128("-0.10"), "born": dt.datetime(1999, 12, 31)}
        )
        products.insert_one({"_id": 40, "small": Int64(2**31 - 1), "score": Int64(2**53 + 1), "name": ["x"]})
        stream.catch_up()
        assert_exact(spark, pipeline, products)  # the document column: the source's documents
        rows = assert_typed(spark, pipeline, products, FIELDS)

        def row(i: int) -> dict[str, Any]:
            return rows[id_key(i)]

        # literal expectations
        assert row(1)["price"] == Decimal("1.50") and row(1)["qty"] == 10 and row(1)["name"] == "p1"
        assert row(1)["updated"] == round(dt.datetime(2024, 5, 2, 12, 30, 15, 123000, tzinfo=dt.UTC).timestamp() * 1e6)
        assert row(1)["born"] == dt.date(2000, 1, 2) and row(1)["blob"] == b"\x01" and row(1)["score"] == 0.25
        assert row(1)["active"] is False and row(0)["active"] is True and row(1)["small"] == 1
        assert row(1)["_cdc_unrepresentable"] is None
        assert row(3)["qty"] is None and row(3)["price"] is None
        assert row(3)["_cdc_unrepresentable"] == {"price": '{"$numberDecimal":"1.234"}', "qty": '"many"'}
        assert row(4)["_cdc_unrepresentable"] == {
            "score": '"high"', "small": '{"$numberLong":"1099511627776"}',
            "born": '{"$date":{"$numberLong":"1714566615123"}}',
        }  # fmt: skip
        assert row(5)["_cdc_unrepresentable"] == {"price": '{"$numberDouble":"9.99"}', "active": '{"$numberInt":"1"}'}
        assert row(6)["qty"] is None and row(6)["_cdc_unrepresentable"] == {"qty": '"several"'}
        assert row(7)["qty"] is None and row(7)["_cdc_unrepresentable"] == {"qty": '"many"'}
        assert row(8)["qty"] == 81 and row(8)["_cdc_unrepresentable"] is None  # back to a number
        assert row(9)["name"] is None and row(9)["price"] is None and row(9)["qty"] == 90  # unset: NULL, no text
        assert row(9)["_cdc_unrepresentable"] is None
        assert row(10) == {
            "price": None, "qty": None, "name": None, "updated": None, "active": None, "score": None, "small": None,
            "born": None, "blob": b"\x0a\x0b", "_cdc_unrepresentable": {
                "name": '{"$numberInt":"10"}', "qty": '{"$numberDouble":"2.5"}', "updated": '"yesterday"'},
        }  # fmt: skip
        assert id_key(11) not in rows
        assert (
            row(12)["qty"] == -5 and row(12)["price"] == Decimal("-0.10") and row(12)["born"] == dt.date(1999, 12, 31)
        )
        assert row(12)["name"] is None and row(12)["_cdc_unrepresentable"] is None
        assert row(40)["small"] == 2**31 - 1 and row(40)["score"] is None
        assert row(40)["_cdc_unrepresentable"] == {"name": '["x"]', "score": '{"$numberLong":"9007199254740993"}'}
        misfits = {k: sorted(r["_cdc_unrepresentable"]) for k, r in rows.items() if r["_cdc_unrepresentable"]}
        assert misfits == {
            id_key(3): ["price", "qty"], id_key(4): ["born", "score", "small"], id_key(5): ["active", "price"],
            id_key(6): ["qty"], id_key(7): ["qty"], id_key(10): ["name", "qty", "updated"],
            id_key(40): ["name", "score"],
        }  # fmt: skip

        # the changelog's after images are typed alike (id 8: "many", then 81)
        changelog = spark.read.format("delta").load(pipeline.lake.table(table.qualified_name).changelog)
        eight = changelog.where(F.col("after._id_key") == id_key(8)).orderBy("_cdc_position", "_cdc_seq")
        images = [(r["qty"], r["rep"]) for r in eight.select("after.qty", F.col("after._cdc_unrepresentable").alias(
            "rep")).collect()]  # fmt: skip
        assert images[-1] == (81, None), images
        deleted = changelog.where((F.col("_cdc_op") == "d") & (F.col("before._id_key") == id_key(11))).first()
        assert deleted is not None and deleted["after"] is None and deleted["before"]["qty"] is None

        checks = pipeline.check_chunks(spark, table, [c.index for c in plan.chunks], wait_seconds=60)
        assert all(c.conclusive and c.matches for c in checks), checks
        dialect.close()


def test_a_field_declared_later_evolves_the_mirror_and_is_filled_by_a_snapshot(
    spark, mongo_server: str, database_name: str, tmp_path: Path
) -> None:
    with pymongo.MongoClient(mongo_server) as client:
        products = client[database_name]["products"]
        products.insert_many([product(i) for i in range(12)])
        lake = tmp_path / "lake"
        first = {"qty": "long"}
        config, source = source_config(
            mongo_server, lake, database_name, chunk_size=1000,
            tables=[{"name": f"{database_name}.products", "fields": first}],
        )  # fmt: skip
        pipeline = CdcPipeline(config, source, MongoDialect(source, lake / "docs" / "_cdc"))
        table = pipeline.prepare()[f"{database_name}.products"]
        pipeline.snapshot(spark, table, [0], "first")
        stream = Stream(pipeline, spark)
        stream.catch_up()
        assert_typed(spark, pipeline, products, first)

        # the configuration declares two more fields; the mirror written before lacks them
        later = {"qty": "long", "name": "string", "price": "decimal(12,2)"}
        config, source = source_config(
            mongo_server, lake, database_name, chunk_size=1000,
            tables=[{"name": f"{database_name}.products", "fields": later}],
        )  # fmt: skip
        dialect = MongoDialect(source, lake / "docs" / "_cdc")
        pipeline = CdcPipeline(config, source, dialect)
        table = pipeline.prepare()[f"{database_name}.products"]
        assert pipeline.column_names(table)[-3:] == ["qty", "name", "price"]
        assert dialect.filled_without_changes(table, ["name", "price"]) == ["name", "price"]
        recorded = stream.recorded
        stream = Stream(pipeline, spark)
        stream.recorded = recorded
        products.update_one({"_id": 2}, {"$set": {"qty": Int64(7)}})
        products.update_one({"_id": 3}, {"$set": {"name": 3}})
        stream.catch_up()
        rows = mirror_rows(spark, pipeline, table.qualified_name, later)
        assert rows[id_key(2)] == {"qty": 7, "name": "p2", "price": Decimal("2.50"), "_cdc_unrepresentable": None}
        assert rows[id_key(3)]["name"] is None and rows[id_key(3)]["_cdc_unrepresentable"] == {
            "name": '{"$numberInt":"3"}'
        }
        # written before the fields were declared and not changed since: NULL until their chunk is read again
        assert rows[id_key(5)] == {"qty": 5 * 10, "name": None, "price": None, "_cdc_unrepresentable": None}
        # the check covers typed columns: the older rows' NULLs are reported (the documents hold values)
        (check,) = pipeline.check_chunks(spark, table, [0], wait_seconds=60)
        difference = check.first_difference or ""
        assert check.conclusive and not check.matches, check
        assert f"key (_id_key={id_key(0)})" in difference and "differing columns: name, price" in difference, check
        pipeline.snapshot(spark, table, [0], "refill")
        stream.catch_up()
        assert_exact(spark, pipeline, products)
        rows = assert_typed(spark, pipeline, products, later)
        assert rows[id_key(5)] == {"qty": 50, "name": "p5", "price": Decimal("5.50"), "_cdc_unrepresentable": None}
        (check,) = pipeline.check_chunks(spark, table, [0], wait_seconds=60)
        assert check.conclusive and check.matches, check
        dialect.close()
