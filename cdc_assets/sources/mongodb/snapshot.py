"""Chunks of a collection over ``_id`` and their reads.

Contract:
- ``plan_chunks(client, collection, chunk_size)``: one chunk when the collection holds at most ``chunk_size``
  documents (its estimated count); else boundaries from ``splitVector`` (``maxChunkObjects`` = ``chunk_size``) where
  the user may run it, else from sampling: ``$sample`` of about 20 ids per chunk, sorted by ``bson_order.sort_key``,
  every N-th one a boundary. Bounds are ``(<hex of sort_key(_id)>,)``: the lake's ``_id_key`` values, so a chunk
  is the same range in the source's BSON order and in Spark's string order. The last chunk is open-ended.
- ``read_chunk(client, collection, lo, hi, low_watermark, cluster_time)`` yields the documents of ``[lo, hi)`` as
  Arrow tables of the collection's schema (``CapturedCollection.arrow_schema``, declared fields typed; at most
  ``BATCH_ROWS`` rows each). It reads every document of the collection with read concern ``majority`` (on a server
  that keeps cluster times in a causally consistent session after the low watermark: ``afterClusterTime``, so the
  read sees every event at or before it) and keeps those whose ``_id_key`` is in the range. Why not a range query:
  a ``$gte``/``$lt`` on ``_id`` matches only the bound's type (type bracketing), ``min()``/``max()`` are ignored by
  the test server, and the test server's order differs from MongoDB's for a few values (docs/mongodb.md); filtering
  by the key in the reader loses no type. The cost: each chunk's read scans the collection (chunks read in parallel
  tasks each scan it once).
- The test server does not cap a reply at 16 MB as MongoDB does: a batch of a few large documents is larger than
  its message size (48 MB) and the driver fails with "Message length ... is larger than server max message size".
  ``read_whole(read)`` runs a whole read again with ``SAFE_BATCH`` documents a batch then (two of at most 16 MB
  fit); its callers restart only reads whose output is not visible yet (a staged file is renamed into place once
  complete; a check keeps the rows once read). Yielded tables also stop at ``BATCH_BYTES`` of canonical JSON.
- ``chunk_stager(...)`` is the Arrow batch mapper of a window's chunk reads (``lake.tasks.map_in_tasks``), each
  task with its own client (the connection string travels in the task's closure, never in a log), writing one staged
  file (``cdc_assets.lake.staging.write_part``) and yielding ``(chunk, rows)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import pyarrow as pa
import pymongo
from pymongo import monitoring
from pymongo.errors import OperationFailure, ProtocolError

from cdc_assets.config import MongoConnection
from cdc_assets.engine.chunks import ChunkPlan, chunks_from_boundaries
from cdc_assets.engine.windows import WindowStart
from cdc_assets.lake import staging
from cdc_assets.sources.mongodb import client as clients
from cdc_assets.sources.mongodb.bson_order import sort_key
from cdc_assets.sources.mongodb.catalog import CapturedCollection, document_row, id_key, rows_table
from cdc_assets.sources.mongodb.watermark import timestamp_of

BATCH_ROWS = 1000
BATCH_BYTES = 32 << 20
SAFE_BATCH = 2
SAMPLES_PER_CHUNK = 20
SAMPLE_ATTEMPTS = 5


def plan_chunks(client: pymongo.MongoClient, table: CapturedCollection, chunk_size: int) -> ChunkPlan:
    collection = client[table.database][table.collection]
    count = collection.estimated_document_count()
    if count <= chunk_size:
        return ChunkPlan(table.qualified_name, table.key_columns, chunks_from_boundaries([]))
    ids = _split_vector(client, table, chunk_size)
    if ids is None:
        chunks = math.ceil(count / chunk_size)
        sample = _sample_ids(collection, chunks * SAMPLES_PER_CHUNK)
        keys = sorted({sort_key(d["_id"]) for d in sample})
        step = max(1, len(keys) // chunks)
        ids_keys = keys[step::step][: chunks - 1]
    else:
        ids_keys = sorted({sort_key(i) for i in ids})
    boundaries = [(k.hex(),) for k in ids_keys]
    return ChunkPlan(table.qualified_name, table.key_columns, chunks_from_boundaries(boundaries))


def _sample_ids(collection: pymongo.collection.Collection, size: int) -> list[dict[str, Any]]:
    """``$sample`` of ``size`` ids. The test server's ``$sample`` fails now and then (about one call in twelve:
    "Comparison method violates its general contract!", its random order handed to a sort): tried up to
    ``SAMPLE_ATTEMPTS`` times."""
    pipeline = [{"$sample": {"size": size}}, {"$project": {"_id": 1}}]
    for attempt in range(SAMPLE_ATTEMPTS):
        try:
            return list(collection.aggregate(pipeline))
        except OperationFailure as error:
            if "general contract" not in str(error) or attempt == SAMPLE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _split_vector(client: pymongo.MongoClient, table: CapturedCollection, chunk_size: int) -> list[Any] | None:
    """``splitVector``'s split points, or None where the server or the user's role does not allow it."""
    try:
        reply = client[table.database].command(
            "splitVector", f"{table.database}.{table.collection}", keyPattern={"_id": 1}, maxChunkObjects=chunk_size,
        )  # fmt: skip
    except OperationFailure:
        return None
    return [key["_id"] for key in reply.get("splitKeys", [])]


def in_range(key: str, lo: str | None, hi: str | None) -> bool:
    return (lo is None or key >= lo) and (hi is None or key < hi)


Read = TypeVar("Read")


def read_whole(read: Callable[[int], Read]) -> Read:
    """``read(batch_size)``, again from the start with ``SAFE_BATCH`` when a reply was too large for the test server's
    message size (see the module docstring)."""
    try:
        return read(BATCH_ROWS)
    except ProtocolError as error:
        if "max message size" not in str(error):
            raise
        return read(SAFE_BATCH)


def read_chunk(
    client: pymongo.MongoClient, table: CapturedCollection, lo: str | None, hi: str | None, low_watermark: int,
    cluster_time: bool, batch_size: int = BATCH_ROWS, query: Mapping[str, Any] | None = None,
) -> Iterator[pa.Table]:  # fmt: skip
    """``query``: a ``find`` filter of an ad-hoc snapshot (``filter_query.query_document``), applied by the server;
    none for a chunk (every document, kept by its key)."""
    collection = client[table.database][table.collection]
    session = client.start_session(causal_consistency=True) if cluster_time else None
    try:
        if session is not None:
            session.advance_operation_time(timestamp_of(low_watermark))
        rows: list[dict[str, Any]] = []
        size = 0
        schema = table.arrow_schema
        for document in collection.find(dict(query or {}), session=session, batch_size=batch_size):
            key = id_key(document["_id"])
            if in_range(key, lo, hi):
                row = document_row(document, table.fields)
                rows.append(row)
                size += len(row["document"])
                if len(rows) >= BATCH_ROWS or size >= BATCH_BYTES:
                    yield rows_table(rows, schema)
                    rows, size = [], 0
        yield rows_table(rows, schema)
    finally:
        if session is not None:
            session.end_session()


def rows_by_key(
    client: pymongo.MongoClient,
    table: CapturedCollection,
    keys: Sequence[tuple],
    low_watermark: int,
    cluster_time: bool,
    batch_size: int = BATCH_ROWS,
) -> Iterator[pa.Table]:
    """The documents whose ``_id_key`` is one of ``keys`` (a fill window's read; the same full scan)."""
    wanted = {str(k[0]) for k in keys}
    for part in read_chunk(client, table, None, None, low_watermark, cluster_time, batch_size):
        mask = pa.array([key in wanted for key in part.column("_id_key").to_pylist()], pa.bool_())
        yield part.filter(mask)


def chunk_stager(
    connection: MongoConnection, table: CapturedCollection, staging_path: str, attempt: str, low_watermark: int,
    cluster_time: bool, listeners: Sequence[monitoring.CommandListener], start: WindowStart,
):  # fmt: skip
    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        client = clients.connect(connection, listeners)
        try:
            for batch in batches:
                for item in batch.to_pylist():

                    def stage(batch_size: int, item: dict[str, Any] = item) -> int:
                        tables = read_chunk(
                            client, table, item["lo"], item["hi"], low_watermark, cluster_time, batch_size
                        )
                        return staging.write_part(
                            staging_path, attempt, item["chunk"], 0, tables, table.arrow_schema, start,
                            table.key_columns,
                        )  # fmt: skip

                    rows = read_whole(stage)
                    yield pa.RecordBatch.from_arrays(
                        [pa.array([item["chunk"]], pa.int32()), pa.array([rows], pa.int64())], names=["chunk", "rows"]
                    )
        finally:
            client.close()

    return read
