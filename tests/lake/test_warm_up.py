"""The warm-up of a successor stream run's driver (``cdc_assets.lake.warm_up``): it rehearses a table's latest batch
on shallow clones of its changelog and mirror with the pipeline's own code, leaves nothing behind in the lake but a
live run's scratch folder, and writes, moves or removes no file of a mirror or changelog."""

from __future__ import annotations

import json
from pathlib import Path

from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.mirror import USER_METADATA, append_changelog, apply_changes
from cdc_assets.lake.warm_up import rehearse_batch, scratch_folder
from cdc_assets.sources.postgres.pg_values import spark_schema
from tests.lake.test_mirror_merge import CHANGES, COLUMNS

FIELDS = spark_schema(COLUMNS).fields


def commit_batch(spark: SparkSession, lake: SourceLake, position: int, changes: list[tuple]) -> None:
    """One stream batch of ``public.items`` as the pipeline commits it: changelog append, then the mirror's MERGE."""
    paths = lake.table("public.items")
    frame = spark.createDataFrame(changes, CHANGES)
    spark.conf.set(USER_METADATA, json.dumps({"position": position}))
    try:
        append_changelog(spark, paths.changelog, frame, position)
        apply_changes(spark, paths.mirror, frame, FIELDS, ["id"], set())
    finally:
        spark.conf.unset(USER_METADATA)


def files(path: str) -> dict[str, int]:
    """Every file under a table's folder (its log and data files) with its modification time."""
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in Path(path).rglob("*") if p.is_file()}


def test_a_tables_latest_batch_is_rehearsed_on_scratch_tables_that_are_removed_and_nothing_else_is_written(
    spark: SparkSession, tmp_path: Path
) -> None:
    lake = SourceLake(tmp_path, "demo")
    paths = lake.table("public.items")
    commit_batch(spark, lake, 5, [("c", 5, i, None, [], (i, f"first {i}", None), None) for i in range(3)])
    latest = [
        ("u", 9, 0, None, [], (1, "updated", None), None),
        ("d", 9, 1, None, [], None, (2, None, None)),
        ("c", 9, 2, None, [], (7, "inserted", None), None),
    ]
    commit_batch(spark, lake, 9, latest)
    before = files(paths.mirror), files(paths.changelog)
    warm_up_folder = Path(str(lake.control)) / "warm_up"
    (warm_up_folder / "killed-run" / "_delta_log").mkdir(parents=True)  # left by a run killed while it warmed
    (warm_up_folder / "live-run" / "_delta_log").mkdir(parents=True)  # another run warming now

    with scratch_folder(lake, "this-run", {"live-run"}) as scratch:
        assert sorted(p.name for p in warm_up_folder.iterdir()) == ["live-run"]
        assert rehearse_batch(spark, scratch / "0", paths, FIELDS, ["id"])
        rehearsed = spark.read.format("delta").load(str(scratch / "0" / "mirror"))  # the real rows, the batch again
        assert sorted((r["id"], r["note"]) for r in rehearsed.collect()) == [
            (0, "first 0"),
            (1, "updated"),
            (7, "inserted"),
        ]
        changelog = spark.read.format("delta").load(str(scratch / "0" / "changelog"))
        positions = sorted(r["_cdc_position"] for r in changelog.collect())
        assert positions == [5] * 3 + [9] * 3 + [10] * 3 + [11] * 3  # the real changes, the latest batch twice after
        assert (
            DeltaTable.forPath(spark, str(scratch / "0" / "mirror")).history().where("operation = 'MERGE'").count() == 2
        )
        assert not rehearse_batch(spark, scratch / "1", lake.table("public.not_written"), FIELDS, ["id"])

    assert sorted(p.name for p in warm_up_folder.iterdir()) == ["live-run"]
    assert (files(paths.mirror), files(paths.changelog)) == before  # nothing written, moved or removed
    mirror = spark.read.format("delta").load(paths.mirror)
    assert sorted((r["id"], r["note"]) for r in mirror.collect()) == [(0, "first 0"), (1, "updated"), (7, "inserted")]


def test_a_rehearsal_stops_between_its_steps_once_the_pool_is_free(spark: SparkSession, tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "demo")
    commit_batch(spark, lake, 5, [("c", 5, i, None, [], (i, f"first {i}", None), None) for i in range(3)])
    checks = iter([True, False])  # waiting at the changelog's clone, free before the mirror's
    with scratch_folder(lake, "this-run", set()) as scratch:
        paths = lake.table("public.items")
        assert not rehearse_batch(spark, scratch / "0", paths, FIELDS, ["id"], lambda: next(checks))
        rehearsal = Path(str(scratch)) / "0"
        assert (rehearsal / "changelog").exists() and not (rehearsal / "mirror").exists()
