"""Per-chunk consistency check: does the mirror hold exactly the source's rows of one chunk?

Contract: ``check_chunks(spark, lake, slot, connect, table, chunks)`` (several chunks of a table in one window, or
one) runs a
watermark window like a snapshot: low watermark; in one ``REPEATABLE READ, READ ONLY`` transaction PostgreSQL
computes the chunk's row count and checksum (the sum of ``row_digest.source_row_digest`` over the key range); high
watermark. It then waits until the stream has applied everything up to the high watermark (the slot's
``confirmed_flush_lsn`` passed it and no snapshot window of a checked chunk closing at or below it is still open in
the window log; or ``wait_seconds`` expire: then the result is inconclusive, never a false alarm;
meanwhile a marker, ``SourceLake.mark_check_waiting``, makes ``pending_work`` ask for a batch, so a source nobody
writes to is checked too), and compares with the same count and checksum computed on Spark over the mirror's key
range (``mirror_row_digest``) on the columns the catalog lists after the low watermark (a column no write has
brought to the mirror yet is NULL there: an added column's ``DEFAULT``, which no change carries, is reported),
leaving out on both sides the keys that transactions not settled at the low watermark touched (the same rule as
reconciliation, so concurrent writes cause no false alarm; the source side subtracts those keys' digests in the same
transaction) and the keys whose mirror row holds unknown unchanged-TOAST values (its fill window is pending).
The mirror and the changelog are read as of one version each (the mirror first), so every evaluation
sees the same rows while the stream goes on. Only counts, sums and the excluded keys cross the wire. On a mismatch
the first differing key (in key-text order) is named with both rows' column texts, taken in the same transaction.
Nothing is written to the source or to a Delta table (only the marker file).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence

import psycopg
from delta.tables import DeltaTable
from psycopg import sql
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DataType

from cdc_assets.engine.chunks import Chunk
from cdc_assets.engine.windows import open_windows
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.layout import SourceLake, TablePaths
from cdc_assets.lake.mirror import _key_struct, _range_condition, q
from cdc_assets.source import ChunkCheck
from cdc_assets.sources.postgres import catalog, snapshot, stream
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN, spark_schema
from cdc_assets.sources.postgres.row_digest import (
    mirror_column_texts,
    mirror_key_text,
    mirror_row_digest,
    source_column_texts,
    source_key_text,
    source_row_digest,
)
from cdc_assets.sources.postgres.watermark import LowWatermark, unsettled_condition

SHOWN_TEXT_CHARS = 200


def _source_summary(reader: psycopg.Connection, table: CapturedTable, chunk: Chunk) -> tuple[int, int]:
    query = sql.SQL("select count(*), coalesce(sum({}), 0) from {} where {}").format(
        source_row_digest(table.columns), table.identifier, snapshot.range_predicate(table, chunk.lo, chunk.hi)
    )
    count, total = reader.execute(query).fetchone()
    return int(count), int(total)


def _source_summary_of_keys(
    reader: psycopg.Connection, table: CapturedTable, chunk: Chunk, key_texts: list[str]
) -> tuple[int, int]:
    """Count and digest sum of the chunk's source rows whose key text is one of ``key_texts`` (a hash join with
    the array, not a temporary table: the check writes nothing)."""
    query = sql.SQL(
        "select count(*), coalesce(sum(r.digest), 0) from (select {} as key_text, {} as digest from {} where {}) r "
        "join unnest({}::text[]) as k(key_text) using (key_text)"
    ).format(
        source_key_text(table.columns, table.key_columns), source_row_digest(table.columns), table.identifier,
        snapshot.range_predicate(table, chunk.lo, chunk.hi), sql.Literal(key_texts),
    )  # fmt: skip
    count, total = reader.execute(query).fetchone()
    return int(count), int(total)


def _summary(frame: DataFrame) -> tuple[int, int]:
    row = frame.agg(F.count(F.lit(1)).alias("n"), F.sum(F.col("_digest").cast("decimal(38,0)")).alias("h")).first()
    return int(row["n"]), int(row["h"] or 0)


def check_chunks(
    spark: SparkSession, lake: SourceLake, slot: str, connect: Callable[[], psycopg.Connection],
    table: CapturedTable, chunks: Sequence[Chunk], wait_seconds: float = 120,
) -> list[ChunkCheck]:  # fmt: skip
    """Check ``chunks`` of ``table`` (from its stored plan) in one watermark window (one wait for the stream); one
    result per chunk. ``connect`` opens a connection to the source as the pipeline's role; ``slot`` is its slot."""
    indexes = [c.index for c in chunks]
    paths = lake.table(table.qualified_name)
    with connect() as conn, connect() as reader:
        low_watermark = snapshot.take_low_watermark(conn)
        # the columns the table has now: every column added before the low watermark is compared (a column that no
        # write has brought to the mirror yet counts as NULL there)
        table = catalog.with_current_columns(conn, table)
        reader.execute("start transaction isolation level repeatable read, read only")
        try:
            sources = [_source_summary(reader, table, chunk) for chunk in chunks]  # the transaction's snapshot
            high_watermark = snapshot.take_high_watermark(conn)
            deadline = time.monotonic() + wait_seconds
            # ask for the batch that passes the high watermark: on a source nobody writes to, no change would
            token = uuid.uuid4().hex
            lake.mark_check_waiting(token, high_watermark)
            try:
                while True:
                    if stream.slot_position(conn, slot)[0] < high_watermark:
                        reason = "the stream has not applied the check's high watermark yet"
                    elif unreconciled := _unreconciled_windows(spark, lake, table, indexes, high_watermark):
                        reason = f"the snapshot windows of chunks {unreconciled} are not reconciled yet"
                    else:
                        break
                    if time.monotonic() > deadline:
                        return [_inconclusive(table, i, reason) for i in indexes]
                    time.sleep(1)
            finally:
                lake.clear_check_waiting(token)
            checked = list(zip(indexes, chunks, sources, strict=True))
            return _compare(spark, reader, table, paths, low_watermark, checked)
        finally:
            if not reader.broken:
                reader.execute("rollback")


def _unreconciled_windows(
    spark: SparkSession, lake: SourceLake, table: CapturedTable, indexes: Sequence[int], high_watermark: int
) -> list[int]:
    """Checked chunks whose staged snapshot window closes at or below the check's high watermark but is not
    reconciled yet. The slot having passed the high watermark does not say the stream reconciled them: on a
    source nobody writes to, the WAL does not move, so a batch that read the window log before the window was
    recorded can end at the very position the check takes as its high watermark."""
    wanted = set(indexes)
    return sorted(
        w.chunk for w in open_windows(window_log.read_events(spark, lake.windows))
        if w.table == table.qualified_name and w.chunk in wanted and w.hw <= high_watermark
    )  # fmt: skip


def _inconclusive(table: CapturedTable, index: int, reason: str) -> ChunkCheck:
    return ChunkCheck(table.qualified_name, index, conclusive=False, matches=False, reason=reason)


def _touched_keys(
    spark: SparkSession, paths: TablePaths, lw: LowWatermark, keys: list[str], key_types: dict[str, DataType]
) -> DataFrame | None:
    """Keys (old and new) that transactions not settled at the low watermark touched, or ``None`` when one of them
    was a TRUNCATE. The changelog is read as of its version now (pinned: the stream appends while the check runs,
    and a Delta frame, even a cached one, would see those appends on its next evaluation, so the source and the
    mirror side would leave out different keys) and narrowed by transaction id, never by WAL position (see
    ``cdc_assets.lake.mirror``: an unsettled transaction's commit record may precede the low watermark)."""
    touched = spark.createDataFrame([], ", ".join(f"{q(k)} {key_types[k].simpleString()}" for k in keys))
    if not DeltaTable.isDeltaTable(spark, paths.changelog):
        return touched
    version = DeltaTable.forPath(spark, paths.changelog).history(1).first()["version"]
    log = spark.read.format("delta").option("versionAsOf", version).load(paths.changelog)
    log = log.where(F.col("_cdc_xid") >= lw.xmin)
    log = log.where(unsettled_condition(F.lit(lw.xmin), F.lit(lw.xmax), F.array(*[F.lit(x) for x in sorted(lw.xip)])
                               .cast("array<long>")))  # fmt: skip
    if log.where(F.col("_cdc_op") == "t").limit(1).count():
        return None
    exploded = log.select(F.explode(F.array(_key_struct("after", keys), _key_struct("before", keys))).alias("k"))
    touched = exploded.where(F.col("k").isNotNull()).select(*[F.col(f"k.{q(k)}").alias(k) for k in keys])
    return touched.where(" and ".join(f"{q(k)} is not null" for k in keys)).distinct()


def _compare(
    spark: SparkSession, reader: psycopg.Connection, table: CapturedTable, paths: TablePaths,
    low_watermark: LowWatermark, chunks: list[tuple[int, Chunk, tuple[int, int]]],
) -> list[ChunkCheck]:  # fmt: skip
    columns = list(table.columns)
    names = [c.name for c in columns]
    keys = list(table.key_columns)
    key_types = {f.name: f.dataType for f in spark_schema(columns).fields if f.name in keys}
    if not DeltaTable.isDeltaTable(spark, paths.mirror):
        return [ChunkCheck(table.qualified_name, i, conclusive=True, matches=False, reason="no mirror yet")
                for i, _, _ in chunks]  # fmt: skip
    # pin the mirror first: the changelog read afterwards holds every change the pinned mirror holds
    version = DeltaTable.forPath(spark, paths.mirror).history(1).first()["version"]
    whole_mirror = spark.read.format("delta").option("versionAsOf", version).load(paths.mirror)
    # a row whose unchanged TOAST values are unknown waits for its fill window (``cdc_assets.lake.mirror``): left out
    # on both sides, like a touched key
    pending_fill = whole_mirror.where(F.col("_cdc_unknown").isNotNull()).select(*[q(k) for k in keys])
    present = set(whole_mirror.columns)
    types = {f.name: f.dataType for f in spark_schema(columns).fields}
    whole_mirror = whole_mirror.select(
        *[q(n) if n in present else F.lit(None).cast(types[n]).alias(n) for n in names], UNREPRESENTABLE_COLUMN
    )
    all_touched = _touched_keys(spark, paths, low_watermark, keys, key_types)
    if all_touched is None:
        return [_inconclusive(table, i, "a TRUNCATE ran during the check") for i, _, _ in chunks]
    all_touched = all_touched.unionByName(pending_fill).distinct().cache()
    results = []
    try:
        for index, chunk, (source_rows, source_sum) in chunks:
            in_range = _range_condition(chunk, keys, key_types)
            touched = all_touched.where(in_range)
            touched_texts = [r[0] for r in touched.select(mirror_key_text(columns, keys, False)).collect()]
            if touched_texts:
                left_out_rows, left_out_sum = _source_summary_of_keys(reader, table, chunk, touched_texts)
                source_rows, source_sum = source_rows - left_out_rows, source_sum - left_out_sum
            kept = whole_mirror.where(in_range).join(touched, keys, "left_anti")
            kept = kept.withColumn("_digest", mirror_row_digest(columns)).withColumn(
                "_key_text", mirror_key_text(columns, keys)
            )
            mirror_rows, mirror_sum = _summary(kept)
            matches = source_rows == mirror_rows and source_sum == mirror_sum
            difference = None if matches else _first_difference(spark, reader, table, chunk, kept, set(touched_texts))
            results.append(ChunkCheck(
                table.qualified_name, index, conclusive=True, matches=matches, source_rows=source_rows,
                mirror_rows=mirror_rows, source_checksum=str(source_sum), mirror_checksum=str(mirror_sum),
                excluded_keys=len(touched_texts), first_difference=difference,
            ))  # fmt: skip
    finally:
        all_touched.unpersist()
    return results


def _first_difference(
    spark: SparkSession, reader: psycopg.Connection, table: CapturedTable, chunk: Chunk, kept: DataFrame,
    excluded: set[str],
) -> str | None:  # fmt: skip
    """The first key (in key-text order) whose source and mirror digests differ, with both rows' column texts.
    Runs inside the check's transaction: the source side is the snapshot the checksum was computed on."""
    columns = list(table.columns)
    key_text = source_key_text(columns, table.key_columns)
    predicate = snapshot.range_predicate(table, chunk.lo, chunk.hi)
    query = sql.SQL("select {}, {} from {} where {}").format(
        key_text, source_row_digest(columns), table.identifier, predicate
    )
    pairs = [(k, int(d)) for k, d in reader.execute(query).fetchall() if k not in excluded]
    source = spark.createDataFrame(pairs, "_key_text string, _s_digest long")
    mirror = kept.select("_key_text", F.col("_digest").alias("_m_digest"))
    joined = source.join(mirror, "_key_text", "full_outer").where(~F.col("_s_digest").eqNullSafe(F.col("_m_digest")))
    row = joined.orderBy("_key_text").first()
    if row is None:
        return None
    names = [c.name for c in columns]
    texts_query = sql.SQL("select {} from {} where {} and {} = {}").format(
        sql.SQL(", ").join(source_column_texts(columns)), table.identifier, predicate, key_text,
        sql.Literal(row["_key_text"]),
    )  # fmt: skip
    found = reader.execute(texts_query).fetchone()
    source_texts = None if found is None else dict(zip(names, found, strict=True))
    texts = mirror_column_texts(columns)
    mirrored = (
        kept.where(F.col("_key_text") == row["_key_text"])
        .select(*[t.alias(n) for t, n in zip(texts, names, strict=True)])
        .first()
    )
    mirror_texts = None if mirrored is None else mirrored.asDict()
    either = source_texts or mirror_texts or {}
    key = ", ".join(f"{k}={either.get(k)}" for k in table.key_columns)
    differing = [n for n in names if (source_texts or {}).get(n) != (mirror_texts or {}).get(n)]
    return f"key ({key}): source={_shown(source_texts)} mirror={_shown(mirror_texts)}" + (
        f" differing columns: {', '.join(differing)}" if source_texts and mirror_texts else ""
    )


def _shown(texts: dict[str, str | None] | None) -> str:
    if texts is None:
        return "absent"
    cut = SHOWN_TEXT_CHARS
    return json.dumps(
        {n: t if t is None or len(t) <= cut else t[:cut] + "..." for n, t in texts.items()}, ensure_ascii=False
    )
