"""A lake on an S3-compatible object store, against a real server (moto's, on loopback: the ``s3_lake`` fixture),
real Spark with the s3a jars and real Delta.

- ``arrow_filesystem`` writes, lists, reads back and deletes a file under the ``s3a://`` lake root, and does the same
  on a local path; it refuses a ``gs://`` location naming the schemes it takes.
- The Spark session ``spark_session`` makes for an ``s3a://`` lake root (the shared ``spark`` fixture, started for
  it) writes a Delta table there, MERGEs into it and reads back exactly the rows expected; the objects are in the
  bucket, and no credential is in the Spark conf. A Parquet file pyarrow wrote through ``arrow_filesystem`` reads the
  same in Spark through ``s3a://``.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from cdc_assets.lake.object_store import arrow_filesystem

ROWS = [(1, "one"), (2, "two"), (3, "three")]
SCHEMA = "id long, v string"


@pytest.fixture()
def lake(s3_lake: str) -> str:
    """A folder of its own under the session's ``s3_lake`` root (other tests write there too)."""
    return f"{s3_lake}/object-store-{uuid.uuid4().hex[:10]}"


def write_read_list_delete(location: str) -> None:
    """The file round trip on the store holding ``location`` (a folder that does not exist yet)."""
    filesystem, folder = arrow_filesystem(location)
    path = f"{folder}/part/file.txt"
    filesystem.create_dir(f"{folder}/part")  # a local disk needs it (on S3 pyarrow writes an empty marker object)
    with filesystem.open_output_stream(path) as out:
        out.write(b"hello lake")
    listed = filesystem.get_file_info(pafs.FileSelector(folder, recursive=True))
    assert [(info.path, info.type, info.size) for info in listed if info.type == pafs.FileType.File] == [
        (path, pafs.FileType.File, 10)
    ]
    with filesystem.open_input_stream(path) as source:
        assert source.read() == b"hello lake"
    filesystem.delete_file(path)
    assert filesystem.get_file_info(path).type == pafs.FileType.NotFound


def test_arrow_filesystem_round_trips_a_file_on_the_object_store_and_on_a_local_disk(lake: str, tmp_path: Path) -> None:
    filesystem, _ = arrow_filesystem(lake)
    assert isinstance(filesystem, pafs.S3FileSystem)
    write_read_list_delete(f"{lake}/files")
    filesystem, _ = arrow_filesystem(str(tmp_path))
    assert isinstance(filesystem, pafs.LocalFileSystem)
    write_read_list_delete(str(tmp_path / "files"))
    with pytest.raises(ValueError, match=r"unsupported scheme 'gs'.*local path, file://, s3a://"):
        arrow_filesystem("gs://x")


def test_a_delta_table_on_the_object_store_is_written_merged_and_read_back(spark: SparkSession, lake: str) -> None:
    table = f"{lake}/delta/mirror"
    spark.createDataFrame(ROWS, SCHEMA).write.format("delta").save(table)
    changes = spark.createDataFrame([(2, "TWO"), (4, "four")], SCHEMA)
    (
        DeltaTable.forPath(spark, table)
        .alias("t")
        .merge(changes.alias("c"), "t.id = c.id")
        .whenMatchedUpdateAll()
        .whenNotMatchedInsertAll()
        .execute()
    )
    rows = {tuple(row) for row in spark.read.format("delta").load(table).collect()}
    assert rows == {(1, "one"), (2, "TWO"), (3, "three"), (4, "four")}
    assert [row["operation"] for row in DeltaTable.forPath(spark, table).history().collect()] == ["MERGE", "WRITE"]
    filesystem, folder = arrow_filesystem(table)  # in the bucket, not on a local disk
    log = filesystem.get_file_info(pafs.FileSelector(f"{folder}/_delta_log"))
    assert {"00000000000000000000.json", "00000000000000000001.json"} <= {Path(info.path).name for info in log}
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    for key, value in spark.sparkContext.getConf().getAll():
        assert not any(word in key.lower() for word in ("access.key", "secret", "session.token")), key
        assert secret not in value, key


def test_parquet_written_by_pyarrow_on_the_object_store_is_read_by_spark(spark: SparkSession, lake: str) -> None:
    location = f"{lake}/parquet/staged.parquet"
    filesystem, path = arrow_filesystem(location)
    frame = pa.table({"id": pa.array([r[0] for r in ROWS], pa.int64()), "v": [r[1] for r in ROWS]})
    pq.write_table(frame, path, filesystem=filesystem)
    assert sorted(tuple(row) for row in spark.read.parquet(location).collect()) == ROWS
