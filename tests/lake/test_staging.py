"""Staged chunk files (``cdc_assets.lake.staging``) written with pyarrow and read back by Spark: every type of the
codec keeps its Spark type and value, a retried write replaces its file, a failed one leaves nothing, attempts
read before a column was added read it as NULL, and the counts come from the files alone."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import types as T

from cdc_assets.lake.staging import (
    ATTEMPT_COLUMN,
    CHUNK_COLUMN,
    drop_attempts,
    read_staged,
    staged_attempt_times,
    staged_row_counts,
    write_part,
)
from cdc_assets.sources.postgres.pg_values import (
    UNREPRESENTABLE_COLUMN,
    PgColumn,
    arrow_schema,
    decode_text_table,
    spark_schema,
)

INT2, INT4, INT8, FLOAT8, BOOL, NUMERIC, DATE, TIMESTAMP, TIMESTAMPTZ, BYTEA, TEXT = (
    21, 23, 20, 701, 16, 1700, 1082, 1114, 1184, 17, 25
)  # fmt: skip


def col(name: str, oid: int, typmod: int = -1) -> PgColumn:
    return PgColumn(name, oid, typmod, "", "N", None, None, False)


COLUMNS = [
    col("id", INT8),
    col("small", INT2),
    col("qty", INT4),
    col("price", NUMERIC, ((12 << 16) | 2) + 4),
    col("ratio", FLOAT8),
    col("flag", BOOL),
    col("day", DATE),
    col("local", TIMESTAMP),
    col("at", TIMESTAMPTZ),
    col("blob", BYTEA),
    col("name", TEXT),
    PgColumn("tags", 1007, -1, "", "A", INT4, None, False),
]
FIELDS = spark_schema(COLUMNS).fields
TEXTS = {
    "id": ["1", "2", "3"],
    "small": ["-7", None, "32767"],
    "qty": ["10", "20", None],
    "price": ["12.50", "NaN", "-0.01"],  # NaN cannot be a decimal: NULL, and its text in _cdc_unrepresentable
    "ratio": ["1.5", "Infinity", None],
    "flag": ["t", "f", None],
    "day": ["2024-02-29", None, "0001-01-01"],
    "local": ["2024-01-01 12:00:00.123456", None, "1999-12-31 23:59:59"],
    "at": ["2024-01-01 12:00:00.5+00", "1970-01-01 00:00:00+00", None],
    "blob": ["\\x00ff", None, "\\x"],
    "name": ["", None, "ünïcode"],
    # row 2's array has an unrepresentable element: NULL, with its decoded elements still under the slot (pyarrow's
    # Parquet writer refuses such a slot when values follow it)
    "tags": ["{1,2,NULL}", "{7,99999999999}", "{3}"],
}


def typed_rows(columns: list[PgColumn], texts: dict[str, list[str | None]]) -> pa.Table:
    names = [c.name for c in columns]
    return decode_text_table(columns, pa.table({n: pa.array(texts[n], pa.string()) for n in names}))


def expected_schema(columns: list[PgColumn]) -> T.StructType:
    return T.StructType(
        [*spark_schema(columns).fields, T.StructField(CHUNK_COLUMN, T.IntegerType()),
         T.StructField(ATTEMPT_COLUMN, T.StringType())]
    )  # fmt: skip


def test_every_codec_type_reads_back_as_its_spark_type_and_value(spark, tmp_path: Path) -> None:
    table = typed_rows(COLUMNS, TEXTS)
    rows = write_part(tmp_path, "a1", 3, 0, [table.slice(0, 2), table.slice(2)], arrow_schema(COLUMNS))
    assert rows == 3
    staged = read_staged(spark, tmp_path, ["a1"], FIELDS)
    assert staged.schema == expected_schema(COLUMNS)
    expected = spark.createDataFrame(table, schema=spark_schema(COLUMNS))
    names = [*(c.name for c in COLUMNS), UNREPRESENTABLE_COLUMN]
    assert staged.select(*names).orderBy("id").collect() == expected.orderBy("id").collect()
    assert {(r[CHUNK_COLUMN], r[ATTEMPT_COLUMN]) for r in staged.collect()} == {(3, "a1")}
    second = staged.where("id = 2").first()
    assert second["tags"] is None and second[UNREPRESENTABLE_COLUMN] == {"price": "NaN", "tags": "{7,99999999999}"}
    assert staged.where("id = 3").first()["tags"] == [3]


def test_a_retried_part_replaces_its_file_and_a_failed_one_leaves_nothing(spark, tmp_path: Path) -> None:
    schema = arrow_schema(COLUMNS)
    table = typed_rows(COLUMNS, TEXTS)
    write_part(tmp_path, "a1", 0, 0, [table], schema)
    write_part(tmp_path, "a1", 0, 1, [table.slice(0, 1)], schema)
    assert staged_row_counts(tmp_path, ["a1"]) == {("a1", 0): 4}
    # the task of part 0 is retried and reads 2 rows this time: its file is replaced, not added to
    write_part(tmp_path, "a1", 0, 0, [table.slice(0, 2)], schema)
    assert staged_row_counts(tmp_path, ["a1"]) == {("a1", 0): 3}

    def dies_after_one_batch():
        yield table
        raise ConnectionError("the read died")

    with pytest.raises(ConnectionError):
        write_part(tmp_path, "a1", 1, 0, dies_after_one_batch(), schema)
    assert staged_row_counts(tmp_path, ["a1"]) == {("a1", 0): 3}  # no chunk 1 file, complete or partial
    assert sorted(os.listdir(tmp_path / "_cdc_attempt=a1")) == ["chunk-0-part-0.parquet", "chunk-0-part-1.parquet"]
    assert read_staged(spark, tmp_path, ["a1"], FIELDS).count() == 3


def test_attempts_staged_before_a_column_was_added_read_it_as_null(spark, tmp_path: Path) -> None:
    before = [c for c in COLUMNS if c.name != "name"]
    write_part(tmp_path, "old", 0, 0, [typed_rows(before, TEXTS)], arrow_schema(before))
    write_part(tmp_path, "new", 0, 0, [typed_rows(COLUMNS, TEXTS)], arrow_schema(COLUMNS))
    staged = read_staged(spark, tmp_path, ["old", "new"], FIELDS)
    names = {(r[ATTEMPT_COLUMN], r["id"]): r["name"] for r in staged.collect()}
    assert names == {("old", 1): None, ("old", 2): None, ("old", 3): None,
                     ("new", 1): "", ("new", 2): None, ("new", 3): "ünïcode"}  # fmt: skip
    # only the attempts asked for are read
    assert read_staged(spark, tmp_path, ["old"], FIELDS).count() == 3


def test_empty_reads_missing_attempts_times_and_drops(spark, tmp_path: Path) -> None:
    schema = arrow_schema(COLUMNS)
    assert write_part(tmp_path, "a1", 5, 0, iter(()), schema) == 0  # a sub-range without rows still has a file
    assert staged_row_counts(tmp_path, ["a1", "gone"]) == {("a1", 5): 0}
    assert read_staged(spark, tmp_path, ["a1"], FIELDS).count() == 0
    missing = read_staged(spark, tmp_path, ["gone"], FIELDS)
    assert missing.count() == 0 and missing.schema == expected_schema(COLUMNS)
    write_part(tmp_path, "a2", 0, 0, [typed_rows(COLUMNS, TEXTS)], schema)
    os.utime(tmp_path / "_cdc_attempt=a1" / "chunk-5-part-0.parquet", (1_000_000, 1_000_000))
    times = staged_attempt_times(tmp_path)
    assert times["a1"] == 1_000_000 and times["a2"] > 1_000_000 and set(times) == {"a1", "a2"}
    assert drop_attempts(tmp_path, ["a1", "never-staged"]) == 1
    assert staged_attempt_times(tmp_path).keys() == {"a2"}
    assert staged_attempt_times(tmp_path / "no-such-folder") == {}
    for bad in ("../escape", ".hidden", "", "a/b", "a=b", "a%2Fb"):
        with pytest.raises(ValueError, match="cannot name a staging folder: allowed are letters, digits"):
            write_part(tmp_path, bad, 0, 0, [], schema)


def test_attempt_ids_that_look_like_dates_or_numbers_stay_strings(spark, tmp_path: Path) -> None:
    schema = arrow_schema(COLUMNS)
    for attempt in ("2024-01-01", "12"):
        write_part(tmp_path, attempt, 0, 0, [typed_rows(COLUMNS, TEXTS)], schema)
    staged = read_staged(spark, tmp_path, ["2024-01-01", "12"], FIELDS)
    assert staged.schema[ATTEMPT_COLUMN].dataType == T.StringType()
    assert {r[ATTEMPT_COLUMN] for r in staged.collect()} == {"2024-01-01", "12"}
    assert spark.conf.get("spark.sql.sources.partitionColumnTypeInference.enabled") == "true"  # restored
