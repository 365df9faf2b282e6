"""``cdc_assets.lake.statistics``: file statistics only on the key and the fixed-size columns.

Delta's statistics tracker copies a column's running minimum or maximum for every row it writes after it, so one big
text value made a write crawl (a demo's stream batch over a 60 MB value ran for more than 15 minutes). The rule is a
pure function; the tests on Delta read what Delta recorded in its log for the files a batch wrote."""

from __future__ import annotations

import json
from pathlib import Path

from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.lake.mirror import append_changelog, apply_changes, ensure_mirror
from cdc_assets.lake.schema import UNREPRESENTABLE_COLUMN
from cdc_assets.lake.statistics import STATS_COLUMNS, statistics_columns

SCHEMA = T.StructType([
    T.StructField("code", T.StringType()), T.StructField("n", T.IntegerType()), T.StructField("notes", T.StringType()),
    T.StructField("raw", T.BinaryType()), T.StructField("amount", T.DecimalType(12, 2)),
    T.StructField("at", T.TimestampType()), T.StructField("day", T.DateType()), T.StructField("ok", T.BooleanType()),
    T.StructField("tags", T.ArrayType(T.StringType())), T.StructField("m", T.MapType(T.StringType(), T.StringType())),
    T.StructField("s", T.StructType([T.StructField("x", T.LongType())])),
])  # fmt: skip


def test_statistics_on_keys_and_fixed_size_columns_only() -> None:
    assert statistics_columns(SCHEMA) == ["n", "amount", "at", "day"]  # none of booleans: Delta refuses them
    assert statistics_columns(SCHEMA, ["code"]) == ["code", "n", "amount", "at", "day"]
    assert statistics_columns(SCHEMA, ["raw", "tags", "ok"]) == ["n", "amount", "at", "day"]  # Delta keeps none


FIELDS = [
    T.StructField("id", T.StringType()), T.StructField("qty", T.IntegerType()), T.StructField("notes", T.StringType()),
    T.StructField(UNREPRESENTABLE_COLUMN, T.MapType(T.StringType(), T.StringType())),
]  # fmt: skip


def file_statistics(spark: SparkSession, path: str) -> list[dict]:
    """The statistics Delta recorded for each file the table's latest commit added."""
    version = DeltaTable.forPath(spark, path).history(1).first()["version"]
    log = Path(path) / "_delta_log" / f"{version:020d}.json"
    adds = [json.loads(line)["add"] for line in log.read_text().splitlines() if '"add"' in line]
    return [json.loads(add["stats"]) for add in adds if add.get("stats")]


def changes(spark: SparkSession, position: int, rows: list[tuple[str, int, str]]):
    frame = spark.createDataFrame(rows, "id string, qty int, notes string")
    after = F.struct(
        F.col("id"), F.col("qty"), F.col("notes"), F.lit(None).cast("map<string,string>").alias(UNREPRESENTABLE_COLUMN)
    )
    return frame.select(
        F.lit("c").alias("_cdc_op"), F.lit(position).cast("long").alias("_cdc_position"),
        F.monotonically_increasing_id().alias("_cdc_seq"), F.current_timestamp().alias("_cdc_ts"),
        F.lit(None).cast("array<string>").alias("_cdc_unchanged"),
        F.lit(None).cast("struct<id:string>").alias("before"), after.alias("after"),
    )  # fmt: skip


def test_a_batch_writes_no_statistics_of_its_text_values_and_an_old_mirror_is_brought_to_the_rule(
    spark: SparkSession, tmp_path: Path
) -> None:
    mirror, changelog = str(tmp_path / "mirror"), str(tmp_path / "changelog")
    big = "z" * 100_000  # the column's maximum: the value Delta's tracker would copy for every later row
    batch = changes(spark, 10, [("k1", 1, big), *[(f"k{i}", i, "small") for i in range(2, 50)]])
    append_changelog(spark, changelog, batch, 10)
    apply_changes(spark, mirror, batch, FIELDS, ["id"], set())
    properties = DeltaTable.forPath(spark, mirror).detail().first()["properties"]
    assert properties[STATS_COLUMNS] == "`id`,`qty`,`_cdc_position`,`_cdc_ts`"
    for stats in file_statistics(spark, mirror):
        assert set(stats["minValues"]) == {"id", "qty", "_cdc_position", "_cdc_ts"}, stats
    changelog_properties = DeltaTable.forPath(spark, changelog).detail().first()["properties"]
    assert changelog_properties[STATS_COLUMNS] == "`_cdc_position`,`_cdc_seq`,`_cdc_ts`"
    for stats in file_statistics(spark, changelog):
        assert set(stats["minValues"]) == {"_cdc_position", "_cdc_seq", "_cdc_ts"}, stats
    assert spark.read.format("delta").load(changelog).count() == 49

    # a mirror made before the rule (statistics on every column) gets it with its next batch
    old = str(tmp_path / "old")
    ensure_mirror(spark, old, FIELDS)
    spark.sql(f"ALTER TABLE delta.`{old}` UNSET TBLPROPERTIES ('{STATS_COLUMNS}')")
    apply_changes(spark, old, changes(spark, 20, [("k1", 1, big), ("k2", 2, "small")]), FIELDS, ["id"], set())
    assert DeltaTable.forPath(spark, old).detail().first()["properties"][STATS_COLUMNS] == (
        "`id`,`qty`,`_cdc_position`,`_cdc_ts`"
    )
    assert {r["id"]: r["notes"] for r in spark.read.format("delta").load(old).collect()} == {"k1": big, "k2": "small"}
