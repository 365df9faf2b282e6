"""The changelog's last position, remembered after this process's own append (``cdc_assets.lake.mirror``):
whatever committed since, the answer is the one the table's history gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession

from cdc_assets.lake import mirror
from cdc_assets.lake.mirror import USER_METADATA, append_changelog, changelog_position, last_applied_position


@pytest.fixture
def position_conf(spark: SparkSession):
    """Sets the commit metadata a stream batch's commits carry; unset afterwards."""

    def set_position(position: int) -> None:
        spark.conf.set(USER_METADATA, json.dumps({"source": "test", "position": position}))

    yield set_position
    spark.conf.unset(USER_METADATA)


def changes(spark: SparkSession, *positions: int) -> DataFrame:
    return spark.createDataFrame([(p, p) for p in positions], "id long, _cdc_position long")


def positions_in(spark: SparkSession, path: str) -> list[int]:
    return sorted(r[0] for r in spark.read.format("delta").load(path).select("_cdc_position").collect())


def test_the_remembered_position_is_the_history_s_after_each_kind_of_commit(
    spark: SparkSession, tmp_path: Path, position_conf
) -> None:
    path = str(tmp_path / "changelog")
    position_conf(10)
    append_changelog(spark, path, changes(spark, 9, 10), 10)
    assert mirror._APPENDED[path][2] == 10  # remembered: the next batch reads no history
    assert changelog_position(spark, path) == last_applied_position(spark, path) == 10
    spark.sql(f"OPTIMIZE delta.`{path}`")  # the upkeep's compaction: a commit without a position
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('cdc.test' = 'x')")
    assert changelog_position(spark, path) == last_applied_position(spark, path) == 10
    position_conf(20)
    append_changelog(spark, path, changes(spark, 10, 15, 20), 20)  # 10 is there already
    assert mirror._APPENDED[path][2] == 20
    position_conf(20)
    append_changelog(spark, path, changes(spark), 20)  # a batch re-read smaller: skipped
    position_conf(25)
    append_changelog(spark, path, changes(spark), 25)  # no rows: Delta may commit nothing
    assert changelog_position(spark, path) == last_applied_position(spark, path)
    assert positions_in(spark, path) == [9, 10, 15, 20]


def test_a_commit_by_another_writer_and_a_table_made_again_are_read_from_the_history(
    spark: SparkSession, tmp_path: Path, position_conf
) -> None:
    path = str(tmp_path / "changelog")
    position_conf(10)
    append_changelog(spark, path, changes(spark, 10), 10)  # create (version 0), append (version 1)
    # another process appends (a stream run after this one was killed): the version moved on
    position_conf(30)
    changes(spark, 30).write.format("delta").mode("append").save(path)
    assert changelog_position(spark, path) == 30
    # the table dropped and made again at the same path, up to the version remembered: a new table id
    position_conf(10)
    append_changelog(spark, path, changes(spark, 10), 10)
    assert mirror._APPENDED[path][1:] == (1, 10)  # skipped (10 is at or below 30): still version 1's append
    shutil.rmtree(path)
    position_conf(2)
    changes(spark, 1, 2).write.format("delta").mode("append").save(path)
    position_conf(3)
    changes(spark, 3).write.format("delta").mode("append").save(path)  # version 1 again, position 3
    assert changelog_position(spark, path) == 3
    position_conf(6)
    append_changelog(spark, path, changes(spark, 3, 4, 5, 6), 6)
    assert positions_in(spark, path) == [1, 2, 3, 4, 5, 6]
