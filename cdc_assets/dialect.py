"""What one database kind supplies to the generic pipeline (``cdc_assets.pipeline``): a narrow dialect.

Contract: a ``SourceDialect`` answers only what differs between databases (Flink CDC's ``DataSourceDialect``); the
window sequence, staging, the window log, reconciliation, changelog and mirror writes, batch bounds, failure
messages, waiting markers and pending work are written once in ``cdc_assets.pipeline``. A dialect never writes to
its source (PostgreSQL's slot and publication are created by ``discover`` only where allowed, and the slot moves
only in ``acknowledge``).

- ``discover()``: the captured tables (``CapturedTableLike``) and the selected ones that cannot be captured, each
  with reason and fix. The change-capture resources exist when it returns (no change is missed after it).
- ``plan_chunks(table)``: the table's chunk plan (the pipeline stores it once and never re-plans).
- ``window()``: a context manager giving a ``WindowSession``: one session of the source whose two watermarks order
  its reads (``cdc_assets.lake.watermark_window``); ``stage_chunks`` reads chunks (in Spark tasks where it can) into
  staged files of an attempt (``cdc_assets.lake.staging``, rows typed by the table's Arrow schema ending with
  ``_cdc_unrepresentable``) and returns the rows per chunk; ``stage_rows_by_key`` reads the rows of some keys (a fill
  window) into one staged file of chunk ``FILL_CHUNK``; ``stage_rows_matching`` reads the rows matching a
  ``RowFilter`` (None: every row; an ad-hoc snapshot of chosen rows) into one staged file of chunk ``ROWS_CHUNK``,
  with the filter applied by the source (never as text pasted into a query).
- ``row_filter(table, raw)``: the filter ``raw`` validated for ``table`` (``cdc_assets.engine.row_filter``, against
  the table's columns, or as document field paths), and checked to be one the source can apply (PostgreSQL: each
  value casts to its column's type and the comparison exists; MongoDB: typed values decode to a BSON scalar); raises
  ``RowFilterError`` naming the table, the term, the field and the allowed values. Reads nothing of the table's rows
  and writes nothing.
- ``read_batch(recorded, spill_dir, max_changes, max_bytes)``: one bounded batch of changes after the recorded
  offset (``None``: from where the source holds changes for us), spilled under ``spill_dir`` (``ChangeBatch``). It
  stops at a transaction boundary; a single transaction larger than a bound is read whole. It may first make the
  source forget what the recorded offset covers (it was recorded, so it is applied), never more. A dialect whose
  ``bounded_reads`` is True also takes ``until``: no change after that position is read (``startup_mode:
  snapshot``: the stream goes only as far as the staged windows and waiting checks need). When the source no longer
  holds the changes after the recorded offset and the source is configured to re-snapshot then, the batch holds no
  change, its offset is the source's current position and ``resnapshot`` says why: the pipeline then records that
  every chunk of every captured table must be read again after that position (``SourceLake.mark_resnapshot``).
- ``position(offset)``: the ordered integer position of a recorded offset (``_cdc_position`` of the changes it
  covers); ``format_position(position)``: its text for people (PostgreSQL: ``X/Y``).
- ``acknowledge(offset)`` lets the source forget changes up to a recorded offset and returns the position the
  source now holds; ``validate_offset(fields)`` checks a requested offset (the ``change_offset`` job) and returns
  the offset to record, or raises ``OffsetError`` naming the field and the allowed values.
- ``pending(lag)``: why the source itself wants a batch (changes wait, or the source keeps too much for us), or None,
  and the source's current position (a window or check marker at or below it can close); ``lag()``: ``SourceLag``.
- ``settled_rule``: what "settled at the low watermark" means over the changelog (``cdc_assets.lake.settled``).
- ``spark_fields(table, added)``: the Spark fields of the table's columns, with columns a batch found added.
- ``column_names``, ``partitions``, ``filled_without_changes``: as in ``cdc_assets.source``.
- ``check_session()``: the source half of a consistency check (``CheckSession``; the check itself is
  ``cdc_assets.consistency``).
- ``is_permanent(error)``: an error a smaller batch would repeat (the pipeline keeps the bounds and re-raises it).
- ``describe()``: a few words for messages (e.g. "replication slot 'cdc_demo'").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from cdc_assets.engine.chunks import Chunk, ChunkPlan
from cdc_assets.engine.row_filter import RowFilter
from cdc_assets.engine.windows import WindowStart
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.settled import SettledRule
from cdc_assets.source import SkippedTableLike, SourceLag, TableT

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql import types as T

Offset = Mapping[str, object]


class OffsetError(ValueError):
    """A requested offset that the source cannot take; the message names the field and the allowed values."""


@dataclass
class TableChanges:
    """One table's changes of a batch. ``frame(spark)`` reads them as changelog rows: ``_cdc_op`` (``c``, ``u``,
    ``d``, ``t`` for a truncate), ``_cdc_position`` (the transaction's position), ``_cdc_seq`` (order inside it),
    ``_cdc_ts``, ``_cdc_before_key_only``, ``_cdc_unchanged`` (names of columns whose value the change did not carry),
    ``after`` and ``before`` (structs of the table's Spark fields and ``_cdc_unrepresentable``) and the columns of the
    source's ``SettledRule``. ``truncate``: the batch's last truncate of the table as (position, seq)."""

    changes: int
    bytes: int
    parts: int
    frame: Callable[[SparkSession], DataFrame]
    unchanged_columns: set[str] = field(default_factory=set)
    added_columns: Sequence[object] = ()
    truncate: tuple[int, int] | None = None
    truncates: int = 0


@dataclass
class ChangeBatch:
    """One bounded batch: every change at or before ``applied`` (a position) that the source holds for us is in this
    batch or an earlier one. ``offset``: what to record (field names of Debezium's offsets). ``cut``: a bound cut the
    batch (more was waiting). ``lag_bytes``: how much the source holds after it. ``resnapshot``: the changes between
    the recorded offset and ``applied`` are lost at the source (the batch holds none of them): every chunk of every
    captured table must be read again in windows after ``applied``; the text says why."""

    applied: int
    offset: dict[str, object]
    tables: dict[str, TableChanges]
    changes: int
    transactions: int
    bytes: int
    cut: bool
    last_commit_ts: datetime | None
    lag_bytes: int
    resnapshot: str | None = None


class WindowSession(Protocol[TableT]):
    """One source session of a watermark window."""

    def low_watermark(self) -> tuple[int, str]: ...

    def high_watermark(self) -> int: ...

    def stage_chunks(
        self,
        spark: SparkSession,
        table: TableT,
        chunks: Sequence[Chunk],
        staging_path: str,
        attempt: str,
        start: WindowStart,
    ) -> dict[int, int]: ...

    def stage_rows_by_key(self, table: TableT, keys: Sequence[tuple], staging_path: str, attempt: str) -> int: ...

    def stage_rows_matching(
        self, table: TableT, row_filter: RowFilter | None, staging_path: str, attempt: str
    ) -> int: ...


class CheckSession(Protocol[TableT]):
    """The source half of one consistency check (``cdc_assets.consistency``), and the mirror-side expressions that
    compute alike. ``summaries``, ``summary_of_keys``, ``key_digests`` and ``row_texts`` read one consistent view of
    the source, taken after ``low_watermark()`` and before ``high_watermark()``, kept until the session ends. A row's
    digest is a signed 64-bit integer; ``mirror_row_digest`` gives the same for a mirror row holding that row, and
    ``mirror_key_text`` / ``mirror_column_texts`` (aliased by column name) spell keys and columns as the source
    does (``with_unrepresentable`` False: over a frame of key columns only)."""

    def low_watermark(self) -> str: ...

    def current_table(self, table: TableT) -> TableT: ...

    def summaries(self, table: TableT, chunks: Sequence[Chunk]) -> list[tuple[int, int]]: ...

    def high_watermark(self) -> int: ...

    def summary_of_keys(self, table: TableT, chunk: Chunk, key_texts: list[str]) -> tuple[int, int]: ...

    def key_digests(self, table: TableT, chunk: Chunk) -> list[tuple[str, int]]: ...

    def row_texts(self, table: TableT, chunk: Chunk, key_text: str) -> dict[str, str | None] | None: ...

    def mirror_row_digest(self, table: TableT) -> Column: ...

    def mirror_key_text(self, table: TableT, with_unrepresentable: bool) -> Column: ...

    def mirror_column_texts(self, table: TableT) -> list[Column]: ...


class SourceDialect(Protocol[TableT]):
    settled_rule: SettledRule

    def describe(self) -> str: ...

    def discover(self) -> tuple[Sequence[TableT], Sequence[SkippedTableLike]]: ...

    def plan_chunks(self, table: TableT) -> ChunkPlan: ...

    def row_filter(self, table: TableT, raw: object) -> RowFilter: ...

    def window(self) -> AbstractContextManager[WindowSession[TableT]]: ...

    def read_batch(
        self,
        recorded: Offset | None,
        tables: Mapping[str, TableT],
        spill_dir: LakePath,
        max_changes: int,
        max_bytes: int,
    ) -> ChangeBatch: ...

    def position(self, offset: Offset) -> int: ...

    def format_position(self, position: int) -> str: ...

    def acknowledge(self, offset: Offset) -> int: ...

    def validate_offset(self, requested: Mapping[str, str]) -> dict[str, object]: ...

    def pending(self, lag: SourceLag | None) -> tuple[str | None, int]: ...

    def lag(self) -> SourceLag: ...

    def spark_fields(self, table: TableT, added: Sequence[object] = ()) -> list[T.StructField]: ...

    def column_names(self, table: TableT) -> list[str]: ...

    def partitions(self, table: TableT) -> list[str]: ...

    def filled_without_changes(self, table: TableT, names: Sequence[str]) -> list[str]: ...

    def check_session(self) -> AbstractContextManager[CheckSession[TableT]]: ...

    def is_permanent(self, error: BaseException) -> bool: ...
