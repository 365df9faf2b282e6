"""The source interface: what the Dagster glue, the consistency checks and the torture harness ask of a source.

Contract: a ``CdcSource`` mirrors the captured tables (or collections) of one source database into one lake
(``SourceLake``), without writing to the source. Everything database-specific stays behind these operations; the
engine (chunks, watermark windows, reconciliation, offsets) and the lake code are shared.

- ``prepare()`` checks the source's permissions, resolves the captured tables, and makes sure the change-capture
  resources exist before any snapshot window opens (PostgreSQL: publication and replication slot). ``tables`` is
  ``prepare()``'s result, resolved once per object. A selected table that cannot be captured never fails it: it is
  left out and listed by ``skipped()`` with its reason and fix (and in every ``StreamReport.skipped_tables``).
- ``plan(table)`` is the table's chunk plan: planned and stored on first use, immutable afterwards.
- ``snapshot(spark, table, chunk_indexes, run_id)`` reads the chunks inside one watermark window and stages them;
  the stream reconciles them once it has passed the window (DESIGN.md).
- ``stream_batch(spark, recorded, run_id)`` applies one bounded batch of changes after the recorded offset (the
  mapping of field names to values the stream asset's metadata holds; None before the first) and returns the
  batch's offset; it never acknowledges anything at the source. The caller records the offset, then calls
  ``acknowledge`` with it. An offset's fields are the source kind's (Debezium's names: PostgreSQL ``lsn``,
  ``lsn_commit``, ...; MongoDB ``sec``, ``ord``, ``resume_token``); ``position(offset)`` is its ordered integer
  position (PostgreSQL: the LSN), the order of ``_cdc_position`` and of window high watermarks.
- ``acknowledge(offset)`` lets the source forget changes up to a recorded offset (PostgreSQL: the slot moves
  forward; a source that keeps no server-side state for us has nothing to do) and returns the position the source
  now holds. ``validate_offset(fields)`` checks an offset a user asks for (the ``change_offset`` job) and returns
  the offset to record, or raises ``cdc_assets.dialect.OffsetError`` naming the field and the allowed values.
- ``pending_work(lag)`` says why a batch is due now, or None; cheap enough for a sensor that runs every few seconds
  (``lag``: a ``lag()`` the caller just took, so the source is asked once).
- ``lag()`` is the stream's lag at the source (``SourceLag``), whether or not batches succeed: the streaming
  sensor records it on every tick.
- ``column_names(table)`` are the table's columns as ``prepare()`` described them, and
  ``filled_without_changes(table, names)`` the ones of ``names`` (columns added since the caller last looked) whose
  values in rows written before can differ from NULL although no change carried them (PostgreSQL: a column added
  with a ``DEFAULT``, or generated: the catalog says ``atthasmissing`` or ``atthasdef``). Those rows' chunks must be
  read again; the planner sensor requests it.
- ``partitions(table)`` names the table's partitions now (PostgreSQL: leaf partitions of a partitioned table; none
  otherwise). Attaching or detaching one changes the table's rows without a change in the log: the planner sensor
  then requests a snapshot of every chunk.
- ``rows_requests(requested)`` validates an ad-hoc snapshot of chosen rows (tables and filters,
  ``cdc_assets.engine.row_filter``) before anything is read, ``refuse_waiting_rows(spark, names)`` refuses one while
  another of the same table waits for the stream, and ``snapshot_rows(spark, table, row_filter, run_id)`` stages
  the matching rows in a watermark window of their own; the stream reconciles them (upserts; never deletes).
- ``check_chunks(spark, table, indexes, wait_seconds)`` compares row count and checksum of chunks, computed at the
  source and over the mirror, at a consistent point (``cdc_assets.consistency``, written once; the source half
  from the dialect).

``open_source(config, source)`` (the registry, ``sources/__init__.py``) returns the implementation for
``source.kind``: the generic ``cdc_assets.pipeline.CdcPipeline`` over the kind's dialect (``cdc_assets.dialect``).
(Not ``runtime_checkable``: an ``isinstance`` check would read ``tables`` and so connect to the source.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from cdc_assets.config import SourceConfig
from cdc_assets.engine.chunks import ChunkPlan
from cdc_assets.engine.row_filter import RowFilter
from cdc_assets.lake.layout import SourceLake

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_assets.lake.warm_up import WarmUp


class CapturedTableLike(Protocol):
    """What the shared code reads of a captured table or collection."""

    @property
    def qualified_name(self) -> str: ...

    @property
    def key_columns(self) -> tuple[str, ...]: ...


class SkippedTableLike(Protocol):
    """A selected table or collection that is not captured, and why."""

    @property
    def qualified_name(self) -> str: ...

    reason: str
    fix: str

    @property
    def message(self) -> str: ...


TableT = TypeVar("TableT", bound=CapturedTableLike)


class SourceError(RuntimeError):
    """The source cannot be used as configured (refused, unreachable, a table it cannot capture); the message says
    why and what would fix it, and never holds a credential."""


class PermanentBatchError(RuntimeError):
    """A stream batch that a smaller batch would fail the same way (an incompatible schema change): the stream stops
    with the bounds unchanged; the message names the table and the fix."""


class CapturedTablesChanged(Exception):
    """A stream batch met a table its run does not capture but that the source would capture now (created, or newly
    readable or selected, while the run was in flight): the dialect read nothing of the batch into the lake and the
    offset stays. The pipeline resolves the tables again and reads the batch again, so the new table's changes are
    applied instead of left behind (the offset would move past them)."""

    def __init__(self, names: Sequence[str]) -> None:
        super().__init__(f"newly captured: {', '.join(names)}")
        self.names = list(names)


@dataclass
class SnapshotReport:
    """One snapshot run: the attempt id, rows staged per chunk, and its window (low watermark as text, high
    watermark position)."""

    attempt: str
    rows: int
    per_chunk: dict[int, int]
    seconds: float
    low_watermark: str
    hw: int


@dataclass
class StreamReport:
    """One stream batch: the offset to record (field names of Debezium's offsets, DDD-4), counts, lag, the chunks
    it reconciled, the seconds of its phases, the bytes of changes it held and the bounds it was read with
    (``max_changes``, ``max_bytes``, ``shrunk`` after failed batches, the next batch's bounds). ``resnapshot``: the
    source lost the changes between the recorded offset and this batch's (MongoDB's history lost, with
    ``on_history_lost: resnapshot``): why, and that every chunk of every captured table is to be read again."""

    offset: dict[str, object]
    changes: int
    transactions: int
    seconds: float
    lag_bytes: int
    lag_seconds: float | None
    reconciled: list[dict[str, object]] = field(default_factory=list)
    waiting_windows: int = 0
    per_table: dict[str, dict[str, int]] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # selected tables that are not captured (their changes are not applied): name -> reason and fix
    skipped_tables: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    bounds: dict[str, object] = field(default_factory=dict)
    resnapshot: str | None = None
    # tables the run captured from this batch on (created or selected while it was in flight)
    newly_captured: list[str] = field(default_factory=list)
    # ad-hoc snapshots of chosen rows reconciled by this batch: table, attempt, kept and dropped rows
    rows_windows: list[dict[str, object]] = field(default_factory=list)


@dataclass
class ChunkCheck:
    """One chunk's consistency check: row count and checksum at the source and over the mirror (``conclusive``
    False when the stream did not pass the check's high watermark in time: ``reason`` says why)."""

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


@dataclass(frozen=True)
class SourceLag:
    """How far the lake is behind the source: ``lag_bytes`` of change log the source keeps for us (PostgreSQL: the
    server's flush LSN minus the slot's confirmed position), ``lag_seconds`` since the oldest change not yet applied
    was committed (0 when none waits), and whether a change waits at all."""

    lag_bytes: int
    lag_seconds: float
    changes_waiting: bool


class CdcSource(Protocol[TableT]):
    source: SourceConfig
    lake: SourceLake

    @property
    def tables(self) -> Mapping[str, TableT]: ...

    def prepare(self) -> Mapping[str, TableT]: ...

    def skipped(self) -> Sequence[SkippedTableLike]: ...

    def plan(self, table: TableT) -> ChunkPlan: ...

    def snapshot(self, spark: SparkSession, table: TableT, chunk_indexes: list[int], run_id: str) -> SnapshotReport: ...

    def stream_batch(self, spark: SparkSession, recorded: Mapping[str, object] | None, run_id: str) -> StreamReport: ...

    def warm_up(
        self, spark: SparkSession, run_id: str, live_run_ids: set[str], still_waiting: Callable[[], bool]
    ) -> WarmUp: ...

    def acknowledge(self, offset: Mapping[str, object]) -> int: ...

    def position(self, offset: Mapping[str, object]) -> int: ...

    def format_position(self, position: int) -> str: ...

    def validate_offset(self, requested: Mapping[str, str]) -> dict[str, object]: ...

    def pending_work(self, lag: SourceLag | None = None) -> str | None: ...

    def lag(self) -> SourceLag: ...

    def column_names(self, table: TableT) -> list[str]: ...

    def partitions(self, table: TableT) -> list[str]: ...

    def filled_without_changes(self, table: TableT, names: Sequence[str]) -> list[str]: ...

    def check_chunks(
        self, spark: SparkSession, table: TableT, indexes: Sequence[int], wait_seconds: float = 120
    ) -> list[ChunkCheck]: ...

    def rows_requests(
        self, requested: Sequence[tuple[str, object | None]]
    ) -> list[tuple[TableT, RowFilter | None]]: ...

    def refuse_waiting_rows(self, spark: SparkSession, names: Sequence[str]) -> None: ...

    def snapshot_rows(
        self, spark: SparkSession, table: TableT, row_filter: RowFilter | None, run_id: str
    ) -> SnapshotReport: ...
