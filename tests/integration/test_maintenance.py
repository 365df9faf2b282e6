"""Lake upkeep (``cdc_assets.lake.maintenance``) and staged attempts (``cdc_assets.lake.staging``) on a live
pipeline: real PostgreSQL, Spark and Delta."""

from __future__ import annotations

import shutil
import time
from datetime import timedelta
from pathlib import Path

import pytest
from pyspark.sql import functions as F

import cdc_assets.lake.mirror as mirror_module
from cdc_assets.engine.windows import finished_attempts, unrecorded_attempts
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.maintenance import UNRECORDED_GRACE, maintain_lake
from cdc_assets.lake.mirror import StagedRowsMismatch, last_applied_position
from cdc_assets.lake.staging import drop_attempts, staged_attempt_times, staged_row_counts
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from tests.integration.support import mirror_rows, pipeline_config, seeded_source, source_rows
from tests.integration.test_pipeline_basic import run_until_reconciled

DATABASE = "pipe_upkeep"
TARGET_BYTES = 64 * 1024 * 1024


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path):
    with seeded_source(postgres_server, DATABASE) as (admin, _):
        yield admin, pipeline_config(DATABASE, tmp_path / "lake", chunk_size=250)


def staged_attempts(path: str) -> set[str]:
    """The attempts with a staged file, from the file system."""
    return {p.parent.name.removeprefix("_cdc_attempt=") for p in Path(path).glob("_cdc_attempt=*/chunk-*.parquet")}


def file_count(spark, path: str) -> int:
    return len(spark.read.format("delta").load(path).inputFiles())


def assert_mirrors_match(spark, pipeline: PostgresPipeline) -> None:
    tables = PostgresPipeline(pipeline.config, pipeline.source).prepare()
    for name, table in tables.items():
        mirror = mirror_rows(spark, pipeline.lake.table(name).mirror, table)
        expected = source_rows(pipeline.source, table)
        differ = sorted(mirror ^ expected, key=str)
        assert mirror == expected, f"{name}: {len(differ)} rows differ, e.g. {differ[:2]}"


def test_upkeep_drops_finished_snapshots_compacts_and_the_stream_stays_exact(
    source, spark, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the batches mark replaced rows in deletion vectors, as a mirror of 16 MB or more takes them: each leaves files
    # behind for the upkeep to compact (a smaller mirror's batch rewrites the files it touches instead)
    monkeypatch.setattr(mirror_module, "REWRITE_FILES_BELOW_BYTES", 0)
    admin, config = source
    pipeline = PostgresPipeline(config, config.sources[0])
    tables = pipeline.prepare()
    items = tables["public.items"]
    first = {name: pipeline.snapshot(spark, t, [c.index for c in pipeline.plan(t).chunks], "t1").attempt
             for name, t in tables.items()}  # fmt: skip
    run_until_reconciled(pipeline, spark)
    # small batches: each adds files to every mirror and changelog
    recorded = None
    for round_ in range(3):
        admin.execute("update items set qty = %s where id %% 7 = %s", [round_, round_])
        admin.execute("insert into pairs (region, code, amount) values (50, %s, 1)", [f"r{round_}"])
        admin.execute("update docs set title = %s where title like %s", [f"r{round_}", f"t{round_ + 1}%"])
        report = pipeline.stream_batch(spark, recorded, "small")
        recorded = report.offset
        pipeline.acknowledge(recorded)
    # a re-read of chunk 0 that the stream has not reconciled yet: its staged rows must stay
    waiting = pipeline.snapshot(spark, items, [0], "t2").attempt
    paths = {name: pipeline.lake.table(name) for name in tables}
    assert staged_attempts(paths["public.items"].staging) == {first["public.items"], waiting}
    before = {name: (file_count(spark, p.mirror), file_count(spark, p.changelog)) for name, p in paths.items()}
    offsets = {name: last_applied_position(spark, p.changelog) for name, p in paths.items()}

    # a run that died between its staged files and its window record left an attempt no window names
    items_staging = paths["public.items"].staging
    attempt_folder = Path(items_staging) / f"_cdc_attempt={first['public.items']}"
    shutil.copytree(attempt_folder, Path(items_staging) / "_cdc_attempt=died-before-record")
    events = window_log.read_events(spark, pipeline.lake.windows)
    staged_times = {"public.items": staged_attempt_times(items_staging)}
    assert set(staged_times["public.items"]) == {first["public.items"], waiting, "died-before-record"}
    # within a day of its write its run might still record it: kept
    assert unrecorded_attempts(events, staged_times, time.time() - UNRECORDED_GRACE.total_seconds()) == {}
    assert unrecorded_attempts(events, staged_times, time.time() + 1) == {"public.items": {"died-before-record"}}

    upkeep = maintain_lake(spark, pipeline.lake, tables, TARGET_BYTES, unrecorded_grace=timedelta(0))
    results = {r.table: r for r in upkeep}

    assert staged_attempts(paths["public.items"].staging) == {waiting}
    assert [results[name].unrecorded_attempts_dropped for name in sorted(tables)] == [0, 1, 0]  # docs, items, pairs
    for name in ("public.pairs", "public.docs"):
        assert staged_attempts(paths[name].staging) == set(), name
        assert results[name].staging_files_dropped > 0, name
    for name, p in paths.items():
        mirror_files, changelog_files = before[name]
        assert mirror_files > 2 and file_count(spark, p.mirror) < mirror_files, (name, mirror_files)
        assert file_count(spark, p.changelog) < changelog_files, (name, changelog_files)
        assert results[name].files_compacted > results[name].files_written > 0, results[name]
        # the changelog's offset (which makes a retried batch append nothing twice) survives the upkeep commits
        assert last_applied_position(spark, p.changelog) == offsets[name] is not None, name
    assert_mirrors_match(spark, pipeline)

    # the stream carries on from the compacted tables and closes the waiting window
    admin.execute("update items set name = 'after upkeep' where id % 3 = 0")
    admin.execute("delete from pairs where region = 50")
    run_until_reconciled(pipeline, spark)
    assert_mirrors_match(spark, pipeline)
    finished = finished_attempts(window_log.read_events(spark, pipeline.lake.windows))
    assert finished["public.items"] == {first["public.items"], waiting}
    assert drop_attempts(paths["public.items"].staging, finished["public.items"]) > 0
    assert staged_attempts(paths["public.items"].staging) == set()
    assert not list(Path(paths["public.items"].staging).iterdir())  # the attempts' folders are gone
    changelog = spark.read.format("delta").load(paths["public.items"].changelog)
    assert changelog.where(F.col("_cdc_op") == "u").count() > 0  # the changelog itself is untouched

    # a window whose staged rows are gone is refused before anything is written (reconciling it would delete the
    # chunk's mirror rows); re-materializing the partition supersedes it
    lost = pipeline.snapshot(spark, items, [0], "t3")  # chunk 0 holds the rows (chunks split the key range)
    assert lost.rows > 0
    assert sum(staged_row_counts(items_staging, [lost.attempt]).values()) == lost.rows
    assert drop_attempts(items_staging, {lost.attempt}) > 0
    refused = rf"table public\.items: chunk 0: attempt {lost.attempt} recorded {lost.rows} staged rows but staging "
    refused += r"holds 0: .*Re-materialize partition chunk-000000"
    with pytest.raises(StagedRowsMismatch, match=refused):
        run_until_reconciled(pipeline, spark)
    assert_mirrors_match(spark, pipeline)
    pipeline.snapshot(spark, items, [0], "t4")
    assert run_until_reconciled(pipeline, spark)[-1].waiting_windows == 0  # the refused window is superseded
    assert_mirrors_match(spark, pipeline)
