"""``PostgresPipeline``: the ``CdcSource`` (``cdc_assets.source``) of a PostgreSQL database.

Contract (Dagster calls these from assets and sensors; tests call them directly):
- ``prepare()`` checks the role (``REPLICATION``), resolves the captured tables, makes sure the publication covers
  them and the slot exists (created only when missing and allowed; otherwise ``SourceError`` with the statement an
  administrator can run). The slot exists before any snapshot window opens, so no change is ever missed.
- ``plan(table)`` returns the stored chunk plan, planning and storing it on first use (immutable afterwards).
- ``snapshot(spark, table, chunk_indexes, run_id)`` runs one watermark window (DESIGN.md; the sequence is the
  generic ``cdc_assets.lake.watermark_window.run_window``, with ``PostgresWatermarks``) around reading the
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
  Its bounds (``stream.max_changes``, ``stream.max_batch_bytes``) are halved after a failed batch, down to one
  transaction, and doubled back after successes (``cdc_assets.engine.batch_bounds``; ``_cdc/stream_bounds.json``,
  which also marks a batch in flight, so a process killed during one counts as a failure). A failure raises
  ``StreamBatchError`` naming the phase, table, changes and bytes, the cause (heap exhaustion, a dead JVM) and the
  settings to change. A table's part of a batch larger than one spill part runs without automatic broadcast joins,
  with input partitions of ``spill_bytes`` and its rows persisted on disk (``big_batch_conf``).
- ``pending_work()`` says whether a batch is due (the streaming sensor and a long-lived stream run poll it);
  ``lag()`` is the slot's lag in bytes and seconds (the sensor records it on every tick).
- ``check_chunks`` is ``cdc_assets.sources.postgres.consistency.check_chunks`` (PostgreSQL computes the source side).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_assets.config import CdcConfig, PostgresConnection, SourceConfig
from cdc_assets.engine.batch_bounds import (
    BatchBounds,
    after_failure,
    after_success,
    recover_in_flight,
    with_in_flight,
)
from cdc_assets.engine.chunks import Chunk, ChunkPlan
from cdc_assets.engine.faults import fault_point, size_fault
from cdc_assets.engine.lsn import format_lsn
from cdc_assets.engine.windows import FILL_CHUNK, RECONCILED, ChunkWindow, closable, open_windows
from cdc_assets.lake import staging
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.mirror import (
    StagedRowsMismatch,
    append_changelog,
    apply_changes,
    reconcile,
)
from cdc_assets.lake.spark import DRIVER_MEMORY, big_batch_conf, default_driver_memory, session_conf
from cdc_assets.lake.watermark_window import run_window
from cdc_assets.source import SnapshotReport, SourceLag, StreamReport
from cdc_assets.sources.postgres import catalog, snapshot, stream
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.connection import SourceError, connect
from cdc_assets.sources.postgres.consistency import check_chunks
from cdc_assets.sources.postgres.pg_values import PgColumn, arrow_schema, copy_query_to_arrow, spark_schema
from cdc_assets.sources.postgres.watermark import PostgresSettledRule

if TYPE_CHECKING:
    from cdc_assets.source import ChunkCheck

USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
SETTLED_RULE = PostgresSettledRule()
BOUNDS_FILE = "stream_bounds.json"


class StreamBatchError(RuntimeError):
    """A stream batch failed; the message names the phase, what the batch held, the cause and what to change."""


@dataclass
class _BatchProgress:
    """What a batch got to before it failed."""

    phase: str = "read"
    table: str | None = None
    changes: int | None = None
    bytes: int | None = None
    transactions: int | None = None
    cut: bool = False  # a bound cut the batch: more was waiting


JVM_GONE = ("Answer from Java side is empty", "Connection refused", "Error while sending or receiving",
            "Connection reset", "Broken pipe", "Py4JNetworkError")  # fmt: skip


def failure_cause(error: BaseException) -> str:
    """The cause of a failed batch in one sentence: heap exhaustion and a dead JVM named as such (py4j's own error
    after the JVM died says only "Connection refused"), else the error's type and first line."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    texts = [f"{type(e).__name__}: {e}" for e in chain]
    if any("OutOfMemoryError" in t for t in texts):
        return "the Spark driver's JVM ran out of heap (java.lang.OutOfMemoryError)"
    if any("Not enough memory to build and broadcast" in t for t in texts):
        return "the Spark driver had not enough heap to broadcast a join side"
    if any(isinstance(e, ConnectionError) or any(m in f"{type(e).__name__}: {e}" for m in JVM_GONE) for e in chain):
        return (
            "the Spark driver's JVM died or stopped answering (py4j: connection refused); most likely it ran out of "
            "heap or was killed (the step's stderr has the JVM's last words)"
        )
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first[:1500]}"


def _size(count: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} bytes"


def describe_failure(
    source: str, progress: _BatchProgress, bounds: BatchBounds, shrunk: BatchBounds, cause: str, driver_memory: str
) -> str:
    where = progress.phase + (f" of table {progress.table}" if progress.table else "")
    if progress.changes is None:
        limits = f"{bounds.max_changes} changes, {_size(bounds.max_bytes)}"
        held = f"the batch was being read from the slot (bounds: {limits})"
    else:
        held = (
            f"the batch held {progress.changes} changes in {progress.transactions} transactions, "
            f"{_size(progress.bytes or 0)} of change messages (bounds: {bounds.max_changes} changes, "
            f"{_size(bounds.max_bytes)})"
        )
    single = progress.transactions == 1 or (bounds.max_changes == 1 and bounds.max_bytes == 1)
    if single:
        advice = (
            f"It is a single transaction and cannot be split: raise spark.driver.memory (now {driver_memory}) under "
            "spark.conf in cdc.yaml."
        )
    else:
        advice = (
            f"The next attempt reads a smaller batch (at most {shrunk.max_changes} changes, "
            f"{_size(shrunk.max_bytes)}; halved after each failure down to one transaction, grown back after "
            f"successes). If batches keep failing, raise spark.driver.memory (now {driver_memory}) under spark.conf "
            f"in cdc.yaml, or lower stream.max_batch_bytes / stream.max_changes of source {source!r}."
        )
    return f"stream batch of source {source!r} failed in phase {where}: {cause}; {held}. {advice}"


def _quietly(action) -> None:
    """Clean-up that must not replace the error in flight (after the JVM died, every call to it fails)."""
    try:
        action()
    except Exception:  # the batch's own error (or success) is what counts
        pass


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
        self.skipped_tables: list[catalog.SkippedTable] = []

    def connect(self) -> psycopg.Connection:
        return connect(self.source.connection, self.source.name)

    # -- preparation -----------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, CapturedTable]:
        with self.connect() as conn:
            catalog.check_replication_role(conn, self.source)
            discovery = catalog.discover(conn, self.source)
            tables = discovery.tables
            if tables:
                catalog.ensure_publication(conn, self.source, tables)
            catalog.ensure_slot(conn, self.source)
        self.skipped_tables = discovery.skipped
        self.__dict__["tables"] = {t.qualified_name: t for t in tables}
        return self.__dict__["tables"]

    def skipped(self) -> list[catalog.SkippedTable]:
        """The selected tables that are not captured, each with its reason and fix (``prepare()``'s)."""
        self.tables  # noqa: B018 - prepares once
        return list(self.skipped_tables)

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

            def read() -> dict[int, int]:
                # the columns the table has now (after the low watermark): a column added after the run described
                # the table, and set by a transaction settled at the low watermark, is in the rows the reads see
                # (else staged without it and reconciled as NULL over the stream's value: a lost update)
                current = catalog.with_current_columns(conn, table)
                return self.stage_chunks(spark, conn, current, chunks, paths.staging, attempt)

            windows = run_window(spark, self.lake, table.qualified_name, [c.index for c in chunks], attempt,
                                 snapshot.PostgresWatermarks(conn), read)  # fmt: skip
        return SnapshotReport(
            attempt=attempt,
            rows=sum(w.rows for w in windows),
            per_chunk={w.chunk: w.rows for w in windows},
            seconds=time.monotonic() - started,
            low_watermark=windows[0].low_watermark if windows else "",
            hw=windows[0].hw if windows else 0,
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
        """One batch (see module docstring). Its bounds are the configured ones shrunk after failed batches
        (``cdc_assets.engine.batch_bounds``, stored in ``_cdc/stream_bounds.json``); a failure raises
        ``StreamBatchError`` naming the phase, what the batch held and the setting to change, after halving the
        bounds for the next attempt."""
        started = time.monotonic()
        batch_id = f"{run_id}-{uuid.uuid4().hex[:8]}"
        spill_dir = self.lake.spill_dir(batch_id)
        configured = self.configured_bounds()
        bounds = self.batch_bounds()
        if bounds.in_flight is not None:  # the previous batch's process died while it wrote the lake
            bounds = recover_in_flight(bounds)
        progress = _BatchProgress()  # in flight is recorded once the read returned (nothing is written before it)
        try:
            report = self._stream_batch(spark, recorded_lsn, batch_id, spill_dir, bounds, progress, started)
        except BaseException as error:
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: not the batch's fault
                raise
            if isinstance(error, SourceError):
                raise  # the source refused or is unreachable: its message names the setting; nothing was written
            if isinstance(error, StagedRowsMismatch | stream.SchemaChangeError):
                self.store_bounds(bounds)  # no longer in flight, bounds unchanged: a smaller batch fails the same way
                raise  # its own message names the table and the fix
            cause = failure_cause(error)
            shrunk = after_failure(bounds, progress.changes, progress.bytes, cause)
            self.store_bounds(shrunk)
            raise StreamBatchError(
                describe_failure(self.source.name, progress, bounds, shrunk, cause, self.driver_memory())
            ) from error
        restored = after_success(bounds, configured, progress.cut)
        self.store_bounds(restored)
        report.bounds = {
            "max_changes": bounds.max_changes,
            "max_bytes": bounds.max_bytes,
            "shrunk": bounds.shrunk(configured),
            "failures": bounds.failures,
            "next_max_changes": restored.max_changes,
            "next_max_bytes": restored.max_bytes,
        }
        if bounds.shrunk(configured):
            report.bounds["reason"] = bounds.reason or ""
        return report

    def driver_memory(self) -> str:
        """The driver heap this process's Spark driver starts with (``cdc.yaml``'s ``spark.conf`` or the default)."""
        return self.config.spark.conf.get(DRIVER_MEMORY) or default_driver_memory()

    def configured_bounds(self) -> BatchBounds:
        return BatchBounds(self.source.stream.max_changes, self.source.stream.max_batch_bytes)

    @property
    def bounds_path(self) -> Path:
        return self.lake.control / BOUNDS_FILE

    def batch_bounds(self) -> BatchBounds:
        """The bounds the next batch reads with (the configured ones unless failed batches shrank them)."""
        configured = self.configured_bounds()
        try:
            data = json.loads(self.bounds_path.read_text())
        except (FileNotFoundError, ValueError):
            return configured
        return BatchBounds.from_json(data if isinstance(data, dict) else {}, configured)

    def store_bounds(self, bounds: BatchBounds) -> None:
        path = self.bounds_path
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        temporary.write_text(json.dumps(bounds.to_json()))
        os.replace(temporary, path)

    def _stream_batch(
        self, spark: SparkSession, recorded_lsn: int | None, batch_id: str, spill_dir: Path, bounds: BatchBounds,
        progress: _BatchProgress, started: float,
    ) -> StreamReport:  # fmt: skip
        tables = self.tables
        settings = self.source.stream
        with self.connect() as conn:
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            if recorded_lsn is not None and recorded_lsn > confirmed:
                # the offset was recorded but the slot did not follow yet (or change_offset moved it): follow now
                stream.advance_slot(conn, self.source.slot, recorded_lsn)
            batch = stream.read_batch(
                conn, self.source.slot, self.source.publication, tables, spill_dir, bounds.max_changes,
                settings.spill_rows, bounds.max_bytes, settings.spill_bytes,
            )  # fmt: skip
            server_flush = stream.current_flush_lsn(conn)
        progress.changes, progress.bytes, progress.transactions = batch.changes, batch.bytes, batch.transactions
        progress.cut = batch.cut_by_change_limit
        self.store_bounds(with_in_flight(bounds, batch.changes, batch.bytes))
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
        per_table: dict[str, dict[str, int]] = {}
        unknown_keys: dict[str, list[tuple]] = {}
        try:
            progress.phase = "changelog"
            size_fault("stream.batch_over", batch.changes)
            spark.conf.set(USER_METADATA, json.dumps({"source": self.source.name, "batch": batch_id, **offset}))
            transactions = spark.read.parquet(str(batch.transactions_path)) if batch.transactions_path else None
            positions = _commit_positions(batch.transactions_path)
            for name, spill in sorted(batch.spills.items()):
                if not spill.parts or transactions is None:
                    continue
                table = tables[name]
                paths = self.lake.table(name)
                progress.table = name
                big = spill.bytes > settings.spill_bytes
                conf = big_batch_conf(spill.bytes, spill.changes, bool(spill.unchanged_columns), settings.spill_bytes)
                with session_conf(spark, conf):
                    changes = (
                        spark.read.option("mergeSchema", "true")
                        .parquet(*[str(p) for p in spill.parts])
                        .join(F.broadcast(transactions), "_cdc_commit_lsn")
                    )
                    # big values: kept on the local disk, not in the heap (the default level keeps what fits)
                    changes = changes.persist(StorageLevel.DISK_ONLY) if big else changes.cache()
                    try:
                        columns = self._columns(table, spill.added_columns)
                        progress.phase, mark = "changelog", time.monotonic()
                        append_changelog(spark, paths.changelog, changes, batch.applied_lsn)
                        phases["changelog"] = phases.get("changelog", 0.0) + time.monotonic() - mark
                        fault_point("stream.after_changelog")
                        progress.phase, mark = "merge", time.monotonic()
                        truncate = max(((positions[c], q) for c, q in spill.truncations), default=None)
                        unknown = apply_changes(
                            spark, paths.mirror, changes, spark_schema(columns).fields, table.key_columns,
                            set(spill.unchanged_columns), truncate,
                        )  # fmt: skip
                        fault_point("stream.after_merge")
                        if unknown:
                            unknown_keys[name] = unknown
                        phases["merge"] = phases.get("merge", 0.0) + time.monotonic() - mark
                    finally:
                        _quietly(changes.unpersist)  # the JVM may be gone: keep the batch's own error
                per_table[name] = {
                    "changes": spill.changes, "bytes": spill.bytes, "spill_parts": len(spill.parts),
                    "truncates": len(spill.truncations),
                }  # fmt: skip
            progress.phase, progress.table = "reconcile", None
            mark = time.monotonic()
            reconciled, waiting, filled = self._reconcile_closed(spark, batch.applied_lsn)
            # keys still unknown after a fill window closed (their rows were replaced or touched meanwhile) get the next
            waiting += self._fill_unknown(spark, {**unknown_keys, **dict.fromkeys(filled)})
            phases["reconcile"] = time.monotonic() - mark
            fault_point("stream.after_lake_commit")
        finally:
            _quietly(lambda: spark.conf.unset(USER_METADATA))
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
            skipped_tables={t.qualified_name: f"{t.reason}; fix: {t.fix}" for t in self.skipped_tables},
            bytes=batch.bytes,
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

            def read() -> dict[int, int]:
                readable = catalog.with_current_columns(conn, table)
                columns = list(readable.columns)
                parts = (
                    part
                    for start in range(0, len(keys), 1000)
                    for part in copy_query_to_arrow(
                        conn, snapshot.rows_by_key_select(readable, keys[start : start + 1000]), columns
                    )
                )
                return {
                    FILL_CHUNK: staging.write_part(staging_path, attempt, FILL_CHUNK, 0, parts, arrow_schema(columns))
                }

            run_window(spark, self.lake, table.qualified_name, [FILL_CHUNK], attempt, snapshot.PostgresWatermarks(conn),
                       read)  # fmt: skip

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
            # staged rows of big values look small to Spark's join planner (compressed files): no broadcast then
            staged_bytes = staging.staged_bytes(paths.staging, (w.attempt for w in windows))
            staged_rows = sum(w.rows for w in windows)
            with session_conf(spark, big_batch_conf(staged_bytes, staged_rows, False, self.source.stream.spill_bytes)):
                results = reconcile(
                    spark, paths.mirror, paths.changelog, paths.staging, spark_schema(list(table.columns)).fields,
                    table.key_columns, windows, chunks, SETTLED_RULE,
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

    def partitions(self, table: CapturedTable) -> list[str]:
        """The table's leaf partitions now (none for an ordinary table)."""
        with self.connect() as conn:
            return catalog.partitions_of(conn, table)

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
        plan = self.plan(table)
        chunks = [plan.chunks[i] for i in indexes]
        return check_chunks(spark, self.lake, self.source.slot, self.connect, table, chunks, wait_seconds)

    # -- slot ------------------------------------------------------------------------------------------------
    def lag(self) -> SourceLag:
        """The slot's lag: bytes from its confirmed position to the server's flush LSN, and seconds since the oldest
        transaction it holds for the publication committed (decodes up to one transaction)."""
        with self.connect() as conn:
            flush = stream.current_flush_lsn(conn)
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            oldest = stream.oldest_pending_commit(conn, self.source.slot, self.source.publication)
        seconds = 0.0 if oldest is None else max(0.0, (datetime.now(UTC) - oldest).total_seconds())
        return SourceLag(max(0, flush - confirmed), seconds, oldest is not None)

    def pending_work(self, lag: SourceLag | None = None) -> str | None:
        """Why a stream batch is due now, or None: the slot holds a change for the publication, the slot lags the
        server by more than ``max_lag_bytes`` (advance it so the server can recycle WAL while the captured tables are
        idle and others are busy), or a staged chunk's high watermark is at or below the server's flush LSN (its
        window can close), or a consistency check waits for the stream to pass its high watermark. Reads no Delta table
        (the waiting markers are plain files): cheap enough for a sensor. ``lag``: one the caller just took."""
        with self.connect() as conn:
            flush = stream.current_flush_lsn(conn)
            if lag is None:
                confirmed, _ = stream.slot_position(conn, self.source.slot)
                waiting = stream.has_pending_changes(conn, self.source.slot, self.source.publication)
                lag_bytes = flush - confirmed
            else:
                waiting, lag_bytes = lag.changes_waiting, lag.lag_bytes
        if waiting:
            return "changes waiting in the slot"
        if lag_bytes > self.source.stream.max_lag_bytes:
            return f"slot lags the server by {lag_bytes} bytes"
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
