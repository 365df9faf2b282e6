"""Staged chunk rows: Parquet files that the snapshot's read tasks write themselves, one per sub-range.

Contract (``<table>/staged/_cdc_attempt=<attempt>/chunk-<n>-part-<k>.parquet``):
- ``write_part(folder, attempt, chunk, part, tables, schema, start, statistics)`` runs inside a read task (a Spark
  Python worker). It writes one sub-range's typed rows with pyarrow, adds ``_cdc_chunk``, and returns the number of
  rows. A chunk's read passes its window's ``start`` (``cdc_assets.engine.windows.WindowStart``): the file then also
  holds the mirror's row columns (``ROW_FIELDS``: ``_cdc_op`` ``r``, ``_cdc_position`` the start's position,
  ``_cdc_ts`` its time, ``_cdc_unknown`` NULL), before ``_cdc_chunk``, and Parquet statistics on ``_cdc_position``
  and the ``statistics`` columns (the key): such a file is a mirror file already, which the reconciliation can land
  whole (``cdc_assets.lake.adopt``). A by-key read (fill, rows window) passes none. An attempt
  id is letters, digits, ``.``, ``_`` and ``-`` (not first ``.``); another raises ``ValueError``. The file is
  written under a hidden temporary name (Spark and the counts skip names that start with ``.``) and renamed into
  place when complete, so a reader never sees a partial file. The name depends only on (attempt, chunk, part): a
  retried task replaces the file of the failed one. A sub-range without rows still writes a file without rows.
  Any table the codec makes is writable (a NULL list that spans values is rebuilt first).
- ``staged_row_counts(folder, attempts)``: rows per (attempt, chunk), summed from the files' footers in the
  calling process (no Spark job).
- ``staged_bytes(folder, attempts)``: the uncompressed bytes of the attempts' rows, from the files' footers.
- ``read_staged(spark, folder, attempts, fields)``: the rows of ``attempts`` as one frame, with ``_cdc_attempt``
  (a string) from the folder name as a partition column (and the row columns of the files that have them: callers
  select the source columns). The attempts' schemas are merged: an attempt read before a column was added has NULL
  in it. When none of the attempts has a file, an empty frame of ``fields`` (the caller's description of the
  table's columns, ``cdc_assets.lake.schema``) with ``_cdc_chunk`` and ``_cdc_attempt``.
- ``part_files(folder, attempt)``: (chunk, file) of each complete staged file of an attempt.
- ``staged_attempt_times(folder)``: each staged attempt with the modification time (epoch seconds) of its newest
  file.
- ``drop_attempts(folder, attempts)``: deletes the attempts' folders and returns the number of files deleted.

Staging is not a Delta table. An attempt's files are written once, by the one job that reads its chunks, and are
read whole; what makes them count is the attempt's ``staged`` record in the window log, which is a Delta table
(``cdc_assets.lake.windows``), written after the job finished and with the row counts the job returned. A run
killed before that record leaves files that no window names; the upkeep drops them a day later. Before
reconciling a window, the counts above are compared with the recorded ones (``cdc_assets.lake.mirror``), so a
missing or extra file stops the reconciliation before it writes. Writing the rows from the Python worker avoids
moving every row into Spark's JVM rows twice (1M rows, warm: 2.7 s to stage this way, 5.0 s through a Delta
append). The folder is read and written through ``cdc_assets.lake.files.LakePath``, as the rest of the lake's
control data (``cdc_assets.lake.layout``): a local path or an ``s3a://`` URI (the read tasks then write to the object
store from the workers).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from cdc_assets.engine.windows import WindowStart
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.spark import session_conf

CHUNK_COLUMN = "_cdc_chunk"
ATTEMPT_COLUMN = "_cdc_attempt"
PART_FILE = re.compile(r"chunk-(-?\d+)-part-(\d+)\.parquet")  # a fill window's chunk is -1
ATTEMPT_FOLDER_PREFIX = f"{ATTEMPT_COLUMN}="
ATTEMPT_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
# a partition value like "2024-01-01" or "12" would otherwise be typed as a date or a number
INFERENCE_CONF = "spark.sql.sources.partitionColumnTypeInference.enabled"


def _attempt_folder(folder: str | os.PathLike[str] | LakePath, attempt: str) -> LakePath:
    if not ATTEMPT_ID.fullmatch(attempt):
        raise ValueError(
            f"attempt id {attempt!r} cannot name a staging folder: allowed are letters, digits, '.', '_' and '-', "
            "not '.' first"
        )
    return LakePath(folder) / f"{ATTEMPT_FOLDER_PREFIX}{attempt}"


# the mirror's own columns of a row (``cdc_assets.lake.mirror.META_FIELDS``, as Arrow)
ROW_FIELDS = (
    pa.field("_cdc_op", pa.string()),
    pa.field("_cdc_position", pa.int64()),
    pa.field("_cdc_ts", pa.timestamp("us", tz="UTC")),
    pa.field("_cdc_unknown", pa.list_(pa.string())),
)
ROW_COLUMNS = tuple(f.name for f in ROW_FIELDS)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def staged_schema(schema: pa.Schema, with_row_columns: bool = False) -> pa.Schema:
    """The schema of a staged file: the source columns (``schema``), the mirror's row columns when asked, and
    ``_cdc_chunk``. The attempt is the folder's name, not a column of the file: Spark reads it as a partition value,
    a constant per file."""
    fields = [*schema, *(ROW_FIELDS if with_row_columns else ()), pa.field(CHUNK_COLUMN, pa.int32())]
    return pa.schema(fields)


def _row_columns(count: int, start: WindowStart) -> list[pa.Array]:
    at = start.at.astimezone(UTC)
    micros = (at - EPOCH) // timedelta(microseconds=1)
    return [
        pa.array(np.full(count, "r", dtype=object), pa.string()),
        pa.array(np.full(count, start.position, dtype=np.int64)),
        pa.array(np.full(count, micros, dtype=np.int64)).cast(ROW_FIELDS[2].type),
        pa.nulls(count, ROW_FIELDS[3].type),
    ]


def _writable(table: pa.Table) -> pa.Table:
    """``table`` with every nested column that has NULLs rebuilt by ``take``: the codec may leave a NULL list slot
    spanning values (an array with an unrepresentable element becomes NULL after its elements were decoded), which
    Arrow allows but pyarrow's Parquet writer refuses ("Lists with non-zero length null components")."""
    for index, field in enumerate(table.schema):
        column = table.column(index)
        if pa.types.is_nested(field.type) and column.null_count:
            table = table.set_column(index, field, column.take(pa.array(np.arange(len(column)))))
    return table


def write_part(
    folder: str | os.PathLike[str] | LakePath,
    attempt: str,
    chunk: int,
    part: int,
    tables: Iterable[pa.Table],
    schema: pa.Schema,
    start: WindowStart | None = None,
    statistics: Sequence[str] = (),
) -> int:
    """Write one sub-range's rows (``tables``, each of ``schema``) as one staged file; the number of rows."""
    target = _attempt_folder(folder, attempt) / f"chunk-{chunk}-part-{part}.parquet"
    file_schema = staged_schema(schema, with_row_columns=start is not None)
    statistics = [n for n in (*statistics, "_cdc_position") if n in file_schema.names] if start is not None else False
    rows = 0
    # no dictionaries: Spark read dictionary-encoded staged files into the mirror's write more slowly (10M rows,
    # back to back: reconciliation 36.4 and 39.6 s without them, 43.4 and 44.4 s with them)
    with (
        target.open_atomic_output() as stream,
        pq.ParquetWriter(stream, file_schema, write_statistics=statistics, use_dictionary=False) as writer,
    ):
        for table in tables:
            count = table.num_rows
            columns = [*_writable(table).columns, *(_row_columns(count, start) if start is not None else ())]
            columns.append(pa.array(np.full(count, chunk, dtype=np.int32)))
            writer.write_table(pa.Table.from_arrays(columns, schema=file_schema))
            rows += count
    return rows


def part_files(folder: str | os.PathLike[str] | LakePath, attempt: str) -> list[tuple[int, LakePath]]:
    return list(_part_files(_attempt_folder(folder, attempt)))


def _part_files(folder: LakePath) -> Iterator[tuple[int, LakePath]]:
    """(chunk, file) of every complete staged file in an attempt's folder."""
    for entry in folder.entries():
        match = PART_FILE.fullmatch(entry.name)
        if match and not entry.is_dir:
            yield int(match.group(1)), entry.path


def _footer(path: LakePath) -> pq.FileMetaData:
    return pq.read_metadata(path.path, filesystem=path.filesystem)


def staged_row_counts(folder: str | os.PathLike[str] | LakePath, attempts: Iterable[str]) -> dict[tuple[str, int], int]:
    folder = LakePath(folder)  # resolved once, not once per attempt (an object store's client each time)
    counts: dict[tuple[str, int], int] = {}
    for attempt in sorted(set(attempts)):
        for chunk, path in _part_files(_attempt_folder(folder, attempt)):
            counts[(attempt, chunk)] = counts.get((attempt, chunk), 0) + _footer(path).num_rows
    return counts


def staged_bytes(folder: str | os.PathLike[str] | LakePath, attempts: Iterable[str]) -> int:
    folder = LakePath(folder)
    total = 0
    for attempt in sorted(set(attempts)):
        for _, path in _part_files(_attempt_folder(folder, attempt)):
            metadata = _footer(path)
            total += sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    return total


def read_staged(
    spark: SparkSession,
    folder: str | os.PathLike[str] | LakePath,
    attempts: Iterable[str],
    fields: Sequence[T.StructField],
) -> DataFrame:
    folder = LakePath(folder)
    paths = [
        str(path) for attempt in sorted(set(attempts)) if any(_part_files(path := _attempt_folder(folder, attempt)))
    ]
    if not paths:
        extra = [T.StructField(CHUNK_COLUMN, T.IntegerType()), T.StructField(ATTEMPT_COLUMN, T.StringType())]
        return spark.createDataFrame([], T.StructType([*fields, *extra]))
    with session_conf(spark, {INFERENCE_CONF: "false"}):  # the folders' partition values are typed here
        reader = spark.read.option("mergeSchema", "true").option("basePath", folder.uri)
        # no row-group pruning by dictionary: when a staged file's key column was dictionary-encoded in every row
        # group (pyarrow's default, which ``write_part`` no longer uses; older files may have it), parquet-mr expanded
        # each dictionary into a hash set of boxed values to test the join's IS NOT NULL filter: 16 s of garbage
        # collection in a 10M-row reconciliation. Staged rows are read whole by attempt: nothing to prune.
        return reader.option("parquet.filter.dictionary.enabled", "false").parquet(*paths)


def staged_attempt_times(folder: str | os.PathLike[str] | LakePath) -> dict[str, float]:
    times: dict[str, float] = {}
    for attempt_folder in LakePath(folder).entries():
        if not attempt_folder.is_dir or not attempt_folder.name.startswith(ATTEMPT_FOLDER_PREFIX):
            continue
        files = [e.mtime or 0.0 for e in attempt_folder.path.entries() if not e.is_dir]
        times[attempt_folder.name.removeprefix(ATTEMPT_FOLDER_PREFIX)] = max(files, default=attempt_folder.mtime or 0.0)
    return times


def drop_attempts(folder: str | os.PathLike[str] | LakePath, attempts: Iterable[str]) -> int:
    folder = LakePath(folder)
    dropped = 0
    for attempt in sorted(set(attempts)):
        path = _attempt_folder(folder, attempt)
        files = [e for e in path.entries() if not e.is_dir]
        if files or path.exists():
            dropped += len(files)
            path.rmtree()
    return dropped
