"""The lake on an object store (``s3a://``, moto's S3 server on loopback: the ``s3_lake`` fixture): the control files,
the staged chunk files, and a MongoDB source's pipeline.

- ``LakePath``'s contract, checked by the same functions as on a local disk (``tests/lake/test_files.py``).
- The source's control files (``SourceLake``: plans, waiting markers, acknowledged position, resnapshot markers).
- Staged chunk files written by pyarrow to S3 and read by Spark through s3a, with the checks of
  ``tests/lake/test_staging.py`` that take any folder.
- A MongoDB collection (``_id``s of every kind) snapshotted under a writer with its lake on S3, one snapshot run
  killed with its rows staged and one stream batch killed after its lake commit, then caught up: the mirror is exact,
  its Delta tables, window log and plans are in the bucket, and no local lake folder was made.

The end-to-end scenario on S3 (a snapshot under a concurrent writer, runs killed and run again, the stream to the end,
every mirror exact) runs on a Spark standalone cluster: ``tests/integration/test_spark_cluster.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pymongo
import pytest
from pyspark.sql import SparkSession

from cdc_assets.engine.chunks import Chunk, ChunkPlan
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.layout import Resnapshot, SourceLake
from cdc_assets.lake.staging import drop_attempts, staged_attempt_times, staged_bytes, staged_row_counts, write_part
from cdc_assets.pipeline import CdcPipeline
from cdc_assets.sources.mongodb.dialect import MongoDialect
from tests.integration.s3_support import bucket_keys
from tests.integration.test_mongodb_pipeline import BackgroundWriter, Writer, assert_exact, mixed_id, source_config
from tests.lake import test_files, test_staging
from tests.pipeline_support import FaultPoints, Killed, Stream


def test_lake_paths_keep_their_contract_on_s3(s3_lake: str) -> None:
    root = LakePath(f"{s3_lake}/files")
    assert root.local_path is None and root.uri == f"{s3_lake}/files"
    test_files.check_names(root)
    test_files.check_text_files(root)
    test_files.check_atomic_output(root)


def test_a_source_lakes_control_files_on_s3(s3_lake: str) -> None:
    lake = SourceLake(s3_lake, "ctl")
    assert str(lake.control) == f"{s3_lake}/ctl/_cdc"
    assert lake.read_plan("public.t") is None and lake.waiting_markers() == {} and lake.acknowledged() is None
    plan = ChunkPlan("public.t", ("id",), (Chunk(0, None, (10,)), Chunk(1, (10,), None)))
    assert lake.store_plan(plan) == plan
    other = ChunkPlan("public.t", ("id",), (Chunk(0, None, None),))
    assert lake.store_plan(other) == plan  # stored once: the first plan stays
    lake.mark_waiting("public.t", 1, 500)
    lake.mark_waiting('odd."name"', 0, 700)
    assert lake.waiting_markers() == {("public.t", 1): 500, ('odd."name"', 0): 700}
    lake.clear_stale_markers({('odd."name"', 0)}, older_than=time.time() + 60)  # chunk 1 closed
    assert lake.waiting_markers() == {('odd."name"', 0): 700}
    lake.record_acknowledged(42)
    assert SourceLake.of_control(lake.control).acknowledged() == 42
    lake.mark_resnapshot("public.t", 100, "history lost")
    lake.mark_resnapshot("public.t", 90, "older")
    assert lake.resnapshot_markers() == {"public.t": Resnapshot(100, "history lost")}
    lake.mark_check_waiting("c1", 77)
    assert lake.check_markers() == [77]
    lake.clear_check_waiting("c1")
    assert lake.check_markers() == []
    assert not lake.upkeep_due("compact", 3600) and (lake.control / "upkeep" / "compact").is_file()


def test_staged_chunk_files_on_s3(spark: SparkSession, s3_lake: str) -> None:
    folder = f"{s3_lake}/staged-checks"
    test_staging.test_every_codec_type_reads_back_as_its_spark_type_and_value(spark, f"{folder}/types")
    test_staging.test_attempts_staged_before_a_column_was_added_read_it_as_null(spark, f"{folder}/added")
    test_staging.test_attempt_ids_that_look_like_dates_or_numbers_stay_strings(spark, f"{folder}/dates")
    schema = test_staging.arrow_schema(test_staging.COLUMNS)
    table = test_staging.typed_rows(test_staging.COLUMNS, test_staging.TEXTS)
    staged = f"{folder}/retried"
    write_part(staged, "a1", 0, 0, [table], schema)
    write_part(staged, "a1", 0, 0, [table.slice(0, 2)], schema)  # a retried task's file replaces the first

    def dies_after_one_batch():
        yield table
        raise ConnectionError("the read died")

    with pytest.raises(ConnectionError, match="the read died"):
        write_part(staged, "a1", 1, 0, dies_after_one_batch(), schema)
    assert staged_row_counts(staged, ["a1"]) == {("a1", 0): 2}  # nothing of chunk 1, complete or partial
    assert [e.name for e in (LakePath(staged) / "_cdc_attempt=a1").entries()] == ["chunk-0-part-0.parquet"]
    assert staged_bytes(staged, ["a1"]) > 0
    assert set(staged_attempt_times(staged)) == {"a1"}
    assert drop_attempts(staged, ["a1", "never-staged"]) == 1
    assert staged_attempt_times(staged) == {} and LakePath(staged).entries() == []


def test_a_mongodb_collection_is_mirrored_exactly_under_writes_and_kills_with_the_lake_on_s3(
    spark: SparkSession, mongo_server: str, database_name: str, s3_lake: str, faults: FaultPoints
) -> None:
    lake = f"{s3_lake}/mongo"
    with pymongo.MongoClient(mongo_server) as client:
        items = client[database_name]["items"]
        ids = [mixed_id(i) for i in range(120)]
        items.insert_many([{"_id": key, "v": n, "tags": ["a"]} for n, key in enumerate(ids)])
        config, source = source_config(mongo_server, lake, database_name, chunk_size=40, max_changes=100)
        pipeline = CdcPipeline(config, source, MongoDialect(source, SourceLake(lake, source.name).control))
        table = pipeline.prepare()[f"{database_name}.items"]
        chunks = [chunk.index for chunk in pipeline.plan(table).chunks]
        assert len(chunks) >= 2
        stream = Stream(pipeline, spark)
        writer = Writer(items, ids, seed=11)
        with BackgroundWriter(writer):
            faults.armed.add("snapshot.before_window_record")
            with pytest.raises(Killed):  # killed with its chunks' rows staged on S3
                pipeline.snapshot(spark, table, chunks, "s1")
            pipeline.snapshot(spark, table, chunks, "s2")
            faults.armed.add("stream.after_lake_commit")
            while "stream.after_lake_commit" in faults.armed:
                stream.batch()  # killed after its lake commit, its offset not recorded
        assert writer.writes > 10 and stream.recorded is None
        stream.catch_up()
        assert_exact(spark, pipeline, items)
    keys = bucket_keys(lake)
    paths = pipeline.lake.table(table.qualified_name)
    mirror, changelog = (path.removeprefix(f"{lake}/") for path in (paths.mirror, paths.changelog))
    assert f"{mirror}/_delta_log/00000000000000000000.json" in keys, keys[:50]
    assert any(k.startswith(f"{changelog}/_delta_log/") for k in keys)
    assert f"docs/_cdc/plans/{table.qualified_name}.json" in keys and "docs/_cdc/acknowledged" in keys
    assert any(k.startswith("docs/_cdc/windows/_delta_log/") for k in keys)
    assert not [k for k in keys if "/_cdc/spill/" in k and not k.endswith("/")]  # every batch's spill was removed
    assert not (Path.cwd() / "s3a:").exists()  # no local folder of a collapsed URI (``Path("s3a://b/x")``)
