"""How often the lake's Delta tables checkpoint their log (``cdc_assets.lake.spark``'s session default): every 100
commits, not Delta's 10, so a stream batch seldom pays a checkpoint inside its commits; a user's ``spark.conf``
chooses otherwise."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_assets.config import SparkConfig
from cdc_assets.lake.mirror import append_changelog, ensure_mirror
from cdc_assets.lake.spark import CHECKPOINT_INTERVAL_DEFAULT, driver_conf

INTERVAL = "delta.checkpointInterval"


def checkpoints(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "_delta_log").glob("*.checkpoint*.parquet"))


def test_a_mirror_and_a_changelog_checkpoint_their_log_every_100_commits(spark: SparkSession, tmp_path: Path) -> None:
    mirror_path, changelog_path = tmp_path / "mirror", tmp_path / "changelog"
    mirror = ensure_mirror(spark, str(mirror_path), [T.StructField("id", T.LongType())], key_columns=["id"])
    assert mirror.detail().first()["properties"].get(INTERVAL) == "100"
    for position in range(1, 13):  # versions 0-11: Delta's own interval would have written version 10's checkpoint
        batch = spark.createDataFrame([(position, position)], "id long, _cdc_position long")
        append_changelog(spark, str(changelog_path), batch, position)
    assert spark.read.format("delta").load(str(changelog_path)).count() == 12
    assert checkpoints(changelog_path) == []
    assert spark.sql(f"SHOW TBLPROPERTIES delta.`{changelog_path}` ({INTERVAL})").first()["value"] == "100"


def test_the_checkpoint_interval_is_a_default_the_users_spark_conf_overrides() -> None:
    assert driver_conf(SparkConfig())[CHECKPOINT_INTERVAL_DEFAULT] == "100"
    assert driver_conf(SparkConfig(conf={CHECKPOINT_INTERVAL_DEFAULT: "10"}))[CHECKPOINT_INTERVAL_DEFAULT] == "10"
