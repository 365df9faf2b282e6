"""``CdcPipeline``: the ``CdcSource`` (``cdc_assets.source``) of any source kind, written once over a dialect.

Contract (Dagster calls these from assets and sensors; tests call them directly). The source kind answers only what
differs (``cdc_assets.dialect.SourceDialect``); everything below is the same for every kind.
- ``prepare()`` asks the dialect to discover the captured tables (the change-capture resources exist afterwards, so
  no change is ever missed). ``tables`` is its result, resolved once per object, and again when a batch's dialect
  raises ``CapturedTablesChanged`` (it met a table the source captures now that ``tables`` lacks: created or newly
  selected while a long-lived run was in flight): nothing of that read is kept, the tables are resolved again and
  the batch is read again (up to ``RESOLVE_AGAIN_LIMIT`` times), and ``StreamReport.newly_captured`` names them.
  Otherwise the offset would move past the new table's changes.
- ``plan(table)`` returns the stored chunk plan, planning and storing it on first use (immutable afterwards); a
  stored plan over other key columns than the table's now raises ``SourceError`` naming both and the fix.
- ``snapshot(spark, table, chunk_indexes, run_id)`` runs one watermark window around reading the chunks
  (``cdc_assets.lake.watermark_window.run_window``: low watermark, the dialect's staged reads, high watermark, fault
  point, window log record, waiting markers). A run killed before the record leaves rows no one reads.
- ``stream_batch(spark, recorded, run_id)`` reads one bounded batch after the recorded offset (the dialect spills
  it to disk), appends changelogs, applies mirrors, and reconciles every staged window whose high watermark the
  batch has passed, then opens fill windows for mirror rows with unknown values. It never makes the source forget
  anything past the recorded offset: the caller records the returned offset first, then calls ``acknowledge``. A
  batch re-run from the same recorded offset writes nothing twice (``cdc_assets.lake.mirror``). The offset and the
  batch's position are written into each Delta commit's ``userMetadata``.
  Its bounds (``stream.max_changes``, ``stream.max_batch_bytes``) are halved after failed batches, down to one
  transaction, and grown back after successes (``cdc_assets.engine.batch_bounds``; ``_cdc/stream_bounds.json``,
  which also marks a batch in flight, so a process killed during one counts as a failure). A failure raises
  ``StreamBatchError`` naming the phase, table, changes and bytes, the cause (heap exhaustion, a dead JVM) and the
  settings to change; a ``SourceError`` (the source refused or is unreachable) and an error the dialect calls
  permanent (a smaller batch fails the same way) or ``StagedRowsMismatch`` keep the bounds and are raised as they
  are. A table's part of a batch larger than one spill part runs without automatic broadcast joins, with input
  partitions of ``spill_bytes`` and its rows persisted on disk (``big_batch_conf``).
  A batch whose dialect reports the source's history lost (``ChangeBatch.resnapshot``) first records, for every
  captured table, that every chunk must be read again after the batch's position (``SourceLake.mark_resnapshot``;
  before the caller records the offset, so a run killed in between only records it again, later). While a table
  has that marker, no window of it whose reads started before the marker's position is applied
  (``engine.windows.read_before``), and the marker is removed once every chunk of the table has a reconciled window
  read after it; its consistency checks are inconclusive until then.
- ``rows_requests(requested)``, ``refuse_waiting_rows(spark, names)`` and ``snapshot_rows(spark, table, row_filter,
  run_id)``: an ad-hoc snapshot of chosen rows (the ``<source>_snapshot_rows`` job). ``rows_requests`` validates
  every requested table and filter before anything is read, without Spark (the table is captured and named once;
  the dialect's ``row_filter``), ``refuse_waiting_rows`` that no rows window of those tables waits for the stream (a
  new one would supersede it and its rows would never be applied); both raise ``SnapshotRowsRefused``
  (``RowFilterError`` for a filter) naming the table, the field and the allowed values: nothing is read, staged or
  recorded then. ``snapshot_rows`` reads the matching rows inside a watermark window of
  their own (``run_window``: low watermark, the dialect's ``stage_rows_matching``, high watermark, window log record
  as chunk ``ROWS_CHUNK``, waiting marker); nothing is written to the mirror there. The stream reconciles the
  window once it has passed the high watermark, like a fill window: the settled rows are upserted, nothing is
  deleted, and the rows no filter term matches are not touched. A run killed before the record leaves staged rows
  that no window names (dropped by the upkeep).
- ``startup_mode: snapshot`` with a dialect that bounds its reads (``bounded_reads``; MongoDB): a batch reads no
  change after the highest high watermark of the staged windows and waiting checks (none waiting: no change at
  all), so the snapshot is reconciled and the stream goes no further (``streams_only_for_windows``).
- ``pending_work()`` says whether a batch is due (the streaming sensor and a long-lived stream run poll it); reads
  no Delta table. ``lag()`` is the dialect's.
- ``acknowledge(offset)`` is the dialect's; call it only after the offset is recorded (a batch's, or one the
  ``change_offset`` job recorded). The lake's acknowledged position then follows the recorded offset, backwards
  too.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Generic

from pyspark import StorageLevel
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from cdc_assets.config import CdcConfig, SourceConfig
from cdc_assets.consistency import check_chunks
from cdc_assets.dialect import ChangeBatch, Offset, SourceDialect
from cdc_assets.engine.batch_bounds import BatchBounds, after_failure, after_success, recover_in_flight, with_in_flight
from cdc_assets.engine.chunks import Chunk, ChunkPlan
from cdc_assets.engine.faults import driver_fault_point, fault_point, size_fault
from cdc_assets.engine.row_filter import RowFilter, SnapshotRowsRefused
from cdc_assets.engine.windows import (
    FILL_CHUNK,
    RECONCILED,
    ROWS_CHUNK,
    STAGED,
    ChunkWindow,
    WindowEvent,
    WindowStart,
    closable,
    open_windows,
    read_before,
    resnapshot_done,
    waiting_rows_windows,
)
from cdc_assets.lake import staging
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.mirror import USER_METADATA, StagedRowsMismatch, append_changelog, apply_changes, reconcile
from cdc_assets.lake.spark import DRIVER_MEMORY, big_batch_conf, default_driver_memory, driver_process, session_conf
from cdc_assets.lake.warm_up import WarmUp, rehearse_batch, scratch_folder
from cdc_assets.lake.watermark_window import run_window
from cdc_assets.source import (
    CapturedTablesChanged,
    ChunkCheck,
    PermanentBatchError,
    SkippedTableLike,
    SnapshotReport,
    SourceError,
    SourceLag,
    StreamReport,
    TableT,
)

# how often one batch resolves the captured tables again before it gives up (each time the dialect met a table the
# source captures now; more than a few in a row means tables are created faster than a batch is read)
RESOLVE_AGAIN_LIMIT = 5
BOUNDS_FILE = "stream_bounds.json"
# tables a successor stream run rehearses a batch of while it waits (those written last): each costs a few seconds
WARM_UP_TABLES = 8


class StreamBatchError(RuntimeError):
    """A stream batch failed; the message names the phase, what the batch held, the cause and what to change."""


@dataclass
class BatchProgress:
    """What a batch got to before it failed."""

    phase: str = "read"
    table: str | None = None
    changes: int | None = None
    bytes: int | None = None
    transactions: int | None = None
    cut: bool = False  # a bound cut the batch: more was waiting


JVM_GONE = ("Answer from Java side is empty", "Connection refused", "Error while sending or receiving",
            "Connection reset", "Broken pipe", "Py4JNetworkError")  # fmt: skip


class SnapshotDriverError(RuntimeError):
    """A snapshot step failed because its Spark driver's JVM died or ran out of heap; the message names the table,
    the chunks and that cause (py4j's own error says only "Connection refused")."""


def _jvm_gone(error: BaseException) -> bool:
    """A socket error, or py4j's or PySpark's words for a JVM that stopped answering (not a database driver's
    "Connection refused": PostgreSQL's says so too)."""
    if isinstance(error, ConnectionError):
        return True
    module = type(error).__module__ or ""
    return module.startswith(("py4j", "pyspark")) and any(m in f"{type(error).__name__}: {error}" for m in JVM_GONE)


def driver_cause(error: BaseException) -> str | None:
    """Contract: the Spark driver's failure behind ``error`` in one sentence (heap exhausted, a broadcast without
    heap, the JVM dead or not answering), found anywhere in its chain of causes; None when none of those is."""
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
    if any(_jvm_gone(e) for e in chain):
        return (
            "the Spark driver's JVM died or stopped answering (py4j: connection refused); most likely it ran out of "
            "heap or was killed (the step's stderr has the JVM's last words)"
        )
    return None


def failure_cause(error: BaseException) -> str:
    """The cause of a failed batch in one sentence: the driver's failure named as such (``driver_cause``), else the
    error's type and first line."""
    cause = driver_cause(error)
    if cause is not None:
        return cause
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first[:1500]}"


@contextmanager
def driver_failure_named(what: str) -> Iterator[None]:
    """Contract: an error inside whose cause is the Spark driver's (``driver_cause``) leaves as a
    ``SnapshotDriverError`` naming ``what`` and that cause, chained to the original; any other error passes through
    unchanged. Nothing of the attempt is applied: its watermark window is recorded only after the read returned."""
    try:
        yield
    except Exception as error:
        cause = driver_cause(error)
        if cause is None:
            raise
        raise SnapshotDriverError(
            f"{what} failed: {cause}. Nothing of this attempt is applied (its watermark window was not recorded); a "
            "retry of the step, or a new run, reads it again with a new JVM"
        ) from error


def _size(count: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{int(count)} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} bytes"


def describe_failure(
    source: str, progress: BatchProgress, bounds: BatchBounds, shrunk: BatchBounds, cause: str, driver_memory: str,
    change_log: str = "the replication slot",
) -> str:  # fmt: skip
    where = progress.phase + (f" of table {progress.table}" if progress.table else "")
    if progress.changes is None:
        limits = f"{bounds.max_changes} changes, {_size(bounds.max_bytes)}"
        held = f"the batch was being read from {change_log} (bounds: {limits})"
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


class CdcPipeline(Generic[TableT]):
    def __init__(self, config: CdcConfig, source: SourceConfig, dialect: SourceDialect[TableT]) -> None:
        self.config = config
        self.source = source
        self.dialect = dialect
        self.lake = SourceLake(config.lake_root, source.name)
        self.skipped_tables: list[SkippedTableLike] = []

    # -- preparation -----------------------------------------------------------------------------------------
    def prepare(self) -> dict[str, TableT]:
        tables, skipped = self.dialect.discover()
        self.skipped_tables = list(skipped)
        self.__dict__["tables"] = {t.qualified_name: t for t in tables}
        return self.__dict__["tables"]

    def skipped(self) -> list[SkippedTableLike]:
        """The selected tables that are not captured, each with its reason and fix (``prepare()``'s)."""
        self.tables  # noqa: B018 - prepares once
        return list(self.skipped_tables)

    @cached_property
    def tables(self) -> dict[str, TableT]:
        return self.prepare()

    def plan(self, table: TableT) -> ChunkPlan:
        stored = self.lake.read_plan(table.qualified_name)
        if stored is None:
            stored = self.lake.store_plan(self.dialect.plan_chunks(table))
        if stored.key_columns != tuple(table.key_columns):
            raise SourceError(
                f"source {self.source.name!r}: table {table.qualified_name}: the stored chunk plan uses key "
                f"{list(stored.key_columns)} but the table's key is now {list(table.key_columns)}; "
                f"remove {self.lake.plan_path(table.qualified_name)} and the table's lake folder to re-plan"
            )
        return stored

    # -- snapshot --------------------------------------------------------------------------------------------
    def snapshot(self, spark: SparkSession, table: TableT, chunk_indexes: list[int], run_id: str) -> SnapshotReport:
        started = time.monotonic()
        plan = self.plan(table)
        chunks = [plan.chunks[i] for i in chunk_indexes]
        attempt = f"{run_id}-{uuid.uuid4().hex[:8]}"
        staging_path = self.lake.table(table.qualified_name).staging
        what = (f"snapshot of table {table.qualified_name} (source {self.source.name!r}), chunks "
                f"{', '.join(str(c.index) for c in chunks)}")  # fmt: skip
        with driver_failure_named(what), self.dialect.window() as session:

            def read(start: WindowStart) -> dict[int, int]:
                driver_fault_point("snapshot.driver_killed_before_read", driver_process)
                return session.stage_chunks(spark, table, chunks, staging_path, attempt, start)

            windows = run_window(spark, self.lake, table.qualified_name, [c.index for c in chunks], attempt, session,
                                 read)  # fmt: skip
        return SnapshotReport(
            attempt=attempt,
            rows=sum(w.rows for w in windows),
            per_chunk={w.chunk: w.rows for w in windows},
            seconds=time.monotonic() - started,
            low_watermark=windows[0].low_watermark if windows else "",
            hw=windows[0].hw if windows else 0,
        )

    # -- ad-hoc snapshot of chosen rows ----------------------------------------------------------------------
    def rows_requests(self, requested: Sequence[tuple[str, object | None]]) -> list[tuple[TableT, RowFilter | None]]:
        """Every requested (table name, raw filter or None: every row) validated, before anything is read (module
        docstring; the waiting rows windows are ``refuse_waiting_rows``'s, which needs Spark); raises
        ``SnapshotRowsRefused``."""
        if not requested:
            raise SnapshotRowsRefused(f"source {self.source.name!r}: tables: name at least one table")
        names = [name for name, _ in requested]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise SnapshotRowsRefused(
                f"source {self.source.name!r}: tables: {', '.join(twice)} named more than once; give one entry per "
                "table (a filter's terms are all ANDed; for rows matching either of two filters, run the job twice)"
            )
        tables = self.tables
        validated: list[tuple[TableT, RowFilter | None]] = []
        for name, raw in requested:
            table = tables.get(name)
            if table is None:
                raise SnapshotRowsRefused(
                    f"source {self.source.name!r}: table {name!r} is not captured; captured: "
                    f"{', '.join(sorted(tables)) or 'none'}"
                )
            validated.append((table, None if raw is None else self.dialect.row_filter(table, raw)))
        return validated

    def refuse_waiting_rows(self, spark: SparkSession, names: Sequence[str]) -> None:
        """Raise ``SnapshotRowsRefused`` when a rows window of one of ``names`` waits for the stream (a new one would
        supersede it: its rows would never be applied)."""
        waiting = self.waiting_rows_windows(spark)
        for name in names:
            self._refuse_when_waiting(waiting, name)

    def waiting_rows_windows(self, spark: SparkSession) -> dict[str, ChunkWindow]:
        """Per table, its rows window that waits for the stream (``engine.windows.waiting_rows_windows``)."""
        since = {name: marker.position for name, marker in self.lake.resnapshot_markers().items()}
        return waiting_rows_windows(window_log.read_events(spark, self.lake.windows), since)

    def _refuse_when_waiting(self, waiting: Mapping[str, ChunkWindow], name: str) -> None:
        window = waiting.get(name)
        if window is not None:
            raise SnapshotRowsRefused(
                f"source {self.source.name!r}: table {name}: an ad-hoc snapshot of its rows (attempt "
                f"{window.attempt}, {window.rows} rows, high watermark {self.format_position(window.hw)}) waits for "
                "the stream to pass its high watermark; a new one would supersede it and its rows would never be "
                "applied. Run this again once the stream has reconciled it (the stream run's log names it)"
            )

    def snapshot_rows(
        self, spark: SparkSession, table: TableT, row_filter: RowFilter | None, run_id: str
    ) -> SnapshotReport:
        """Stage the rows of ``table`` matching ``row_filter`` (None: every row) in a rows window (module
        docstring). Refuses (``SnapshotRowsRefused``) while another rows window of the table waits."""
        started = time.monotonic()
        name = table.qualified_name
        self._refuse_when_waiting(self.waiting_rows_windows(spark), name)
        attempt = f"rows-{run_id}-{uuid.uuid4().hex[:8]}"
        staging_path = self.lake.table(name).staging
        what = f"ad-hoc snapshot of rows of table {name} (source {self.source.name!r})"
        with driver_failure_named(what), self.dialect.window() as session:

            def read(start: WindowStart) -> dict[int, int]:
                return {ROWS_CHUNK: session.stage_rows_matching(table, row_filter, staging_path, attempt)}

            windows = run_window(spark, self.lake, name, [ROWS_CHUNK], attempt, session, read)
        return SnapshotReport(
            attempt=attempt,
            rows=windows[0].rows,
            per_chunk={ROWS_CHUNK: windows[0].rows},
            seconds=time.monotonic() - started,
            low_watermark=windows[0].low_watermark,
            hw=windows[0].hw,
        )

    # -- a successor stream run's driver, warmed while its predecessor streams -----------------------------------
    def warm_up(
        self, spark: SparkSession, run_id: str, live_run_ids: set[str], still_waiting: Callable[[], bool],
        max_tables: int = WARM_UP_TABLES,
    ) -> WarmUp:  # fmt: skip
        """Rehearse the latest batch of the tables whose changelogs were written last (at most ``max_tables``) on
        shallow clones of their changelogs and mirrors (``cdc_assets.lake.warm_up``: same code, same columns, the
        real tables' state and files), and stop as soon as ``still_waiting()`` is False (the run in flight ended: a
        warm-up must never hold the stream back; in the demo on 2026-12-05 a warm-up of four tables under load took
        92 s, past its then 60-second lead). A table whose rehearsal fails is named in the result, not raised: a
        warm-up only saves time, and the batch then meets the error itself."""
        started = time.monotonic()
        warm = WarmUp()

        def last_written(name: str) -> float:
            entries = (LakePath(self.lake.table(name).changelog) / "_delta_log").entries()
            return max((entry.mtime or 0.0 for entry in entries), default=0.0)

        written = sorted(((last_written(name), name) for name in self.tables), reverse=True)
        with scratch_folder(self.lake, run_id, live_run_ids) as scratch:
            for index, (when, name) in enumerate(written[:max_tables]):
                if not when:
                    continue
                if not still_waiting():
                    break
                table = self.tables[name]
                try:
                    fields = self.dialect.spark_fields(table)
                    paths = self.lake.table(name)
                    if rehearse_batch(spark, scratch / str(index), paths, fields, table.key_columns, still_waiting):
                        warm.rehearsed.append(name)
                except Exception as error:  # named in the run's log by the caller
                    warm.failed[name] = failure_cause(error)
        warm.stopped = not still_waiting()
        warm.seconds = time.monotonic() - started
        return warm

    # -- streaming -------------------------------------------------------------------------------------------
    def stream_batch(self, spark: SparkSession, recorded: Offset | None, run_id: str) -> StreamReport:
        """One batch (see module docstring)."""
        started = time.monotonic()
        batch_id = f"{run_id}-{uuid.uuid4().hex[:8]}"
        self.lake.drop_spills()  # a killed batch's (SIGKILL, the OOM killer): the pool runs one batch at a time
        spill_dir = self.lake.spill_dir(batch_id)
        configured = self.configured_bounds()
        bounds = self.batch_bounds()
        if bounds.in_flight is not None:  # the previous batch's process died while it wrote the lake
            bounds = recover_in_flight(bounds)
        progress = BatchProgress()  # in flight is recorded once the read returned (nothing is written before it)
        try:
            report = self._stream_batch(spark, recorded, batch_id, spill_dir, bounds, progress, started)
        except BaseException as error:
            if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: not the batch's fault
                raise
            if isinstance(error, SourceError):
                raise  # the source refused or is unreachable: its message names the setting; nothing was written
            if isinstance(error, StagedRowsMismatch | PermanentBatchError) or self.dialect.is_permanent(error):
                self.store_bounds(bounds)  # no longer in flight, bounds unchanged: a smaller batch fails the same way
                raise  # its own message names the table and the fix
            cause = failure_cause(error)
            shrunk = after_failure(bounds, progress.changes, progress.bytes, cause)
            self.store_bounds(shrunk)
            raise StreamBatchError(
                describe_failure(self.source.name, progress, bounds, shrunk, cause, self.driver_memory(),
                                 self.dialect.describe())
            ) from error  # fmt: skip
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
    def bounds_path(self) -> LakePath:
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
        self.bounds_path.write_text(json.dumps(bounds.to_json()))

    def _stream_batch(
        self, spark: SparkSession, recorded: Offset | None, batch_id: str, spill_dir: LakePath, bounds: BatchBounds,
        progress: BatchProgress, started: float,
    ) -> StreamReport:  # fmt: skip
        settings = self.source.stream
        batch, newly_captured = self._read_batch(recorded, spill_dir, bounds)
        tables = self.tables
        if batch.resnapshot is not None:  # recorded before the offset is: a kill in between records it again
            for name in tables:
                self.lake.mark_resnapshot(name, batch.applied, batch.resnapshot)
        progress.changes, progress.bytes, progress.transactions = batch.changes, batch.bytes, batch.transactions
        progress.cut = batch.cut
        self.store_bounds(with_in_flight(bounds, batch.changes, batch.bytes))
        phases = {"read": time.monotonic() - started}
        per_table: dict[str, dict[str, int]] = {}
        unknown_keys: dict[str, list[tuple]] = {}
        try:
            progress.phase = "changelog"
            size_fault("stream.batch_over", batch.changes)
            metadata = {"source": self.source.name, "batch": batch_id, **batch.offset, "position": batch.applied}
            spark.conf.set(USER_METADATA, json.dumps(metadata))
            for name, spill in sorted(batch.tables.items()):
                if not spill.parts:
                    continue
                table = tables[name]
                paths = self.lake.table(name)
                progress.table = name
                big = spill.bytes > settings.spill_bytes
                conf = big_batch_conf(spill.bytes, spill.changes, bool(spill.unchanged_columns), settings.spill_bytes)
                with session_conf(spark, conf):
                    changes = spill.frame(spark)
                    # big values: kept on the local disk, not in the heap (the default level keeps what fits)
                    changes = changes.persist(StorageLevel.DISK_ONLY) if big else changes.cache()
                    try:
                        fields = self.dialect.spark_fields(table, spill.added_columns)
                        progress.phase, mark = "changelog", time.monotonic()
                        append_changelog(spark, paths.changelog, changes, batch.applied)
                        phases["changelog"] = phases.get("changelog", 0.0) + time.monotonic() - mark
                        fault_point("stream.after_changelog")
                        driver_fault_point("stream.driver_killed_after_changelog", driver_process)
                        progress.phase, mark = "merge", time.monotonic()
                        unknown = apply_changes(
                            spark, paths.mirror, changes, fields, table.key_columns, set(spill.unchanged_columns),
                            spill.truncate,
                        )  # fmt: skip
                        fault_point("stream.after_merge")
                        if unknown:
                            unknown_keys[name] = unknown
                        phases["merge"] = phases.get("merge", 0.0) + time.monotonic() - mark
                    finally:
                        _quietly(changes.unpersist)  # the JVM may be gone: keep the batch's own error
                per_table[name] = {
                    "changes": spill.changes, "bytes": spill.bytes, "spill_parts": spill.parts,
                    "truncates": spill.truncates,
                }  # fmt: skip
            progress.phase, progress.table = "reconcile", None
            mark = time.monotonic()
            reconciled, waiting, filled, rows_windows = self._reconcile_closed(spark, batch.applied)
            # keys still unknown after a fill window closed (their rows were replaced or touched meanwhile) get the next
            waiting += self._fill_unknown(spark, {**unknown_keys, **dict.fromkeys(filled)})
            phases["reconcile"] = time.monotonic() - mark
            fault_point("stream.after_lake_commit")
        finally:
            _quietly(lambda: spark.conf.unset(USER_METADATA))
            _quietly(spill_dir.rmtree)
        lag_seconds = None
        if batch.last_commit_ts is not None:
            lag_seconds = max(0.0, (datetime.now(UTC) - batch.last_commit_ts).total_seconds())
        return StreamReport(
            offset=batch.offset,
            changes=batch.changes,
            transactions=batch.transactions,
            seconds=time.monotonic() - started,
            lag_bytes=batch.lag_bytes,
            lag_seconds=lag_seconds,
            reconciled=reconciled,
            waiting_windows=waiting,
            per_table=per_table,
            phase_seconds={k: round(v, 3) for k, v in phases.items()},
            skipped_tables={t.qualified_name: f"{t.reason}; fix: {t.fix}" for t in self.skipped_tables},
            bytes=batch.bytes,
            resnapshot=batch.resnapshot,
            newly_captured=newly_captured,
            rows_windows=rows_windows,
        )

    def _read_batch(
        self, recorded: Offset | None, spill_dir: LakePath, bounds: BatchBounds
    ) -> tuple[ChangeBatch, list[str]]:
        """The dialect's batch, read with the tables resolved again as often as it meets a table the source captures
        now that the run did not (``CapturedTablesChanged``: nothing of the attempt is kept); the names of those."""
        newly_captured: list[str] = []
        for _ in range(RESOLVE_AGAIN_LIMIT):
            until = None
            if self.streams_only_for_windows:
                until = max([*self._open_window_high_watermarks(), *self.lake.check_markers()], default=0)
            arguments = (recorded, self.tables, spill_dir, bounds.max_changes, bounds.max_bytes)
            try:
                if until is None:
                    return self.dialect.read_batch(*arguments), newly_captured
                return self.dialect.read_batch(*arguments, until=until), newly_captured  # type: ignore[call-arg]
            except CapturedTablesChanged as changed:
                _quietly(spill_dir.rmtree)
                before = set(self.tables)
                self.prepare()
                newly_captured += sorted(set(self.tables) - before)
                if not set(changed.names) <= set(self.tables):
                    raise PermanentBatchError(
                        f"source {self.source.name!r}: the stream met changes of {', '.join(changed.names)}, which "
                        "the source would capture now, but resolving the tables again did not capture them "
                        f"(captured: {', '.join(sorted(self.tables)) or 'none'}); nothing of the batch was applied"
                    ) from changed
        raise PermanentBatchError(
            f"source {self.source.name!r}: the captured tables changed {RESOLVE_AGAIN_LIMIT} times while one stream "
            "batch was read; nothing of the batch was applied, the next run tries again"
        )

    @property
    def streams_only_for_windows(self) -> bool:
        """``startup_mode: snapshot`` over a dialect that bounds its reads: batches go only as far as the staged
        windows and waiting checks need (the streaming sensor launches them only then)."""
        return self.source.startup_mode == "snapshot" and bool(getattr(self.dialect, "bounded_reads", False))

    def _fill_unknown(self, spark: SparkSession, wanted: dict[str, list[tuple] | None]) -> int:
        """Open a fill window per table of ``wanted`` (table -> keys of its mirror rows with unknown values; None:
        look them up in the mirror) unless the table has one open already (its reconciliation comes first; keys
        still unknown then get the next one). The number of windows opened.

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
            if not keys:
                continue
            attempt = f"fill-{uuid.uuid4().hex[:12]}"
            with self.dialect.window() as session:
                found = keys

                def read(start, session=session, table=table, found=found, staging=paths.staging, attempt=attempt):
                    return {FILL_CHUNK: session.stage_rows_by_key(table, found, staging, attempt)}

                run_window(spark, self.lake, name, [FILL_CHUNK], attempt, session, read)
            opened += 1
        return opened

    def _reconcile_closed(
        self, spark: SparkSession, applied: int
    ) -> tuple[list[dict[str, object]], int, set[str], list[dict[str, object]]]:
        """Reconcile the windows the stream has passed: the chunks reconciled, the windows still open, the tables
        whose fill window was reconciled, and the rows windows reconciled (ad-hoc snapshots of chosen rows)."""
        log_read_at = time.time()
        # the snapshot runs' staged events into the table, and every event, from one read of the log
        # (folded into the table with the first record below: one commit fewer)
        pending_staged = window_log.pending_staged(spark, self.lake.windows)
        events = list(pending_staged.events)
        unrecorded = pending_staged.new
        pending = open_windows(events)
        since = {name: marker.position for name, marker in self.lake.resnapshot_markers().items()}
        stale = read_before(pending, since)  # read before changes the source lost: never applied
        ready = closable([w for w in pending if w not in stale], applied)
        done: list[dict[str, object]] = []
        filled: set[str] = set()
        rows_windows: list[dict[str, object]] = []
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
                    spark, paths.mirror, paths.changelog, paths.staging, self.dialect.spark_fields(table),
                    table.key_columns, windows, chunks, self.dialect.settled_rule,
                )  # fmt: skip
            counts = {(r.table, r.chunk): (r.kept, r.dropped, r.deleted) for r in results}
            window_log.record(spark, self.lake.windows, RECONCILED, windows, counts, staged=unrecorded)
            unrecorded = []
            events += [WindowEvent(RECONCILED, w) for w in windows]
            for r in results:
                if r.chunk == FILL_CHUNK:  # not a chunk of the table's asset
                    filled.add(r.table)
                    continue
                if r.chunk == ROWS_CHUNK:  # an ad-hoc snapshot of chosen rows: nothing is deleted by it
                    attempt = next(w.attempt for w in windows if w.chunk == ROWS_CHUNK)
                    rows_windows.append(
                        {"table": r.table, "attempt": attempt, "event": RECONCILED, "kept": r.kept,
                         "dropped": r.dropped}
                    )  # fmt: skip
                    continue
                done.append(
                    {"table": r.table, "chunk": r.chunk, "event": RECONCILED, "kept": r.kept, "dropped": r.dropped,
                     "deleted": r.deleted}
                )  # fmt: skip
        window_log.record(spark, self.lake.windows, STAGED, unrecorded)  # none when folded above
        pending_staged.drop_files()
        for name, position in sorted(since.items()):
            table = self.tables.get(name)
            chunks = [] if table is None else [c.index for c in self.plan(table).chunks]
            if table is not None and resnapshot_done(events, name, chunks, position):
                self.lake.clear_resnapshot(name, position)
        still_open = [w for w in pending if w not in ready and w not in stale]  # a stale one waits for no batch
        markers = self.lake.waiting_markers()
        for window in still_open:
            if markers.get((window.table, window.chunk)) != window.hw:
                self.lake.mark_waiting(window.table, window.chunk, window.hw)
        # reconciled chunks' markers too, only if written before the log was read: one written since may be another
        # window of the same chunk, staged after the read (a backfill's and a planner's run of one chunk), which no
        # later batch would be asked for on an idle source
        self.lake.clear_stale_markers({(w.table, w.chunk) for w in still_open}, older_than=log_read_at)
        return done, len(still_open), filled, rows_windows

    # -- what the source answers -----------------------------------------------------------------------------
    def partitions(self, table: TableT) -> list[str]:
        return self.dialect.partitions(table)

    def column_names(self, table: TableT) -> list[str]:
        return self.dialect.column_names(table)

    def filled_without_changes(self, table: TableT, names: Sequence[str]) -> list[str]:
        return self.dialect.filled_without_changes(table, names) if names else []

    def check_chunks(
        self, spark: SparkSession, table: TableT, indexes: Sequence[int], wait_seconds: float = 120
    ) -> list[ChunkCheck]:
        """Count and checksum of ``indexes``' key ranges, at the source and over the mirror
        (``cdc_assets.consistency``, with the dialect's source half)."""
        marker = self.lake.resnapshot_markers().get(table.qualified_name)
        if marker is not None:
            reason = (
                f"every chunk of {table.qualified_name} is to be read again after "
                f"{self.format_position(marker.position)} and not all are yet: {marker.reason}"
            )
            return [ChunkCheck(table.qualified_name, i, False, False, reason=reason) for i in indexes]
        plan = self.plan(table)
        chunks = [plan.chunks[i] for i in indexes]
        return check_chunks(spark, self.lake, self.dialect, table, chunks, wait_seconds)

    def lag(self) -> SourceLag:
        return self.dialect.lag()

    def position(self, offset: Offset) -> int:
        """The ordered position of a recorded offset."""
        return self.dialect.position(offset)

    def format_position(self, position: int) -> str:
        return self.dialect.format_position(position)

    def validate_offset(self, requested: Mapping[str, str]) -> dict[str, object]:
        return self.dialect.validate_offset(requested)

    def pending_work(self, lag: SourceLag | None = None) -> str | None:
        """Why a stream batch is due now, or None: the source's own reason (changes wait; it keeps too much for us),
        or a staged window's high watermark is at or below the source's current position (it can close), or a
        consistency check waits for the stream to pass its high watermark (only until the acknowledged position
        passed it: the check then compares while its marker stays, and a long-lived run used to read an empty batch
        every poll meanwhile, a materialization each). A staged window counts whether its chunk has a waiting marker
        or only its staged file (its run killed before the marker). Reads no Delta table (markers and staged files
        are plain files): cheap enough for a sensor. ``lag``: one the caller just took."""
        reason, position = self.dialect.pending(lag)
        if reason is not None:
            return reason
        if any(hw <= position for hw in self._open_window_high_watermarks()):
            return "a chunk window can close"
        acknowledged = self.lake.acknowledged()
        if any(hw <= position and (acknowledged is None or acknowledged < hw) for hw in self.lake.check_markers()):
            return "a consistency check waits for the stream"
        return None

    def _open_window_high_watermarks(self) -> list[int]:
        """The high watermarks the stream must pass to close a staged window: the waiting markers' and the staged
        files' (``window_log.staged_high_watermarks``; a run killed between recording its window and marking its
        chunks waiting leaves a window only its file names, until a batch folds it and marks it). Plain files."""
        return [*self.lake.waiting_markers().values(), *window_log.staged_high_watermarks(self.lake.windows)]

    def acknowledge(self, offset: Offset) -> int:
        """Let the source forget changes up to ``offset`` (only forward). Call only after ``offset`` is recorded
        (by a batch or by the ``change_offset`` job). The offset's position is then written to the lake
        (``SourceLake.record_acknowledged``), also when it is behind the one written before (``change_offset``
        moved the stream back): every change at or below it is applied, which a consistency check waits for."""
        held = self.dialect.acknowledge(offset)
        self.lake.record_acknowledged(self.dialect.position(offset))
        return held
