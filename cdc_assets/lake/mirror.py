"""Changelog append, change application (MERGE) and chunk reconciliation on one table's Delta tables.

Contract:
- Mirror schema: the source columns (``spark_schema``), ``_cdc_unrepresentable``, ``_cdc_op`` (``c``/``u`` from the
  stream, ``r`` from a snapshot), ``_cdc_position`` (commit end LSN of the last change applied to the row; a
  reconciled snapshot row carries its window's high watermark), ``_cdc_ts`` and ``_cdc_unknown`` (names of columns
  whose value the lake could not know, see below; NULL when none). Change Data Feed is on. A column dropped at the
  source stays: every write (change or reconciled snapshot row) assigns all the mirror's source columns
  (``mirror_source_fields``), so the dropped one is NULL in each row written after the drop.
- ``append_changelog``: appends a batch's changes, skipping those at or below the offset recorded in the changelog's
  last commit (``userMetadata``; a retried batch appends nothing twice: batches are contiguous in commit order, one
  table's append is one atomic Delta commit, and only stream batches write changelogs); a batch re-read smaller
  than one already appended (its offset at or below the last commit's) appends nothing and commits nothing.
- Column names Delta refuses by default (spaces, ``,;{}()=``, tab, newline) are kept as they are: a mirror or
  changelog that holds one is created with (or switched to) Delta column mapping by name
  (``cdc_assets.lake.column_mapping``); the commits that do so carry no offset and are not taken for one.
- ``apply_changes``: applies the net change per key, in commit order (``_cdc_position``, ``_cdc_seq``); a key change
  deletes the old key; a ``TRUNCATE`` deletes the rows older than it. Every write is guarded by
  ``_cdc_position``: a change is applied only to a row older than itself, so re-applying a batch is a no-op.
  An unchanged TOAST value takes the newest value of the same row: from an earlier change in the batch, else from
  the mirror (under the old key for a key change). When no copy exists (the row's earlier value is unknown in the
  batch after a key change), the column is NULL and named in ``_cdc_unknown``; never a placeholder.
- ``reconcile``: the DESIGN.md rule. For each closable window: drop staged keys that have any change (old or new
  key) in the changelog from a transaction not settled at the window's low watermark (a ``TRUNCATE`` by such a
  transaction drops the chunk); upsert the rest (guard: mirror row not newer than the high watermark); delete mirror
  rows inside the chunk's key range that the read did not see and that no unsettled transaction touched (repairs
  drift). Changes after the high watermark are unsettled too, so reconciling later than necessary stays exact.
  The changelog is narrowed to transaction ids from the low watermark's ``xmin`` on, never by WAL position: a
  transaction can be in ``xip`` while its commit record already precedes the low watermark (its commit waits for a
  WAL flush or a synchronous standby; the stream may even have applied it), and the read does not see it.
  A dropped key whose mirror row has ``_cdc_unknown`` columns (its unchanged TOAST values reached the stream before
  the mirror had the row) takes those columns from the staged row when no insert, delete or key change touched the
  key since the window opened: no change carried them, so they have not changed since the read.
  A chunk whose key range the mirror holds no row of is reconciled by an append of its kept rows (the MERGE would
  only insert there); a rerun after a crash finds the rows and MERGEs, which changes nothing.
  Before writing, it counts each window's staged rows: a window whose rows in staging differ from the count it
  recorded (they were deleted: by hand, or by the upkeep after a record came more than a day late) raises
  ``StagedRowsMismatch`` and writes nothing. Reconciling it would delete the chunk's mirror rows the read saw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.window import Window

from cdc_assets.engine.chunks import Chunk, chunk_partition_key
from cdc_assets.engine.lsn import parse_lsn
from cdc_assets.engine.pg_values import UNREPRESENTABLE_COLUMN, PgColumn, spark_schema
from cdc_assets.engine.windows import ChunkWindow
from cdc_assets.lake import staging
from cdc_assets.lake.column_mapping import MODE as MAPPING_MODE
from cdc_assets.lake.column_mapping import column_mapping_properties, enable_column_mapping, refused_names
from cdc_assets.lake.delta_tables import table_or_none
from cdc_assets.lake.retry import commit_with_retry

META_FIELDS = [
    T.StructField("_cdc_op", T.StringType()),
    T.StructField("_cdc_position", T.LongType()),
    T.StructField("_cdc_ts", T.TimestampType()),
    T.StructField("_cdc_unknown", T.ArrayType(T.StringType())),
]


def q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def ensure_mirror(
    spark: SparkSession, path: str, columns: Sequence[PgColumn], also: Sequence[T.StructField] = ()
) -> DeltaTable:
    """Create the mirror when missing (CDF and deletion vectors on); add source columns it lacks (an added column
    evolves the schema): those of ``columns`` and the source fields ``also`` (columns of rows about to be written
    that the caller's description of the table lacks: a snapshot read after the column was added). Deletion
    vectors: a batch's MERGE then marks replaced rows instead of rewriting every file it touches, and random changes
    touch every file of a big mirror (bench.stream, 1M rows, 83k changes per batch: MERGE 41.8 s over 3 batches
    with them, 57.7 s without; only tiny mirrors are faster without)."""
    source_fields = spark_schema(list(columns)).fields
    described = {f.name for f in source_fields}
    schema = T.StructType([*source_fields, *[f for f in also if f.name not in described], *META_FIELDS])

    def create() -> None:
        builder = (
            DeltaTable.createIfNotExists(spark)
            .location(path)
            .addColumns(schema)
            .property("delta.enableChangeDataFeed", "true")
            .property("delta.enableDeletionVectors", "true")
        )
        for name, value in column_mapping_properties(schema).items():  # column names Delta refuses by default
            builder = builder.property(name, value)
        builder.execute()

    if not DeltaTable.isDeltaTable(spark, path):
        commit_with_retry(create, f"create mirror {path}")
    table = DeltaTable.forPath(spark, path)
    existing = {f.name for f in table.toDF().schema.fields}
    missing = [f for f in schema.fields if f.name not in existing]
    if missing:
        enable_column_mapping(spark, path, T.StructType(missing))
        added = ", ".join(f"{q(f.name)} {f.dataType.simpleString()}" for f in missing)
        commit_with_retry(lambda: spark.sql(f"ALTER TABLE delta.{q(path)} ADD COLUMNS ({added})"), f"evolve {path}")
        table = DeltaTable.forPath(spark, path)
    return table


def mirror_source_fields(mirror: DeltaTable) -> list[T.StructField]:
    """The mirror's source columns in the mirror's order: every column the source has had, the dropped ones too.
    Every write assigns all of them, so a column missing from a change's or a read's row (dropped at the source)
    is NULL in every row written after the drop, however old the caller's description of the table is."""
    meta = {f.name for f in META_FIELDS} | {UNREPRESENTABLE_COLUMN}
    return [f for f in mirror.toDF().schema.fields if f.name not in meta]


# ------------------------------------------------------------------------------------------------------------
# Changelog


MAINTENANCE_OPERATIONS = ("OPTIMIZE", "VACUUM START", "VACUUM END")
# commits that write no change: an empty changelog created with column mapping, mapping turned on later
SCHEMA_OPERATIONS = ("CREATE TABLE", "SET TBLPROPERTIES")


def last_applied_lsn(spark: SparkSession, path: str) -> int | None:
    """The offset ``lsn`` in the ``userMetadata`` of the latest stream commit (every stream commit carries its
    batch's offset; maintenance commits, ``cdc_assets.lake.maintenance``, carry none and are skipped)."""
    if not DeltaTable.isDeltaTable(spark, path):
        return None
    table = DeltaTable.forPath(spark, path)
    for limit in (1, 32, None):
        history = table.history(limit) if limit else table.history()
        row = (
            history.where(~F.col("operation").isin(*MAINTENANCE_OPERATIONS, *SCHEMA_OPERATIONS))
            .orderBy(F.col("version").desc())
            .select("userMetadata")
            .first()
        )
        if row is not None:
            break
    if row is None or not row[0]:
        return None
    try:
        return parse_lsn(json.loads(row[0])["lsn"])
    except (ValueError, KeyError, TypeError):
        return None


def append_changelog(spark: SparkSession, path: str, changes: DataFrame, batch_lsn: int | None = None) -> None:
    """Append ``changes`` not yet in the changelog: those after the offset of the changelog's last commit. A batch
    whose offset ``batch_lsn`` is at or below that offset (a batch re-read smaller after a failure) skips the write:
    every change of it is there already. (Defensive: a commit with its lower offset would make its successor append
    the changes in between twice; the test of a smaller re-read passes without this check too, so Delta's append of
    no rows records no such commit here.)"""
    already = last_applied_lsn(spark, path)
    if already is not None and batch_lsn is not None and batch_lsn <= already:
        return
    if already is not None:
        changes = changes.where(F.col("_cdc_position") > already)
    if refused_names(changes.schema):  # column names Delta refuses by default: column mapping, created first
        if table_or_none(spark, path) is None:
            create = DeltaTable.createIfNotExists(spark).location(path).addColumns(changes.schema)
            commit_with_retry(lambda: create.property(MAPPING_MODE, "name").execute(), f"create changelog {path}")
        else:
            enable_column_mapping(spark, path, changes.schema)
    writer = changes.write.format("delta").mode("append").option("mergeSchema", "true")
    commit_with_retry(lambda: writer.save(path), f"changelog {path}")


# ------------------------------------------------------------------------------------------------------------
# Applying a batch


def _key_struct(image: str, key_columns: Sequence[str]) -> Column:
    return F.struct(*[F.col(f"{image}.{q(k)}").alias(k) for k in key_columns])


def apply_changes(
    spark: SparkSession,
    path: str,
    changes: DataFrame,
    columns: Sequence[PgColumn],
    key_columns: Sequence[str],
    unchanged_columns: set[str],
    truncate: tuple[int, int] | None = None,
) -> list[tuple]:
    """Apply one batch of one table's changes (changelog rows) to the mirror. ``truncate`` is the batch's last
    ``TRUNCATE`` of the table as (``_cdc_position``, ``_cdc_seq``), known to the driver from the batch."""
    mirror = ensure_mirror(spark, path, columns)
    mirror_types = {f.name: f.dataType for f in mirror_source_fields(mirror)}
    mirror_columns = list(mirror_types)
    after_fields = {f.name: f.dataType for f in changes.schema["after"].dataType.fields}
    order = [F.col("_cdc_position"), F.col("_cdc_seq")]

    rows = changes.where(F.col("_cdc_op") != "t")
    if truncate is not None:
        truncated_at, truncate_seq = truncate
        commit_with_retry(
            lambda: mirror.delete(F.col("_cdc_position") < F.lit(truncated_at)), f"truncate mirror {path}"
        )
        rows = rows.where(
            (F.col("_cdc_position") > truncated_at)
            | ((F.col("_cdc_position") == truncated_at) & (F.col("_cdc_seq") > truncate_seq))
        )

    new_key, old_key = _key_struct("after", key_columns), _key_struct("before", key_columns)
    key_change = (F.col("_cdc_op") == "u") & F.col("before").isNotNull() & ~new_key.eqNullSafe(old_key)
    base = rows.select(
        "_cdc_op", "_cdc_position", "_cdc_seq", "_cdc_ts", "_cdc_unchanged", "after",
        key_change.alias("_key_change"), new_key.alias("_new_key"), old_key.alias("_old_key"),
    )  # fmt: skip
    upserts = base.where(F.col("_cdc_op").isin("c", "u")).withColumn("_kind", F.lit("u"))
    upserts = upserts.withColumn("_key", F.col("_new_key"))
    deletes = base.where((F.col("_cdc_op") == "d") | F.col("_key_change")).withColumn("_kind", F.lit("d"))
    deletes = deletes.withColumn("_key", F.col("_old_key"))
    events = upserts.unionByName(deletes)

    resolve = sorted(c for c in unchanged_columns if c in after_fields)
    lineage = Window.partitionBy("_key").orderBy(*order).rowsBetween(Window.unboundedPreceding, -1)
    resolved: dict[str, Column] = {}  # one withColumns: a withColumn per column re-analyzes the growing plan
    for name in resolve:
        unchanged = F.array_contains(F.coalesce(F.col("_cdc_unchanged"), F.array().cast("array<string>")), name)
        value = F.col(f"after.{q(name)}")
        represented = F.col(f"after.{UNREPRESENTABLE_COLUMN}")[name]
        barrier = F.struct(F.lit(False).alias("known"), F.lit(None).cast(after_fields[name]).alias("v"),
                           F.lit(None).cast("string").alias("rep"))  # fmt: skip
        known = F.struct(F.lit(True).alias("known"), value.alias("v"), represented.alias("rep"))
        state = (
            F.when((F.col("_kind") == "d") | (F.col("_key_change") & unchanged), barrier)
            .when((F.col("_kind") == "u") & ~unchanged, known)
        )  # fmt: skip
        resolved[f"_prev_{name}"] = F.last(state, ignorenulls=True).over(lineage)
        resolved[f"_unch_{name}"] = unchanged
    if resolved:
        events = events.withColumns(resolved)

    if resolve:
        # a key change takes the value the row had under its old key, seen on the old key's delete event
        carried = events.where((F.col("_kind") == "d") & F.col("_key_change")).select(
            "_cdc_position", "_cdc_seq", *[F.col(f"_prev_{n}").alias(f"_carry_{n}") for n in resolve]
        )
        events = events.join(carried, ["_cdc_position", "_cdc_seq"], "left")

    latest = Window.partitionBy("_key").orderBy(*[c.desc() for c in order])
    net = events.withColumn("_rank", F.row_number().over(latest)).where(F.col("_rank") == 1).drop("_rank")

    values: dict[str, Column] = {}
    from_mirror: list[tuple[str, Column]] = []
    unknown: list[Column] = []
    extra_representations: list[Column] = []
    for name in mirror_columns:
        if name not in after_fields:
            values[name] = F.lit(None).cast(mirror_types[name])
            continue
        value = F.col(f"after.{q(name)}")
        if name not in resolve:
            values[name] = value
            continue
        prev = F.when(F.col("_key_change"), F.col(f"_carry_{name}")).otherwise(F.col(f"_prev_{name}"))
        unchanged = F.col(f"_unch_{name}")
        values[name] = F.when(~unchanged, value).when(prev["known"], prev["v"])
        extra_representations += [F.lit(name), F.when(unchanged & prev["known"], prev["rep"])]
        from_mirror.append((name, unchanged & prev.isNull()))
        unknown.append(F.when(unchanged & prev.isNotNull() & ~prev["known"], F.lit(name)))
    representation = F.coalesce(F.col(f"after.{UNREPRESENTABLE_COLUMN}"), F.create_map().cast("map<string,string>"))
    if extra_representations:
        representation = F.map_concat(
            representation, F.map_filter(F.create_map(*extra_representations), lambda k, v: v.isNotNull())
        )
    source = net.select(
        *[F.col(f"_key.{q(k)}").alias(f"_k_{k}") for k in key_columns],
        F.col("_old_key"),
        F.col("_key_change"),
        F.col("_kind"),
        *[v.alias(n) for n, v in values.items()],
        representation.alias("_rep"),
        *[flag.alias(f"_mirror_{n}") for n, flag in from_mirror],
        F.array_compact(F.array(*unknown) if unknown else F.array().cast("array<string>")).alias("_unknown"),
        F.col("_cdc_op"),
        F.col("_cdc_position"),
        F.col("_cdc_ts"),
    )
    if from_mirror:
        source = _fill_from_mirror(spark, path, source, key_columns, [n for n, _ in from_mirror])
    source = source.withColumn(
        UNREPRESENTABLE_COLUMN, F.when(F.size("_rep") > 0, F.col("_rep")).otherwise(F.lit(None))
    ).withColumn("_cdc_unknown", F.when(F.size("_unknown") > 0, F.col("_unknown")))

    merge_net_changes(mirror, source, mirror_columns, key_columns, path)
    if not resolve:
        return []
    unknown_rows = spark.read.format("delta").load(path).where(F.col("_cdc_unknown").isNotNull())
    return [tuple(r) for r in unknown_rows.select(*[q(k) for k in key_columns]).collect()]


def merge_net_changes(
    mirror: DeltaTable, net: DataFrame, mirror_columns: Sequence[str], key_columns: Sequence[str], path: str
) -> None:
    """The MERGE of one batch's net changes into the mirror: one row per key, ``_k_<key>`` columns holding the key,
    ``_kind`` ``'u'`` (upsert) or ``'d'`` (delete), every mirror column by name. A row is written only over an older
    one (``_cdc_position``), so re-applying a batch changes nothing. ``bench.stream`` times this statement alone on
    the same batches, as the floor of what Delta does for a batch."""
    match = " and ".join(f"t.{q(k)} = s.{q('_k_' + k)}" for k in key_columns)
    assignments = {q(n): F.col(f"s.{q(n)}") for n in [*mirror_columns, UNREPRESENTABLE_COLUMN]}
    assignments |= {q(m): F.col(f"s.{m}") for m in ("_cdc_op", "_cdc_position", "_cdc_ts", "_cdc_unknown")}
    inserts = {**assignments, **{q(k): F.col(f"s.{q('_k_' + k)}") for k in key_columns}}
    commit_with_retry(
        lambda: mirror.alias("t")
        .merge(net.alias("s"), match)
        .whenMatchedDelete(condition="s._kind = 'd' and t._cdc_position < s._cdc_position")
        .whenMatchedUpdate(condition="s._kind = 'u' and t._cdc_position < s._cdc_position", set=assignments)
        .whenNotMatchedInsert(condition="s._kind = 'u'", values=inserts)
        .execute(),
        f"merge into {path}",
    )


def fill_assignments(names: Sequence[str]) -> dict[str, Column]:
    """MERGE ``set`` that replaces only the target's ``_cdc_unknown`` columns with the source row's values. Unknown
    columns the source row lacks (``names`` does not list them) stay unknown: never a NULL placeholder."""
    unknown = F.col("t._cdc_unknown")
    fills = {
        q(n): F.when(F.array_contains(unknown, n), F.col(f"s.{q(n)}")).otherwise(F.col(f"t.{q(n)}")) for n in names
    }
    empty = F.create_map().cast("map<string,string>")
    merged_map = F.map_concat(
        F.map_filter(
            F.coalesce(F.col(f"t.{UNREPRESENTABLE_COLUMN}"), empty), lambda k, v: ~F.array_contains(unknown, k)
        ),
        F.map_filter(
            F.coalesce(F.col(f"s.{UNREPRESENTABLE_COLUMN}"), empty), lambda k, v: F.array_contains(unknown, k)
        ),
    )
    fills[q(UNREPRESENTABLE_COLUMN)] = F.when(F.size(merged_map) > 0, merged_map)
    remaining = F.array_except(unknown, F.array(*[F.lit(n) for n in names]))
    fills[q("_cdc_unknown")] = F.when(F.size(remaining) > 0, remaining)
    return fills


def fill_unknown(spark: SparkSession, path: str, current: DataFrame, key_columns: Sequence[str]) -> None:
    """Fill the mirror's unknown (unchanged TOAST) values from ``current``: the source's rows of those keys, read
    after the changes were applied. A value read now is the value the row had at its last applied change, or a
    newer one whose change the stream applies later (with the value itself); a key gone at the source stays
    unknown until the stream deletes it."""
    names = [f.name for f in current.schema.fields if f.name != UNREPRESENTABLE_COLUMN]
    match = " and ".join(f"t.{q(k)} = s.{q(k)}" for k in key_columns)
    mirror = DeltaTable.forPath(spark, path)
    commit_with_retry(
        lambda: mirror.alias("t")
        .merge(current.alias("s"), match)
        .whenMatchedUpdate(condition="t._cdc_unknown is not null", set=fill_assignments(names))
        .execute(),
        f"fill unknown values in {path}",
    )


def _fill_from_mirror(
    spark: SparkSession, path: str, source: DataFrame, key_columns: Sequence[str], names: list[str]
) -> DataFrame:
    """Unchanged TOAST values with no copy in the batch: the mirror's value (old key for a key change)."""
    needs = F.lit(False)
    for name in names:
        needs = needs | F.col(f"_mirror_{name}")
    mirror = spark.read.format("delta").load(path)
    looked_up = mirror.select(
        *[F.col(q(k)).alias(f"_m_{k}") for k in key_columns],
        *[F.col(q(n)).alias(f"_mv_{n}") for n in names],
        *[F.col(UNREPRESENTABLE_COLUMN)[n].alias(f"_mr_{n}") for n in names],
        F.coalesce(F.col("_cdc_unknown"), F.array().cast("array<string>")).alias("_m_unknown"),
    )
    lookup_key = [
        F.when(F.col("_key_change"), F.col(f"_old_key.{q(k)}")).otherwise(F.col(f"_k_{k}")).alias(f"_l_{k}")
        for k in key_columns
    ]
    wanted = source.where(needs).select("*", *lookup_key)
    condition = [wanted[f"_l_{k}"] == looked_up[f"_m_{k}"] for k in key_columns]
    found = wanted.join(looked_up, condition, "left")
    filled: dict[str, Column] = {}  # one withColumns (see apply_changes)
    unknown, representation = F.col("_unknown"), F.col("_rep")
    for name in names:
        flag = F.col(f"_mirror_{name}")
        filled[name] = F.when(flag, F.col(f"_mv_{name}")).otherwise(F.col(name))
        # no mirror row, or the mirror does not know the value either: still unknown
        missing = flag & (F.col(f"_m_{key_columns[0]}").isNull() | F.array_contains("_m_unknown", name))
        unknown = F.when(missing, F.array_append(unknown, F.lit(name))).otherwise(unknown)
        carried = F.when(flag & F.col(f"_mr_{name}").isNotNull(), F.create_map(F.lit(name), F.col(f"_mr_{name}")))
        representation = F.map_concat(representation, F.coalesce(carried, F.create_map().cast("map<string,string>")))
    found = found.withColumns({**filled, "_unknown": unknown, "_rep": representation}).select(*source.columns)
    return source.where(~needs).unionByName(found)


# ------------------------------------------------------------------------------------------------------------
# Reconciliation


STAGING_ONLY_COLUMNS = frozenset({"_cdc_chunk", "_cdc_attempt", UNREPRESENTABLE_COLUMN})


class StagedRowsMismatch(RuntimeError):
    """A window's staged rows are not what it recorded; reconciling it would lose mirror rows."""


@dataclass(frozen=True)
class ReconcileResult:
    table: str
    chunk: int
    kept: int
    dropped: int
    deleted: int


def _range_condition(
    chunk: Chunk, key_columns: Sequence[str], key_types: dict[str, T.DataType], alias: str | None = None
) -> Column:
    """Spark condition for ``lo <= key < hi`` over the key columns (of table ``alias`` when given), compared
    lexicographically."""

    def compare(values: tuple[str, ...], at_least: bool) -> Column:
        result: Column | None = None
        for i in reversed(range(len(key_columns))):
            column = F.col(q(key_columns[i]) if alias is None else f"{alias}.{q(key_columns[i])}")
            literal = F.lit(values[i]).cast(key_types[key_columns[i]])
            if result is None:  # last key column: >= lo / < hi
                result = column >= literal if at_least else column < literal
            else:
                strict = column > literal if at_least else column < literal
                result = strict | ((column == literal) & result)
        assert result is not None
        return result

    condition = F.lit(True)
    if chunk.lo is not None:
        condition = condition & compare(chunk.lo, at_least=True)
    if chunk.hi is not None:
        condition = condition & compare(chunk.hi, at_least=False)
    return condition


def _unsettled(lw_xmin: Column, lw_xmax: Column, lw_xip: Column) -> Column:
    xid = F.col("_cdc_xid")
    settled = (xid < lw_xmin) | ((xid < lw_xmax) & ~F.array_contains(lw_xip, xid))
    return ~settled


def check_staged_rows(staging_path: str, windows: Sequence[ChunkWindow]) -> None:
    counts = staging.staged_row_counts(staging_path, (w.attempt for w in windows))
    for w in windows:
        found = counts.get((w.attempt, w.chunk), 0)
        if found != w.rows:
            raise StagedRowsMismatch(
                f"table {w.table}: chunk {w.chunk}: attempt {w.attempt} recorded {w.rows} staged rows but staging "
                f"holds {found}: its staged rows were deleted; nothing was written. Re-materialize partition "
                f"{chunk_partition_key(w.chunk)} of the table's asset: the new attempt supersedes this one"
            )


def reconcile(
    spark: SparkSession,
    mirror_path: str,
    changelog_path: str,
    staging_path: str,
    columns: Sequence[PgColumn],
    key_columns: Sequence[str],
    windows: Sequence[ChunkWindow],
    chunks: dict[int, Chunk],
) -> list[ReconcileResult]:
    """Reconcile the closable ``windows`` of one table (see module docstring)."""
    if not windows:
        return []
    check_staged_rows(staging_path, windows)
    staged_frame = staging.read_staged(spark, staging_path, (w.attempt for w in windows), list(columns))
    # a column the read had but the caller's description lacks (added since the stream run described the table)
    staged_source_fields = [f for f in staged_frame.schema.fields if f.name not in STAGING_ONLY_COLUMNS]
    mirror = ensure_mirror(spark, mirror_path, columns, also=staged_source_fields)
    all_types = {f.name: f.dataType for f in mirror_source_fields(mirror)}
    names = list(all_types)
    key_types = {k: all_types[k] for k in key_columns}
    window_rows = [
        (w.attempt, w.chunk, w.low_watermark.xmin, w.low_watermark.xmax, sorted(w.low_watermark.xip), w.hw, w.at)
        for w in windows
    ]  # fmt: skip
    window_frame = F.broadcast(
        spark.createDataFrame(
            window_rows,
            "_w_attempt string, _w_chunk int, _w_xmin long, _w_xmax long, _w_xip array<long>, _w_hw long, "
            "_w_at timestamp",
        )
    )
    lowest_xmin = min(w.low_watermark.xmin for w in windows)

    # keys (old and new) changed by transactions not settled at each window's low watermark
    key_fields = ", ".join(f"{q('_t_' + k)} {key_types[k].simpleString()}" for k in key_columns)
    truncated: set[str] = set()
    touched_keys = spark.createDataFrame([], f"_w_attempt string, {key_fields}")
    unstable_keys = touched_keys
    touched: DataFrame | None = None
    if DeltaTable.isDeltaTable(spark, changelog_path):
        # narrowed by transaction id, never by WAL position: a transaction unsettled at the low watermark may have
        # written its commit record before it (the commit waits for a flush or a synchronous standby)
        recent = spark.read.format("delta").load(changelog_path).where(F.col("_cdc_xid") >= lowest_xmin)
        recent = recent.join(window_frame, F.col("_cdc_xid") >= F.col("_w_xmin"))
        log = recent.where(_unsettled(F.col("_w_xmin"), F.col("_w_xmax"), F.col("_w_xip")))
        keys = F.array(_key_struct("after", key_columns), _key_struct("before", key_columns))
        # keys whose row may have been replaced since the window opened (insert, delete, key change; by any
        # transaction from the low watermark's xmin on: a superset of the unsettled ones)
        new_key, old_key = _key_struct("after", key_columns), _key_struct("before", key_columns)
        replaced = F.col("_cdc_op").isin("c", "d") | (
            (F.col("_cdc_op") == "u") & F.col("before").isNotNull() & ~new_key.eqNullSafe(old_key)
        )
        unstable_keys = (
            recent.where(replaced)
            .select("_w_attempt", F.explode(keys).alias("_key"))
            .where(F.col("_key").isNotNull())
            .select("_w_attempt", *[F.col(f"_key.{q(k)}").alias(f"_t_{k}") for k in key_columns])
            .distinct()
        )
        touched = log.select(
            "_w_attempt", (F.col("_cdc_op") == "t").alias("_truncate"), F.explode(keys).alias("_key")
        ).cache()
        truncated = {r["_w_attempt"] for r in touched.where("_truncate").select("_w_attempt").distinct().collect()}
        not_null = " and ".join(f"_key.{q(k)} is not null" for k in key_columns)
        touched_keys = (
            touched.where(~F.col("_truncate"))
            .where(not_null)
            .select("_w_attempt", *[F.col(f"_key.{q(k)}").alias(f"_t_{k}") for k in key_columns])
            .distinct()
        )

    # ``read_staged`` read only these windows' attempts; the join pairs each row with its own window
    staged = staged_frame.join(
        window_frame, (F.col("_cdc_attempt") == F.col("_w_attempt")) & (F.col("_cdc_chunk") == F.col("_w_chunk"))
    )
    staged_keys = staged.select("_w_attempt", *[F.col(q(k)).alias(f"_t_{k}") for k in key_columns])
    staged = staged.where(~F.col("_w_attempt").isin(list(truncated)) if truncated else F.lit(True))
    key_match = ["_w_attempt", *[f"_t_{k}" for k in key_columns]]
    staged_aliased = staged.select("*", *[F.col(q(k)).alias(f"_t_{k}") for k in key_columns])
    staged_names = set(staged_aliased.columns)

    def staged_rows(frame: DataFrame, kind: str) -> DataFrame:
        """Staged rows as MERGE source rows of ``kind``, positioned at their window's high watermark."""
        return frame.select(
            F.lit(kind).alias("_kind"),
            "_w_attempt",
            "_w_chunk",
            *[F.col(q(n)) if n in staged_names else F.lit(None).cast(all_types[n]).alias(n) for n in names],
            F.col(UNREPRESENTABLE_COLUMN),
            F.lit("r").alias("_cdc_op"),
            F.col("_w_hw").alias("_cdc_position"),
            F.col("_w_at").alias("_cdc_ts"),
        )

    # no transaction unsettled at any window's low watermark changed anything since (a quiet source, or the first
    # snapshot before the stream has run): every staged row is kept, none fills, none is truncated, and the plans
    # below need no join of the staged rows with the touched keys
    any_touched = touched is not None and not touched.isEmpty()
    if any_touched:
        kept = staged_rows(staged_aliased.join(touched_keys, key_match, "left_anti"), "u")
        # a touched key whose mirror row has unknown (unchanged TOAST) values and whose row was never replaced
        # since the window opened: those columns did not change since the read (a change would have carried
        # them), so the staged value is the value
        stable = staged_aliased.join(touched_keys, key_match, "left_semi").join(unstable_keys, key_match, "left_anti")
        fill = staged_rows(stable, "f")
    else:
        kept = staged_rows(staged_aliased, "u")

    # mirror rows inside a chunk's range that the read did not see and no unsettled transaction touched
    in_range = F.lit(None).cast("int")
    any_range = F.lit(False)
    for w in reversed(windows):
        if w.attempt in truncated:
            continue
        condition = _range_condition(chunks[w.chunk], key_columns, key_types)
        in_range = F.when(condition, F.lit(w.chunk)).otherwise(in_range)
        any_range = any_range | condition
    # the same ranges over the MERGE target: Delta prunes the mirror's files by their key statistics, so a chunk's
    # reconciliation reads the files that can hold its range instead of the whole mirror
    target_in_ranges = F.lit(False)
    for w in windows:
        if w.attempt not in truncated:
            target_in_ranges = target_in_ranges | _range_condition(chunks[w.chunk], key_columns, key_types, "t")
    existing = mirror.toDF().where(any_range)
    existing = existing.select(*[F.col(q(k)) for k in key_columns], in_range.alias("_w_chunk"))
    existing = existing.where(F.col("_w_chunk").isNotNull()).join(window_frame, "_w_chunk")
    existing = existing.select("_w_attempt", "_w_chunk", "_w_hw", *[F.col(q(k)).alias(f"_t_{k}") for k in key_columns])
    vanished = existing.join(staged_keys, key_match, "left_anti")
    if any_touched:
        vanished = vanished.join(touched_keys, key_match, "left_anti")
    vanished = vanished.select(
        F.lit("d").alias("_kind"),
        "_w_attempt",
        "_w_chunk",
        *[F.col(f"_t_{k}").alias(k) if k in key_columns else F.lit(None).cast(all_types[k]).alias(k) for k in names],
        F.lit(None).cast("map<string,string>").alias(UNREPRESENTABLE_COLUMN),
        F.lit("d").alias("_cdc_op"),
        F.col("_w_hw").alias("_cdc_position"),
        F.lit(None).cast("timestamp").alias("_cdc_ts"),
    )
    # not cached: the counts below read only the key columns (Spark prunes the rest), and the writes read the rows
    # once; every input is fixed (staged attempts are immutable, ``touched`` is cached, only this run writes the
    # mirror and the appended chunks are excluded from the MERGE), so both see the same rows. Caching all the rows
    # cost more than the reconciliation's writes (1M rows: 15 s of 21 s).
    source = kept.unionByName(vanished, allowMissingColumns=True)
    if any_touched:
        source = source.unionByName(fill, allowMissingColumns=True)
    try:
        # a chunk whose range the mirror holds no row of (the usual first snapshot) is an append: nothing to match,
        # update or delete there, so its kept rows are inserted without a join (a MERGE would give the same rows)
        occupied = {r["_w_chunk"] for r in existing.select("_w_chunk").distinct().collect()}
        if any_touched:
            counts = {
                (r["_w_chunk"], r["_kind"]): r["count"] for r in source.groupBy("_w_chunk", "_kind").count().collect()
            }
        else:
            # every staged row is kept: the counts are the recorded ones (``check_staged_rows`` compared them with
            # the files), so only the vanished rows, which exist only where the mirror holds rows, are counted
            counts = {}
            for w in windows:
                if w.rows:
                    counts[(w.chunk, "u")] = counts.get((w.chunk, "u"), 0) + w.rows
            if occupied:
                counts |= {(r["_w_chunk"], "d"): r["count"] for r in vanished.groupBy("_w_chunk").count().collect()}
        empty = sorted({w.chunk for w in windows if w.attempt not in truncated} - occupied)
        if empty and any(counts.get((c, "u"), 0) for c in empty):
            mirror_fields = mirror.toDF().schema.fields
            appended = source.where(F.col("_w_chunk").isin(empty) & (F.col("_kind") == "u"))
            appended = appended.withColumn("_cdc_unknown", F.lit(None)).select(
                *[F.col(q(f.name)).cast(f.dataType).alias(f.name) for f in mirror_fields]
            )
            commit_with_retry(
                lambda: appended.write.format("delta").mode("append").save(mirror_path),
                f"reconcile (append) into {mirror_path}",
            )
        merged = source.where(~F.col("_w_chunk").isin(empty)) if empty else source
        if any(chunk not in empty for chunk, _ in counts):
            match = F.lit(True)
            for k in key_columns:
                match = match & (F.col(f"t.{q(k)}") == F.col(f"s.{q(k)}"))
            match = match & target_in_ranges
            assignments = {q(n): F.col(f"s.{q(n)}") for n in [*names, UNREPRESENTABLE_COLUMN]}
            assignments |= {q(m): F.col(f"s.{m}") for m in ("_cdc_op", "_cdc_position", "_cdc_ts")}
            assignments[q("_cdc_unknown")] = F.lit(None)
            fills = fill_assignments(names)
            commit_with_retry(
                lambda: mirror.alias("t")
                .merge(merged.alias("s"), match)
                .whenMatchedDelete(condition="s._kind = 'd' and t._cdc_position <= s._cdc_position")
                .whenMatchedUpdate(condition="s._kind = 'u' and t._cdc_position <= s._cdc_position", set=assignments)
                .whenMatchedUpdate(condition="s._kind = 'f' and t._cdc_unknown is not null", set=fills)
                .whenNotMatchedInsert(condition="s._kind = 'u'", values=assignments)
                .execute(),
                f"reconcile into {mirror_path}",
            )
    finally:
        if touched is not None:
            touched.unpersist()
    results = []
    for w in windows:
        kept_rows = counts.get((w.chunk, "u"), 0)
        results.append(ReconcileResult(w.table, w.chunk, kept_rows, w.rows - kept_rows, counts.get((w.chunk, "d"), 0)))
    return results
