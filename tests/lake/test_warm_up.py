"""The warm-up of a successor stream run's driver (``cdc_assets.lake.warm_up``): it leaves nothing behind in the lake
but a live run's scratch folder, reads the existing mirrors' logs, and writes no mirror."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import types as T

from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.mirror import ensure_mirror
from cdc_assets.lake.warm_up import warm_up_driver


def test_the_warm_up_merges_into_a_scratch_table_it_removes_and_only_reads_the_mirrors(
    spark: SparkSession, tmp_path: Path
) -> None:
    lake = SourceLake(tmp_path, "demo")
    mirror = lake.table("public.items").mirror
    ensure_mirror(spark, mirror, [T.StructField("id", T.LongType())], key_columns=["id"])
    versions_before = sorted(p.name for p in (Path(mirror) / "_delta_log").glob("*.json"))
    scratch = Path(str(lake.control)) / "warm_up"
    (scratch / "killed-run" / "_delta_log").mkdir(parents=True)  # left by a run killed while it warmed
    (scratch / "live-run" / "_delta_log").mkdir(parents=True)  # another run warming now

    warm = warm_up_driver(spark, lake, ["public.items", "public.not_created_yet"], "this-run", {"live-run"})

    assert warm.mirrors_loaded == 1 and warm.seconds > 0, warm
    assert sorted(p.name for p in scratch.iterdir()) == ["live-run"]
    assert sorted(p.name for p in (Path(mirror) / "_delta_log").glob("*.json")) == versions_before
    assert not Path(lake.table("public.not_created_yet").mirror).exists()
