"""Per-chunk consistency check, written once: does the mirror hold exactly the source's rows of some chunks?

Contract: ``check_chunks(spark, lake, dialect, table, chunks, wait_seconds)`` runs a watermark window like a
snapshot, with the source half from the dialect (``CheckSession``, ``cdc_assets.dialect``):
1. In one session: the low watermark (its text); the table as the source describes it after it (every column added
   before the low watermark is compared; a column no write has brought to the mirror yet counts as NULL there, so an
   added column's ``DEFAULT``, which no change carries, is reported); each chunk's row count and digest sum, read in
   one consistent view of the source that the session keeps open for step 4; the high watermark.
2. Wait until the stream has applied everything up to the high watermark: the acknowledged position
   (``SourceLake.acknowledged``) passed it and no snapshot window of a checked chunk closing at or below it is still
   open in the window log; or ``wait_seconds`` expire: then every result is inconclusive with the reason, never a
   false alarm. Meanwhile a marker (``SourceLake.mark_check_waiting``) makes ``pending_work`` ask for a batch, so a
   source nobody writes to is checked too.
3. The mirror and then the changelog are pinned at their current versions (the mirror first: the changelog then
   holds every change the pinned mirror holds), so every evaluation sees the same rows while the stream goes on.
4. Per chunk: the keys that changes not settled at the low watermark touched (old and new key; the source's
   ``SettledRule``, the same rule as reconciliation, so concurrent writes cause no false alarm) and the keys whose
   mirror row holds unknown values (its fill window is pending) are left out on both sides (the source side
   subtracts those keys' count and digests in the same consistent view); the rest is compared by count and digest
   sum (the mirror side computed on Spark by the dialect's ``mirror_row_digest``, alike with the source's). A
   truncate among the unsettled changes makes the chunk inconclusive. On a mismatch the first differing key (in
   key-text order) is named with both rows' column texts.
Nothing is written to the source or to a Delta table (only the marker file). Only counts, sums and the left-out keys
cross the wire.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.dialect import CheckSession, SourceDialect
from cdc_assets.engine.chunks import Chunk
from cdc_assets.engine.windows import open_windows
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.layout import SourceLake, TablePaths
from cdc_assets.lake.mirror import _key_struct, _range_condition, q
from cdc_assets.lake.schema import UNREPRESENTABLE_COLUMN
from cdc_assets.lake.settled import SettledRule
from cdc_assets.source import ChunkCheck, TableT

SHOWN_TEXT_CHARS = 200


def check_chunks(
    spark: SparkSession, lake: SourceLake, dialect: SourceDialect[TableT], table: TableT, chunks: Sequence[Chunk],
    wait_seconds: float = 120,
) -> list[ChunkCheck]:  # fmt: skip
    """Check ``chunks`` of ``table`` (from its stored plan) in one watermark window (one wait for the stream); one
    result per chunk (see module docstring)."""
    indexes = [c.index for c in chunks]
    paths = lake.table(table.qualified_name)
    with dialect.check_session() as session:
        low_watermark = session.low_watermark()
        table = session.current_table(table)
        sources = session.summaries(table, chunks)
        high_watermark = session.high_watermark()
        deadline = time.monotonic() + wait_seconds
        token = uuid.uuid4().hex  # asks for the batch that passes the high watermark
        lake.mark_check_waiting(token, high_watermark)
        try:
            while True:
                acknowledged = lake.acknowledged()
                if acknowledged is None or acknowledged < high_watermark:
                    reason = "the stream has not applied the check's high watermark yet"
                elif unreconciled := _unreconciled_windows(spark, lake, table.qualified_name, indexes, high_watermark):
                    reason = f"the snapshot windows of chunks {unreconciled} are not reconciled yet"
                else:
                    break
                if time.monotonic() > deadline:
                    return [_inconclusive(table.qualified_name, i, reason) for i in indexes]
                time.sleep(1)
        finally:
            lake.clear_check_waiting(token)
        checked = list(zip(indexes, chunks, sources, strict=True))
        fields = dialect.spark_fields(table)
        return _compare(spark, session, dialect.settled_rule, table, fields, paths, low_watermark, checked)


def _unreconciled_windows(
    spark: SparkSession, lake: SourceLake, name: str, indexes: Sequence[int], high_watermark: int
) -> list[int]:
    """Checked chunks whose staged snapshot window closes at or below the check's high watermark but is not
    reconciled yet. The stream having passed the high watermark does not say it reconciled them: on a source nobody
    writes to, the position does not move, so a batch that read the window log before the window was recorded can
    end at the very position the check takes as its high watermark."""
    wanted = set(indexes)
    return sorted(
        w.chunk for w in open_windows(window_log.read_events(spark, lake.windows))
        if w.table == name and w.chunk in wanted and w.hw <= high_watermark
    )  # fmt: skip


def _inconclusive(name: str, index: int, reason: str) -> ChunkCheck:
    return ChunkCheck(name, index, conclusive=False, matches=False, reason=reason)


def _window_columns(rule: SettledRule, low_watermark: str) -> list[Column]:
    """The low watermark as the rule's window columns (literals), so its conditions apply to a changelog row."""
    columns = []
    for field, value in zip(rule.window_fields, rule.window_values(low_watermark), strict=True):
        if isinstance(field.dataType, T.ArrayType):
            literal = F.array(*[F.lit(v) for v in value]).cast(field.dataType)  # type: ignore[union-attr]
        else:
            literal = F.lit(value).cast(field.dataType)
        columns.append(literal.alias(field.name))
    return columns


def _touched_keys(
    spark: SparkSession, paths: TablePaths, rule: SettledRule, low_watermark: str, keys: list[str],
    key_types: dict[str, T.DataType],
) -> DataFrame | None:  # fmt: skip
    """Keys (old and new) that changes not settled at the low watermark touched, or ``None`` when one of them was a
    truncate. The changelog is read as of its version now (pinned: the stream appends while the check runs, and a
    Delta frame, even a cached one, would see those appends on its next evaluation, so the source and the mirror
    side would leave out different keys)."""
    touched = spark.createDataFrame([], ", ".join(f"{q(k)} {key_types[k].simpleString()}" for k in keys))
    if not DeltaTable.isDeltaTable(spark, paths.changelog):
        return touched
    version = DeltaTable.forPath(spark, paths.changelog).history(1).first()["version"]
    log = spark.read.format("delta").option("versionAsOf", version).load(paths.changelog)
    log = log.where(rule.since([low_watermark])).select("*", *_window_columns(rule, low_watermark))
    log = log.where(rule.unsettled())
    if log.where(F.col("_cdc_op") == "t").limit(1).count():
        return None
    exploded = log.select(F.explode(F.array(_key_struct("after", keys), _key_struct("before", keys))).alias("k"))
    touched = exploded.where(F.col("k").isNotNull()).select(*[F.col(f"k.{q(k)}").alias(k) for k in keys])
    return touched.where(" and ".join(f"{q(k)} is not null" for k in keys)).distinct()


def _summary(frame: DataFrame) -> tuple[int, int]:
    row = frame.agg(F.count(F.lit(1)).alias("n"), F.sum(F.col("_digest").cast("decimal(38,0)")).alias("h")).first()
    return int(row["n"]), int(row["h"] or 0)


def _compare(
    spark: SparkSession, session: CheckSession[TableT], rule: SettledRule, table: TableT,
    fields: Sequence[T.StructField], paths: TablePaths, low_watermark: str,
    chunks: list[tuple[int, Chunk, tuple[int, int]]],
) -> list[ChunkCheck]:  # fmt: skip
    name = table.qualified_name
    keys = list(table.key_columns)
    types = {f.name: f.dataType for f in fields if f.name != UNREPRESENTABLE_COLUMN}
    key_types = {k: types[k] for k in keys}
    if not DeltaTable.isDeltaTable(spark, paths.mirror):
        return [ChunkCheck(name, i, conclusive=True, matches=False, reason="no mirror yet") for i, _, _ in chunks]
    # pin the mirror first: the changelog read afterwards holds every change the pinned mirror holds
    version = DeltaTable.forPath(spark, paths.mirror).history(1).first()["version"]
    whole_mirror = spark.read.format("delta").option("versionAsOf", version).load(paths.mirror)
    # a row whose values are unknown waits for its fill window (``cdc_assets.lake.mirror``): left out on both sides
    pending_fill = whole_mirror.where(F.col("_cdc_unknown").isNotNull()).select(*[q(k) for k in keys])
    present = set(whole_mirror.columns)
    whole_mirror = whole_mirror.select(
        *[q(n) if n in present else F.lit(None).cast(t).alias(n) for n, t in types.items()], UNREPRESENTABLE_COLUMN
    )
    all_touched = _touched_keys(spark, paths, rule, low_watermark, keys, key_types)
    if all_touched is None:
        return [_inconclusive(name, i, "a truncate ran during the check") for i, _, _ in chunks]
    all_touched = all_touched.unionByName(pending_fill).distinct().cache()
    results = []
    try:
        for index, chunk, (source_rows, source_sum) in chunks:
            in_range = _range_condition(chunk, keys, key_types)
            touched = all_touched.where(in_range)
            touched_texts = [r[0] for r in touched.select(session.mirror_key_text(table, False)).collect()]
            if touched_texts:
                left_out_rows, left_out_sum = session.summary_of_keys(table, chunk, touched_texts)
                source_rows, source_sum = source_rows - left_out_rows, source_sum - left_out_sum
            kept = whole_mirror.where(in_range).join(touched, keys, "left_anti")
            kept = kept.withColumn("_digest", session.mirror_row_digest(table)).withColumn(
                "_key_text", session.mirror_key_text(table, True)
            )
            mirror_rows, mirror_sum = _summary(kept)
            matches = source_rows == mirror_rows and source_sum == mirror_sum
            difference = None if matches else _first_difference(spark, session, table, chunk, kept, set(touched_texts))
            results.append(ChunkCheck(
                name, index, conclusive=True, matches=matches, source_rows=source_rows, mirror_rows=mirror_rows,
                source_checksum=str(source_sum), mirror_checksum=str(mirror_sum), excluded_keys=len(touched_texts),
                first_difference=difference,
            ))  # fmt: skip
    finally:
        all_touched.unpersist()
    return results


def _first_difference(
    spark: SparkSession, session: CheckSession[TableT], table: TableT, chunk: Chunk, kept: DataFrame,
    excluded: set[str],
) -> str | None:  # fmt: skip
    """The first key (in key-text order) whose source and mirror digests differ, with both rows' column texts. The
    source side is read in the check's consistent view, the one its checksum was computed on."""
    pairs = [(k, d) for k, d in session.key_digests(table, chunk) if k not in excluded]
    source = spark.createDataFrame(pairs, "_key_text string, _s_digest long")
    mirror = kept.select("_key_text", F.col("_digest").alias("_m_digest"))
    joined = source.join(mirror, "_key_text", "full_outer").where(~F.col("_s_digest").eqNullSafe(F.col("_m_digest")))
    row = joined.orderBy("_key_text").first()
    if row is None:
        return None
    source_texts = session.row_texts(table, chunk, row["_key_text"])
    texts = session.mirror_column_texts(table)
    mirrored = kept.where(F.col("_key_text") == row["_key_text"]).select(*texts).first()
    mirror_texts = None if mirrored is None else mirrored.asDict()
    either = source_texts or mirror_texts or {}
    key = ", ".join(f"{k}={either.get(k)}" for k in table.key_columns)
    names = list(source_texts or mirror_texts or {})
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
