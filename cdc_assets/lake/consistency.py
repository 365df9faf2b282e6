"""Per-chunk consistency check: does the mirror hold exactly the source's rows of one chunk?

Contract: ``check_chunk(pipeline, spark, table, index)`` runs a watermark window like a snapshot (low watermark,
parallel read of the chunk from the source, high watermark), waits until the stream has applied everything up to
the high watermark (the slot's ``confirmed_flush_lsn`` passed it, or ``wait_seconds`` expire: then the result is
inconclusive, never a false alarm), and compares source and mirror over the chunk's key range, leaving out the
keys that transactions not settled at the low watermark touched (the same rule as reconciliation, so concurrent
writes cause no false alarm). The comparison is a row count and an order-independent checksum (sum of a 64-bit
hash of every column, ``_cdc_unrepresentable`` included) computed on Spark over the same typed values on both
sides, so the source side is exactly what a snapshot would stage. On a mismatch the first differing key is named
with both rows. Nothing is written anywhere.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.engine.pg_values import UNREPRESENTABLE_COLUMN, spark_schema
from cdc_assets.lake.mirror import _key_struct, _range_condition, _unsettled, q
from cdc_assets.postgres import snapshot, stream
from cdc_assets.postgres.catalog import CapturedTable


@dataclass
class ChunkCheck:
    table: str
    chunk: int
    conclusive: bool
    matches: bool
    source_rows: int = 0
    mirror_rows: int = 0
    source_checksum: str = ""
    mirror_checksum: str = ""
    excluded_keys: int = 0
    first_difference: str | None = None
    reason: str | None = None


def _row_hash(columns: list[str]) -> Column:
    parts = [F.col(q(c)) for c in columns]
    parts.append(F.array_sort(F.map_entries(F.col(UNREPRESENTABLE_COLUMN))))
    return F.xxhash64(*parts).cast("decimal(38,0)")


def _summary(frame: DataFrame) -> tuple[int, str]:
    row = frame.agg(F.count(F.lit(1)).alias("n"), F.sum("_hash").alias("h")).first()
    return int(row["n"]), str(row["h"] or 0)


def check_chunk(
    pipeline, spark: SparkSession, table: CapturedTable, index: int, wait_seconds: float = 120
) -> ChunkCheck:
    plan = pipeline.plan(table)
    chunk = plan.chunks[index]
    names = [c.name for c in table.columns]
    keys = list(table.key_columns)
    key_types = {f.name: f.dataType for f in spark_schema(list(table.columns)).fields if f.name in keys}
    paths = pipeline.lake.table(table.qualified_name)
    with pipeline.connect() as conn:
        lw_lsn = snapshot.take_insert_lsn(conn)
        low_watermark = snapshot.take_low_watermark(conn)
        source = pipeline.read_chunks(spark, conn, table, [chunk], f"check-{uuid.uuid4().hex[:8]}")
        source = source.select(*[q(n) for n in names], UNREPRESENTABLE_COLUMN).cache()
        source.count()  # the reads happen now, inside the window
        high_watermark = snapshot.take_high_watermark(conn)
        deadline = time.monotonic() + wait_seconds
        while stream.slot_position(conn, pipeline.source.slot)[0] < high_watermark:
            if time.monotonic() > deadline:
                source.unpersist()
                return ChunkCheck(table.qualified_name, index, conclusive=False, matches=False,
                                  reason="the stream has not applied the check's high watermark yet")  # fmt: skip
            time.sleep(1)
    try:
        if not DeltaTable.isDeltaTable(spark, paths.mirror):
            return ChunkCheck(table.qualified_name, index, conclusive=True, matches=False, reason="no mirror yet")
        # pin the mirror first: the changelog read afterwards holds every change the pinned mirror holds
        version = DeltaTable.forPath(spark, paths.mirror).history(1).first()["version"]
        mirror = spark.read.format("delta").option("versionAsOf", version).load(paths.mirror)
        mirror = mirror.where(_range_condition(chunk, keys, key_types))
        mirror = mirror.select(*[q(n) for n in names], UNREPRESENTABLE_COLUMN)
        touched = spark.createDataFrame([], ", ".join(f"{q(k)} {key_types[k].simpleString()}" for k in keys))
        if DeltaTable.isDeltaTable(spark, paths.changelog):
            lw = low_watermark
            log = spark.read.format("delta").load(paths.changelog).where(F.col("_cdc_position") > lw_lsn)
            log = log.where(_unsettled(F.lit(lw.xmin), F.lit(lw.xmax), F.array(*[F.lit(x) for x in sorted(lw.xip)])
                                       .cast("array<long>")))  # fmt: skip
            if log.where(F.col("_cdc_op") == "t").limit(1).count():
                return ChunkCheck(table.qualified_name, index, conclusive=False, matches=False,
                                  reason="a TRUNCATE ran during the check")  # fmt: skip
            exploded = log.select(
                F.explode(F.array(_key_struct("after", keys), _key_struct("before", keys))).alias("k")
            )
            touched = exploded.where(F.col("k").isNotNull()).select(*[F.col(f"k.{q(k)}").alias(k) for k in keys])
            touched = touched.where(" and ".join(f"{q(k)} is not null" for k in keys)).distinct()
        touched = touched.cache()
        excluded = touched.count()
        left = source.join(touched, keys, "left_anti").withColumn("_hash", _row_hash(names))
        right = mirror.join(touched, keys, "left_anti").withColumn("_hash", _row_hash(names))
        source_rows, source_sum = _summary(left)
        mirror_rows, mirror_sum = _summary(right)
        matches = source_rows == mirror_rows and source_sum == mirror_sum
        difference = None if matches else _first_difference(left, right, keys)
        touched.unpersist()
        return ChunkCheck(
            table.qualified_name, index, conclusive=True, matches=matches, source_rows=source_rows,
            mirror_rows=mirror_rows, source_checksum=source_sum, mirror_checksum=mirror_sum, excluded_keys=excluded,
            first_difference=difference,
        )  # fmt: skip
    finally:
        source.unpersist()


def _first_difference(source: DataFrame, mirror: DataFrame, keys: list[str]) -> str | None:
    s = source.select(*keys, F.col("_hash").alias("_s_hash"), F.to_json(F.struct(*source.columns[:-1])).alias("_s"))
    m = mirror.select(*keys, F.col("_hash").alias("_m_hash"), F.to_json(F.struct(*mirror.columns[:-1])).alias("_m"))
    joined = s.join(m, keys, "full_outer").where(~F.col("_s_hash").eqNullSafe(F.col("_m_hash")))
    row = joined.orderBy(*keys).first()
    if row is None:
        return None
    key = ", ".join(f"{k}={row[k]!r}" for k in keys)
    return f"key ({key}): source={row['_s'] or 'absent'} mirror={row['_m'] or 'absent'}"
