"""``cdc_assets.lake.delta_tables``: a table whose creation was killed half-way is created by the next attempt.

A process killed while ``DeltaTable.createIfNotExists`` ran can leave ``_delta_log`` without a commit; every later
create then failed with ``DELTA_TABLE_NOT_FOUND`` (the MongoDB torture run's stream, in CI, eight times in a row)."""

from __future__ import annotations

from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.errors import AnalysisException
from pyspark.sql import types as T

from cdc_assets.lake.delta_tables import clear_interrupted_create, table_state
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
