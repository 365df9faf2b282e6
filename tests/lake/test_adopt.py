"""Staged chunk files landed in a mirror whole (``cdc_assets.lake.adopt``), on real Delta tables: the mirror reads
every codec type back as an append would have written it, the commit adds the staged files themselves (no row
rewritten) with key statistics that prune a MERGE, the Change Data Feed shows the rows as inserts, later MERGEs
(deletion vectors) work on them; files that are not mirror files, and mirrors that cannot take them, are refused and
left to the append."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from delta.tables import DeltaTable
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.engine.windows import ChunkWindow, WindowStart
from cdc_assets.lake.adopt import ADOPTED_PREFIX, adopt_windows
from cdc_assets.lake.mirror import ensure_mirror
from cdc_assets.lake.staging import write_part
from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN, arrow_schema, spark_schema
from tests.lake.test_staging import COLUMNS, TEXTS, typed_rows

START = WindowStart(4242, datetime(2026, 11, 28, 12, 0, 0, 123456, tzinfo=UTC))
NAMES = [*(c.name for c in COLUMNS), UNREPRESENTABLE_COLUMN]


def window(attempt: str, chunk: int, rows: int, lw: int = START.position) -> ChunkWindow:
    return ChunkWindow("public.t", chunk, attempt, lw, "10:20:", 5000, rows, START.at)


def stage(folder: Path, attempt: str, chunk: int, start: WindowStart | None = START) -> int:
    table = typed_rows(COLUMNS, TEXTS)
    rows = write_part(folder, attempt, chunk, 0, [table.slice(0, 2)], arrow_schema(COLUMNS), start, ("id",))
    return rows + write_part(folder, attempt, chunk, 1, [table.slice(2)], arrow_schema(COLUMNS), start, ("id",))


def log_actions(mirror: Path) -> list[dict]:
    actions = []
    for name in sorted(os.listdir(mirror / "_delta_log")):
        if name.endswith(".json"):
            actions += [json.loads(line) for line in (mirror / "_delta_log" / name).read_text().splitlines()]
    return actions


def test_a_chunks_staged_files_become_the_mirrors_files_without_a_rewrite(spark, tmp_path: Path) -> None:
    staging, mirror = tmp_path / "staged", tmp_path / "mirror"
    rows = stage(staging, "a1", 3)
    table = ensure_mirror(spark, str(mirror), spark_schema(COLUMNS).fields, key_columns=["id"])
    landed = adopt_windows(spark, str(mirror), str(staging), [window("a1", 3, rows)], table.toDF().schema.fields,
                           ["id"])  # fmt: skip
    assert [w.chunk for w in landed] == [3]
    # the files are the staged ones (hard links: same inode), named in the log with their statistics
    adds = [a["add"] for a in log_actions(mirror) if "add" in a]
    assert sorted(a["path"] for a in adds) == [f"{ADOPTED_PREFIX}a1-chunk-3-part-{k}.parquet" for k in (0, 1)]
    for add in adds:
        staged = staging / "_cdc_attempt=a1" / add["path"].removeprefix(f"{ADOPTED_PREFIX}a1-")
        assert os.stat(mirror / add["path"]).st_ino == os.stat(staged).st_ino
        assert add["size"] == staged.stat().st_size and add["dataChange"] is True
    stats = {a["path"]: json.loads(a["stats"]) for a in adds}
    assert stats[f"{ADOPTED_PREFIX}a1-chunk-3-part-0.parquet"] == {
        "numRecords": 2, "minValues": {"id": 1, "_cdc_position": 4242}, "maxValues": {"id": 2, "_cdc_position": 4242},
        "nullCount": {"id": 0, "_cdc_position": 0}, "tightBounds": True,
    }  # fmt: skip
    history = DeltaTable.forPath(spark, str(mirror)).history(1).first()
    assert history["operation"] == "WRITE"
    # every codec type reads back as an append of the same rows gives it, with the window's start as row columns
    read = spark.read.format("delta").load(str(mirror))
    expected = spark.createDataFrame(typed_rows(COLUMNS, TEXTS), schema=spark_schema(COLUMNS))
    assert read.select(*NAMES).orderBy("id").collect() == expected.select(*NAMES).orderBy("id").collect()
    assert {tuple(r) for r in read.select("_cdc_op", "_cdc_position", "_cdc_ts", "_cdc_unknown").collect()} == {
        ("r", 4242, START.at.replace(tzinfo=None), None)
    }
    assert "_cdc_chunk" not in read.columns
    # the Change Data Feed reads them as inserts; a MERGE on them (a deletion vector) and a key-pruned one work
    changes = spark.read.format("delta").option("readChangeFeed", "true").option("startingVersion", 1).load(str(mirror))
    assert sorted(r["id"] for r in changes.where("_change_type = 'insert'").collect()) == [1, 2, 3]
    source = spark.createDataFrame([(2, "renamed"), (9, "new")], "id long, name string")
    DeltaTable.forPath(spark, str(mirror)).alias("t").merge(source.alias("s"), "t.id = s.id").whenMatchedUpdate(
        set={"name": "s.name", "_cdc_op": F.lit("u")}
    ).whenNotMatchedInsert(values={"id": "s.id", "name": "s.name", "_cdc_op": F.lit("c")}).execute()
    after = {r["id"]: (r["name"], r["_cdc_op"]) for r in spark.read.format("delta").load(str(mirror)).collect()}
    assert after == {1: ("", "r"), 2: ("renamed", "u"), 3: ("ünïcode", "r"), 9: ("new", "c")}
    # the key statistics prune: a read of id 1 opens the landed file that holds ids 1-2, not the one of id 3
    names = {f.rsplit("/", 1)[-1] for f in spark.read.format("delta").load(str(mirror)).where("id = 1").inputFiles()}
    assert f"{ADOPTED_PREFIX}a1-chunk-3-part-0.parquet" in names
    assert f"{ADOPTED_PREFIX}a1-chunk-3-part-1.parquet" not in names


def test_files_that_are_not_mirror_files_are_left_to_the_append(spark, tmp_path: Path) -> None:
    staging, mirror = tmp_path / "staged", tmp_path / "mirror"
    fields = ensure_mirror(spark, str(mirror), spark_schema(COLUMNS).fields, key_columns=["id"]).toDF().schema.fields
    old = stage(staging, "old", 0, start=None)  # staged before files carried the row columns (or by key)
    other = stage(staging, "moved", 1)  # its window says another start position
    short = stage(staging, "short", 2)  # its window recorded more rows than the files hold
    windows = [window("old", 0, old), window("moved", 1, other, lw=99), window("short", 2, short + 1)]
    assert adopt_windows(spark, str(mirror), str(staging), windows, fields, ["id"]) == []
    # a column whose type the mirror holds differently
    narrow = [f if f.name != "qty" else T.StructField("qty", T.LongType()) for f in fields]
    assert adopt_windows(spark, str(mirror), str(staging), [window("moved", 1, other, lw=4242)], narrow, ["id"]) == []
    assert spark.read.format("delta").load(str(mirror)).count() == 0
    assert not [a for a in log_actions(mirror) if "add" in a]


@pytest.mark.parametrize("refusal", ["column mapping", "partitions"])
def test_a_mirror_that_cannot_take_files_whole_is_not_given_any(spark, tmp_path: Path, refusal: str) -> None:
    staging, mirror = tmp_path / "staged", tmp_path / "mirror"
    rows = stage(staging, "a1", 0)
    schema = spark_schema(COLUMNS)
    builder = DeltaTable.create(spark).location(str(mirror)).addColumns(schema)
    if refusal == "column mapping":
        builder = builder.property("delta.columnMapping.mode", "name")
    else:
        builder = builder.partitionedBy("flag")
    builder.execute()
    fields = spark.read.format("delta").load(str(mirror)).schema.fields
    assert adopt_windows(spark, str(mirror), str(staging), [window("a1", 0, rows)], fields, ["id"]) == []
    assert not [a for a in log_actions(mirror) if "add" in a]


def test_the_files_row_columns_hold_the_windows_start(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    stage(tmp_path, "a1", 0)
    table = pq.ParquetFile(tmp_path / "_cdc_attempt=a1" / "chunk-0-part-0.parquet").read()
    assert table.schema.names[-5:] == ["_cdc_op", "_cdc_position", "_cdc_ts", "_cdc_unknown", "_cdc_chunk"]
    assert table.column("_cdc_op").to_pylist() == ["r", "r"]
    assert table.column("_cdc_position").to_pylist() == [4242, 4242]
    assert table.column("_cdc_ts").to_pylist() == [START.at, START.at]
    assert table.column("_cdc_unknown").null_count == 2
    assert table.schema.field("_cdc_ts").type == pa.timestamp("us", tz="UTC")
