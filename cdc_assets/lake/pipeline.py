"""``PostgresPipeline``: the ``CdcSource`` (``cdc_assets.source``) of a PostgreSQL database.

Contract (Dagster calls these from assets and sensors; tests call them directly):
- ``prepare()`` checks the role (``REPLICATION``), resolves the captured tables, makes sure the publication covers
  them and the slot exists (created only when missing and allowed; otherwise ``SourceError`` with the statement an
  administrator can run). The slot exists before any snapshot window opens, so no change is ever missed.
- ``plan(table)`` returns the stored chunk plan, planning and storing it on first use (immutable afterwards).
- ``snapshot(spark, table, chunk_indexes, run_id)`` runs one watermark window (DESIGN.md) around reading the
  chunks: low watermark, parallel sub-range reads in Spark tasks (psycopg ``COPY`` into Arrow inside each task,
  ``mapInArrow``; each task writes its rows as a staged Parquet file of a fresh attempt id,
  ``cdc_assets.lake.staging``), high watermark after the Spark job finished, then the window is recorded as
  ``staged`` with the row counts the tasks returned. A run killed before that record leaves rows no one reads.
- ``stream_batch(spark, recorded_lsn, run_id)`` reads one bounded batch from the slot (after first moving the slot
  up to an offset that was recorded but not yet applied to the slot), appends changelogs, applies mirrors, and
  reconciles every staged chunk whose high watermark the batch has passed. It never moves the slot: the caller
  records the returned offset first, then calls ``acknowledge``, which moves the slot. A batch re-run from the
  same slot position writes nothing twice (``cdc_assets.lake.mirror``). The offset is also written into each
  Delta commit's ``userMetadata``.
- ``pending_work()`` says whether a batch is due (the streaming sensor and a long-lived stream run poll it).
- ``check_chunks`` is ``cdc_assets.lake.consistency.check_chunks`` (PostgreSQL computes the source side).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from functools import cached_property
from typing import TYPE_CHECKING

import psycopg
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_assets.config import CdcConfig, PostgresConnection, SourceConfig
from cdc_assets.engine.chunks import Chunk, ChunkPlan
from cdc_assets.engine.faults import fault_point
from cdc_assets.engine.lsn import format_lsn
from cdc_assets.engine.pg_values import PgColumn, arrow_schema, copy_query_to_arrow
from cdc_assets.engine.windows import FILL_CHUNK, RECONCILED, STAGED, ChunkWindow, closable, open_windows
from cdc_assets.lake import staging
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.mirror import (
    append_changelog,
    apply_changes,
    reconcile,
)
from cdc_assets.postgres import catalog, snapshot, stream
from cdc_assets.postgres.catalog import CapturedTable
from cdc_assets.postgres.connection import SourceError, connect
from cdc_assets.source import SnapshotReport, StreamReport

if TYPE_CHECKING:
    from cdc_assets.lake.consistency import ChunkCheck

USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"


def _commit_positions(path) -> dict[int, int]:
    """commit LSN -> commit end LSN (``_cdc_position``) of a batch's transactions, read in the driver."""
    if path is None:
        return {}
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["_cdc_commit_lsn", "_cdc_position"])
    return dict(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))


def _range_stager(
    connection: PostgresConnection, source_name: str, table: CapturedTable, staging_path: str, attempt: str
):
    """The ``mapInArrow`` function of a chunk read: one ``COPY`` per sub-range row, typed by the shared codec and
    written as one staged file; yields (chunk, rows) per sub-range."""
    columns = list(table.columns)
    schema = arrow_schema(columns)

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        conn = connect(connection, source_name)
        try:
            for batch in batches:
                for item in batch.to_pylist():
                    lo = None if item["lo"] is None else tuple(json.loads(item["lo"]))
                    hi = None if item["hi"] is None else tuple(json.loads(item["hi"]))
                    tables = copy_query_to_arrow(conn, snapshot.chunk_select(table, lo, hi), columns)
                    rows = staging.write_part(staging_path, attempt, item["chunk"], item["part"], tables, schema)
                    yield pa.RecordBatch.from_arrays(
                        [pa.array([item["chunk"]], pa.int32()), pa.array([rows], pa.int64())], names=["chunk", "rows"]
                    )
        finally:
            conn.close()

    return read


class PostgresPipeline:
    def __init__(self, config: CdcConfig, source: SourceConfig) -> None:
        if source.kind != "postgres":
            raise SourceError(f"source {source.name!r}: kind {source.kind!r} is not handled by PostgresPipeline")
        self.config = config
        self.source = source
        self.lake = SourceLake(config.lake_root, source.name)

    def connect(self) -> psycopg.Connection:
        return connect(self.source.connection, self.source.name)

    # -- preparation -----------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, CapturedTable]:
        with self.connect() as conn:
            catalog.check_replication_role(conn, self.source)
            tables = catalog.discover_tables(conn, self.source)
            if tables:
                catalog.ensure_publication(conn, self.source, tables)
            catalog.ensure_slot(conn, self.source)
        self.__dict__["tables"] = {t.qualified_name: t for t in tables}
        return self.__dict__["tables"]

    @cached_property
    def tables(self) -> dict[str, CapturedTable]:
        return self.prepare()

    def plan(self, table: CapturedTable) -> ChunkPlan:
        stored = self.lake.read_plan(table.qualified_name)
        if stored is None:
            with self.connect() as conn:
                stored = self.lake.store_plan(snapshot.plan_chunks(conn, table))
        if stored.key_columns != table.key_columns:
            raise SourceError(
                f"source {self.source.name!r}: table {table.qualified_name}: the stored chunk plan uses key "
                f"{list(stored.key_columns)} but the table's key is now {list(table.key_columns)}; "
                f"remove {self.lake.plan_path(table.qualified_name)} and the table's lake folder to re-plan"
            )
        return stored

    # -- snapshot --------------------------------------------------------------------------------------------
    def snapshot(
        self, spark: SparkSession, table: CapturedTable, chunk_indexes: list[int], run_id: str
    ) -> SnapshotReport:
        started = time.monotonic()
        plan = self.plan(table)
        chunks = [plan.chunks[i] for i in chunk_indexes]
        attempt = f"{run_id}-{uuid.uuid4().hex[:8]}"
        paths = self.lake.table(table.qualified_name)
        with self.connect() as conn:
            lw_lsn = snapshot.take_insert_lsn(conn)
            low_watermark = snapshot.take_low_watermark(conn)  # step 1: every read below starts after this
            # read the columns the table has now: a column added after the run described the table, and set by a
            # transaction settled at the low watermark, is in the rows the reads see (else staged without it and
            # reconciled as NULL over the stream's value: a lost update)
            table = catalog.with_current_columns(conn, table)
            counts = self.stage_chunks(spark, conn, table, chunks, paths.staging, attempt)  # step 2
            high_watermark = snapshot.take_high_watermark(conn)  # step 3: after every read finished
        fault_point("snapshot.before_window_record")
        now = datetime.now(UTC)
        windows = [
            ChunkWindow(table.qualified_name, c.index, attempt, lw_lsn, low_watermark, high_watermark,
                        counts.get(c.index, 0), now)
            for c in chunks
        ]  # fmt: skip
        window_log.record(spark, self.lake.windows, STAGED, windows)  # step 4
        for window in windows:
            self.lake.mark_waiting(window.table, window.chunk, window.hw)
        return SnapshotReport(
            attempt=attempt,
            rows=sum(counts.values()),
            per_chunk=counts,
            seconds=time.monotonic() - started,
            low_watermark=f"{low_watermark.xmin}:{low_watermark.xmax}",
            hw=high_watermark,
        )

    def stage_chunks(
        self, spark: SparkSession, conn: psycopg.Connection, table: CapturedTable, chunks: list[Chunk],
        staging_path: str, attempt: str,
    ) -> dict[int, int]:  # fmt: skip
        """Read ``chunks`` in parallel sub-ranges (one Spark task each) into staged files of ``attempt``
        (``cdc_assets.lake.staging``); the rows staged per chunk. Returns when every read has finished."""
        ranges = []
        for chunk in chunks:
            observed_max = snapshot.max_integer_key(conn, table) if chunk.hi is None else None
            parts = snapshot.sub_ranges(table, chunk, self.source.read_parallelism, observed_max)
            for number, part in enumerate(parts):
                ranges.append(
                    (chunk.index, number, None if part.lo is None else json.dumps(part.lo),
                     None if part.hi is None else json.dumps(part.hi))
                )  # fmt: skip
        stager = _range_stager(self.source.connection, self.source.name, table, staging_path, attempt)
        frame = spark.createDataFrame(ranges, "chunk int, part int, lo string, hi string").repartition(len(ranges))
        counts = dict.fromkeys((c.index for c in chunks), 0)
        for row in frame.mapInArrow(stager, "chunk int, rows long").collect():
            counts[row["chunk"]] += row["rows"]
        return counts

    # -- streaming -------------------------------------------------------------------------------------------
    def stream_batch(self, spark: SparkSession, recorded_lsn: int | None, run_id: str) -> StreamReport:
        started = time.monotonic()
        tables = self.tables
        batch_id = f"{run_id}-{uuid.uuid4().hex[:8]}"
        spill_dir = self.lake.spill_dir(batch_id)
        settings = self.source.stream
        with self.connect() as conn:
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            if recorded_lsn is not None and recorded_lsn > confirmed:
                # the offset was recorded but the slot did not follow yet (or change_offset moved it): follow now
                stream.advance_slot(conn, self.source.slot, recorded_lsn)
            batch = stream.read_batch(
                conn, self.source.slot, self.source.publication, tables, spill_dir, settings.max_changes,
                settings.spill_rows,
            )  # fmt: skip
            server_flush = stream.current_flush_lsn(conn)
        phases = {"read": time.monotonic() - started}
        offset: dict[str, object] = {
            "lsn": format_lsn(batch.applied_lsn),
            "lsn_commit": format_lsn(batch.last_commit_lsn) if batch.last_commit_lsn is not None else None,
            "lsn_proc": format_lsn(batch.last_end_lsn) if batch.last_end_lsn is not None else None,
            "txId": batch.last_xid,
            "ts_usec": int(batch.last_commit_ts.timestamp() * 1_000_000) if batch.last_commit_ts else None,
            "slot": self.source.slot,
            "publication": self.source.publication,
        }
        spark.conf.set(USER_METADATA, json.dumps({"source": self.source.name, "batch": batch_id, **offset}))
        per_table: dict[str, dict[str, int]] = {}
        unknown_keys: dict[str, list[tuple]] = {}
        try:
            transactions = spark.read.parquet(str(batch.transactions_path)) if batch.transactions_path else None
            positions = _commit_positions(batch.transactions_path)
            for name, spill in sorted(batch.spills.items()):
                if not spill.parts or transactions is None:
                    continue
                table = tables[name]
                paths = self.lake.table(name)
                changes = (
                    spark.read.option("mergeSchema", "true")
                    .parquet(*[str(p) for p in spill.parts])
                    .join(F.broadcast(transactions), "_cdc_commit_lsn")
                    .cache()
                )
                try:
                    columns = self._columns(table, spill.added_columns)
                    mark = time.monotonic()
                    append_changelog(spark, paths.changelog, changes)
                    phases["changelog"] = phases.get("changelog", 0.0) + time.monotonic() - mark
                    fault_point("stream.after_changelog")
                    mark = time.monotonic()
                    truncate = max(((positions[c], q) for c, q in spill.truncations), default=None)
                    unknown = apply_changes(
                        spark, paths.mirror, changes, columns, table.key_columns, set(spill.unchanged_columns), truncate
                    )
                    fault_point("stream.after_merge")
                    if unknown:
                        unknown_keys[name] = unknown
                    phases["merge"] = phases.get("merge", 0.0) + time.monotonic() - mark
                finally:
                    changes.unpersist()
                per_table[name] = {
                    "changes": spill.changes, "spill_parts": len(spill.parts),
                    "truncates": len(spill.truncations),
                }  # fmt: skip
            mark = time.monotonic()
            reconciled, waiting, filled = self._reconcile_closed(spark, batch.applied_lsn)
            # keys still unknown after a fill window closed (their rows were replaced or touched meanwhile) get the next
            waiting += self._fill_unknown(spark, {**unknown_keys, **dict.fromkeys(filled)})
            phases["reconcile"] = time.monotonic() - mark
            fault_point("stream.after_lake_commit")
        finally:
            spark.conf.unset(USER_METADATA)
            shutil.rmtree(spill_dir, ignore_errors=True)
        lag_seconds = None
        if batch.last_commit_ts is not None:
            lag_seconds = max(0.0, (datetime.now(UTC) - batch.last_commit_ts).total_seconds())
        return StreamReport(
            offset=offset,
            changes=batch.changes,
            transactions=batch.transactions,
            seconds=time.monotonic() - started,
            lag_bytes=max(0, server_flush - batch.applied_lsn),
            lag_seconds=lag_seconds,
            reconciled=reconciled,
            waiting_windows=waiting,
            per_table=per_table,
            phase_seconds={k: round(v, 3) for k, v in phases.items()},
        )

    def _fill_unknown(self, spark: SparkSession, wanted: dict[str, list[tuple] | None]) -> int:
        """Open a fill window per table of ``wanted`` (table -> keys of its mirror rows with unknown unchanged-TOAST
        values; None: look them up in the mirror) unless the table has one open already (its reconciliation comes
        first; keys still unknown then get the next one). The number of windows opened.

        A fill window is a watermark window like a chunk's: low watermark, the rows of those keys read with every
        column the table has now, high watermark; staged and recorded in the window log as chunk ``FILL_CHUNK``.
        Nothing is written to the mirror here: a value read now is the row's only if no change replaced the row at
        that key since (the key can have moved on and been reused by another row), which is known only once the
        stream has passed the high watermark; then ``reconcile`` applies the window by the chunk rule
        (``cdc_assets.lake.mirror``)."""
        if not wanted:
            return 0
        pending = open_windows(window_log.read_events(spark, self.lake.windows))
        busy = {w.table for w in pending if w.chunk == FILL_CHUNK}
        opened = 0
        for name, keys in sorted(wanted.items()):
            table = self.tables.get(name)
            if name in busy or table is None:
                continue
            paths = self.lake.table(name)
            if keys is None:
                unknown = spark.read.format("delta").load(paths.mirror).where(F.col("_cdc_unknown").isNotNull())
                keys = [tuple(r) for r in unknown.select(*[F.col(f"`{k}`") for k in table.key_columns]).collect()]
            if keys:
                self._open_fill_window(spark, table, paths.staging, keys)
                opened += 1
        return opened

    def _open_fill_window(
        self, spark: SparkSession, table: CapturedTable, staging_path: str, keys: list[tuple]
    ) -> None:
        attempt = f"fill-{uuid.uuid4().hex[:12]}"
        with self.connect() as conn:
            lw_lsn = snapshot.take_insert_lsn(conn)
            low_watermark = snapshot.take_low_watermark(conn)  # every read below starts after this
            readable = catalog.with_current_columns(conn, table)
            columns = list(readable.columns)
            parts = (
                part
                for start in range(0, len(keys), 1000)
                for part in copy_query_to_arrow(conn, snapshot.rows_by_key_select(readable, keys[start : start + 1000]),
                                                columns)
            )  # fmt: skip
            rows = staging.write_part(staging_path, attempt, FILL_CHUNK, 0, parts, arrow_schema(columns))
            high_watermark = snapshot.take_high_watermark(conn)  # after every read finished
        window = ChunkWindow(table.qualified_name, FILL_CHUNK, attempt, lw_lsn, low_watermark, high_watermark, rows,
                             datetime.now(UTC))  # fmt: skip
        window_log.record(spark, self.lake.windows, STAGED, [window])
        self.lake.mark_waiting(window.table, window.chunk, window.hw)

    def _columns(self, table: CapturedTable, added: list[PgColumn]) -> list[PgColumn]:
        known = {c.name for c in table.columns}
        return [*table.columns, *[c for c in added if c.name not in known]]

    def _reconcile_closed(self, spark: SparkSession, applied_lsn: int) -> tuple[list[dict[str, object]], int, set[str]]:
        """Reconcile the windows the stream has passed: the chunks reconciled, the windows still open, and the tables
        whose fill window was reconciled."""
        log_read_at = time.time()
        pending = open_windows(window_log.read_events(spark, self.lake.windows))
        ready = closable(pending, applied_lsn)
        done: list[dict[str, object]] = []
        filled: set[str] = set()
        by_table: dict[str, list[ChunkWindow]] = {}
        for window in ready:
            by_table.setdefault(window.table, []).append(window)
        for name, windows in sorted(by_table.items()):
            table = self.tables.get(name)
            if table is None:
                continue
            plan = self.plan(table)
            chunks: dict[int, Chunk] = {c.index: c for c in plan.chunks}
            paths = self.lake.table(name)
            results = reconcile(
                spark, paths.mirror, paths.changelog, paths.staging, list(table.columns), table.key_columns,
                windows, chunks,
            )  # fmt: skip
            counts = {(r.table, r.chunk): (r.kept, r.dropped, r.deleted) for r in results}
            window_log.record(spark, self.lake.windows, RECONCILED, windows, counts)
            for r in results:
                self.lake.clear_waiting(r.table, r.chunk)
                if r.chunk == FILL_CHUNK:  # not a chunk of the table's asset
                    filled.add(r.table)
                    continue
                done.append(
                    {"table": r.table, "chunk": r.chunk, "event": RECONCILED, "kept": r.kept, "dropped": r.dropped,
                     "deleted": r.deleted}
                )  # fmt: skip
        still_open = [w for w in pending if w not in ready]
        markers = self.lake.waiting_markers()
        for window in still_open:
            if markers.get((window.table, window.chunk)) != window.hw:
                self.lake.mark_waiting(window.table, window.chunk, window.hw)
        self.lake.clear_stale_markers({(w.table, w.chunk) for w in still_open}, older_than=log_read_at)
        return done, len(still_open), filled

    # -- added columns ---------------------------------------------------------------------------------------
    def column_names(self, table: CapturedTable) -> list[str]:
        return [c.name for c in table.columns]

    def filled_without_changes(self, table: CapturedTable, names: Sequence[str]) -> list[str]:
        if not names:
            return []
        with self.connect() as conn:
            return catalog.filled_without_changes(conn, table, names)

    # -- consistency -----------------------------------------------------------------------------------------
    def check_chunks(
        self, spark: SparkSession, table: CapturedTable, indexes: Sequence[int], wait_seconds: float = 120
    ) -> list[ChunkCheck]:
        """Count and checksum of ``indexes``' key ranges, by PostgreSQL and over the mirror (``check_chunks``)."""
        from cdc_assets.lake.consistency import check_chunks

        return check_chunks(self, spark, table, indexes, wait_seconds)

    # -- slot ------------------------------------------------------------------------------------------------
    def pending_work(self) -> str | None:
        """Why a stream batch is due now, or None: the slot holds a change for the publication, the slot lags the
        server by more than ``max_lag_bytes`` (advance it so the server can recycle WAL while the captured tables are
        idle and others are busy), or a staged chunk's high watermark is at or below the server's flush LSN (its
        window can close), or a consistency check waits for the stream to pass its high watermark. Reads no Delta table
        (the waiting markers are plain files): cheap enough for a sensor."""
        with self.connect() as conn:
            flush = stream.current_flush_lsn(conn)
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            if stream.has_pending_changes(conn, self.source.slot, self.source.publication):
                return "changes waiting in the slot"
        if flush - confirmed > self.source.stream.max_lag_bytes:
            return f"slot lags the server by {flush - confirmed} bytes"
        if any(hw <= flush for hw in self.lake.waiting_markers().values()):
            return "a chunk window can close"
        if any(hw <= flush for hw in self.lake.check_markers()):
            return "a consistency check waits for the stream"
        return None

    def acknowledge(self, lsn: int) -> int:
        """Move the slot to ``lsn`` (only forward). Call only after the offset ``lsn`` is recorded."""
        with self.connect() as conn:
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            if lsn <= confirmed:
                return confirmed
            return stream.advance_slot(conn, self.source.slot, lsn)
