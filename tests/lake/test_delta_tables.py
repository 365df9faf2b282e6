"""``cdc_assets.lake.delta_tables``: a table whose creation was killed half-way is created by the next attempt.

A process killed while ``DeltaTable.createIfNotExists`` ran can leave ``_delta_log`` without a commit; every later
create then failed with ``DELTA_TABLE_NOT_FOUND`` (the MongoDB torture run's stream, in CI, eight times in a row).
``column_upper_bound`` reads a column's greatest value from the files' statistics, or says it cannot."""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import types as T

from cdc_assets.lake.delta_tables import ColumnBound, clear_interrupted_create, column_upper_bound, table_state
from cdc_assets.lake.mirror import append_changelog, ensure_mirror, open_mirror

FIELDS = [T.StructField("id", T.LongType()), T.StructField("v", T.StringType())]


def interrupted(path: Path) -> Path:
    """What a create killed before its first commit leaves: the log folder and a temporary commit file."""
    (path / "_delta_log").mkdir(parents=True)
    (path / "_delta_log" / ".00000000000000000000.json.5f1d.tmp").write_text("{")
    return path


def test_a_log_without_a_commit_is_cleared_and_a_real_log_never(tmp_path: Path) -> None:
    assert clear_interrupted_create(str(interrupted(tmp_path / "a"))) is True
    assert not (tmp_path / "a" / "_delta_log").exists()
    assert clear_interrupted_create(str(tmp_path / "missing")) is False
    for entry in ("00000000000000000000.json", "00000000000000000010.checkpoint.parquet", "_last_checkpoint"):
        table = interrupted(tmp_path / entry)
        (table / "_delta_log" / entry).write_text("{}")
        assert clear_interrupted_create(str(table)) is False, entry
        assert (table / "_delta_log" / entry).exists()
    assert clear_interrupted_create("s3a://bucket/lake/t") is False  # no folders on an object store


def test_a_mirror_and_a_changelog_whose_creation_was_killed_are_created_again(spark, tmp_path: Path) -> None:
    mirror = interrupted(tmp_path / "mirror")
    # what the next batch met before: Delta's create refuses the leftover log for good
    from delta.tables import DeltaTable

    with pytest.raises(AnalysisException, match="DELTA_TABLE_NOT_FOUND"):
        DeltaTable.createIfNotExists(spark).location(str(mirror)).addColumns(T.StructType(FIELDS)).execute()
    assert ensure_mirror(spark, str(mirror), FIELDS).toDF().count() == 0
    # a changelog with a column name Delta refuses by default is created (column mapping) before its first append
    changelog = interrupted(tmp_path / "changelog")
    changes = spark.createDataFrame([(1, 1)], "`a b` long, _cdc_position long")
    append_changelog(spark, str(changelog), changes, 1)
    assert spark.read.format("delta").load(str(changelog)).count() == 1


def test_open_mirror_says_created_only_on_the_call_that_made_the_mirror(spark, tmp_path: Path) -> None:
    """A reconciliation lands files in a mirror ``created`` by its own call without asking Delta whether it holds
    any: only that call may say so, also when the creation follows a killed one."""
    mirror = str(interrupted(tmp_path / "mirror"))
    first = open_mirror(spark, mirror, FIELDS, key_columns=["id"])
    assert first.created is True
    spark.createDataFrame([(1, "a")], "id long, v string").write.format("delta").mode("append").save(mirror)
    again = open_mirror(spark, mirror, FIELDS, key_columns=["id"])
    assert again.created is False
    assert again.table.toDF().count() == 1


def test_table_state_from_delta_s_snapshot_and_from_the_public_api_agree(spark, tmp_path: Path) -> None:
    """The version and bytes ``apply_changes`` decides by; a session without a JVM (Spark Connect) takes the public
    ``history``/``detail`` path, which must say the same."""
    path = str(tmp_path / "t")
    spark.createDataFrame([(1, "a")], "id long, v string").write.format("delta").save(path)
    spark.createDataFrame([(2, "b" * 5000)], "id long, v string").write.format("delta").mode("append").save(path)
    table = DeltaTable.forPath(spark, path)
    state = table_state(spark, table, path)
    files = {f"{path}/{name.rsplit('/', 1)[-1]}" for name in spark.read.format("delta").load(path).inputFiles()}
    assert (state.version, state.size_bytes) == (1, sum(Path(f).stat().st_size for f in files))
    assert table_state(object(), table, path) == state  # type: ignore[arg-type]


def test_column_upper_bound_is_the_greatest_file_maximum_or_unknown(spark, tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    schema = T.StructType([T.StructField("id", T.LongType()), T.StructField("name", T.StringType()),
                           T.StructField("day", T.DateType()), T.StructField("amount", T.DecimalType(10, 2)),
                           T.StructField("odd name", T.LongType())])  # fmt: skip
    (DeltaTable.create(spark).location(path).addColumns(schema)
     .property("delta.enableDeletionVectors", "true").property("delta.columnMapping.mode", "name")
     .property("delta.minReaderVersion", "2").property("delta.minWriterVersion", "5").execute())  # fmt: skip
    assert column_upper_bound(spark, path, "id") == ColumnBound(True, None)  # no file: no key held
    first = [(1, "zz", date(2024, 1, 1), Decimal("1.50"), 40)]
    second = [(7, "a", date(2024, 3, 1), Decimal("0.10"), 2), (3, "b", date(2023, 1, 1), None, 9)]
    only_nulls = [(4, "c", None, None, 1)]  # a file whose day and amount are all NULL: it holds no value of them
    for part in (first, second, only_nulls):
        spark.createDataFrame(part, schema).coalesce(1).write.format("delta").mode("append").save(path)
    assert column_upper_bound(spark, path, "id") == ColumnBound(True, 7)
    assert column_upper_bound(spark, path, "day") == ColumnBound(True, date(2024, 3, 1))
    assert column_upper_bound(spark, path, "amount") == ColumnBound(True, Decimal("1.50"))  # a file of NULLs: none
    assert column_upper_bound(spark, path, "odd name") == ColumnBound(True, 40)  # a physical name in the statistics
    assert column_upper_bound(spark, path, "name").known is False  # strings' statistics are truncated
    assert column_upper_bound(spark, path, "missing").known is False
    DeltaTable.forPath(spark, path).delete("id = 7")  # a deletion vector: the file's maximum still counts
    assert column_upper_bound(spark, path, "id") == ColumnBound(True, 7)
    bare = str(tmp_path / "bare")  # files written without column statistics: no bound
    plain = T.StructType(schema.fields[:2])
    spark.createDataFrame([(1, "x")], plain).write.format("delta").option("delta.dataSkippingNumIndexedCols", "0").save(
        bare
    )
    spark.sql(f"ALTER TABLE delta.`{bare}` SET TBLPROPERTIES (delta.dataSkippingNumIndexedCols = 0)")
    spark.createDataFrame([(2, "y")], plain).write.format("delta").mode("append").save(bare)
    assert column_upper_bound(spark, bare, "id").known is False
