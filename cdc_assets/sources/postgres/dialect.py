"""``PostgresDialect``: what PostgreSQL answers to the generic pipeline (``cdc_assets.dialect.SourceDialect``).

Contract:
- ``discover()`` checks the role (``REPLICATION``), resolves the captured tables, makes sure the publication covers
  them and the slot exists (created only when missing and allowed; otherwise ``SourceError`` with the statement an
  administrator can run). The slot exists before any snapshot window opens, so no change is ever missed.
- ``window()``: one connection; the low watermark is ``pg_current_snapshot()`` (with the WAL insert position just before
  it), the high watermark the WAL insert position after the reads (``PostgresWatermarks``). Chunk reads run as parallel
  sub-ranges in Spark tasks (psycopg ``COPY`` into Arrow inside each task, ``lake.tasks.map_in_tasks``; each task writes
  its rows as a staged Parquet file), with the columns the table has after the low watermark (a column added after the
  run described the table and set by a transaction settled at the low watermark is in the rows the reads see; else
  staged without it and reconciled as NULL over the stream's value: a lost update). A fill window reads rows by key in
  the driver, 1,000 keys per statement; an ad-hoc snapshot of chosen rows (a rows window) reads the rows matching its
  filter with one ``COPY`` in the driver (``snapshot.rows_matching_select``).
- ``row_filter(table, raw)``: the filter validated against the table's columns, composed
  (``snapshot.filter_condition``) and tried once with ``limit 0`` (no row is read): a value that does not cast to
  its column's type, or a comparison the type lacks (``json = json``), raises ``RowFilterError`` with PostgreSQL's
  words, before any window opens.
- ``read_batch`` first moves the slot up to a recorded offset it has not followed yet (the offset was recorded, so
  its changes are applied; ``change_offset`` records one too), then peeks one bounded batch
  (``cdc_assets.sources.postgres.stream``). The offset has Debezium's PostgreSQL fields: ``lsn`` (every transaction
  whose commit ends at or before it is applied), ``lsn_commit``, ``lsn_proc``, ``txId``, ``ts_usec``, plus ``slot``
  and ``publication``. A change's ``_cdc_position`` is its commit's end LSN.
- ``acknowledge(offset)`` moves the slot to the offset's ``lsn`` (only forward); ``validate_offset`` takes ``lsn``
  in ``X/Y`` form, not behind the slot's ``confirmed_flush_lsn``, not ahead of the server's flush LSN.
- ``pending`` / ``lag``: the slot holds a change for the publication, or lags the server's flush LSN by more than
  ``max_lag_bytes`` (advancing it lets the server recycle WAL while the captured tables are idle and others are
  busy); the current position is the server's flush LSN.
- ``check_session`` is the source half of a consistency check (``cdc_assets.sources.postgres.consistency``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
from psycopg import sql

from cdc_assets.config import PostgresConnection, SourceConfig
from cdc_assets.dialect import ChangeBatch, Offset, OffsetError, TableChanges
from cdc_assets.engine.chunks import Chunk, ChunkPlan
from cdc_assets.engine.row_filter import RowFilter, RowFilterError, parse_row_filter
from cdc_assets.engine.windows import FILL_CHUNK, ROWS_CHUNK, WindowStart
from cdc_assets.lake import staging
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.tasks import map_in_tasks
from cdc_assets.source import PermanentBatchError, SourceLag
from cdc_assets.sources.postgres import catalog, snapshot, stream
from cdc_assets.sources.postgres.catalog import CapturedTable, SkippedTable
from cdc_assets.sources.postgres.connection import connect
from cdc_assets.sources.postgres.consistency import PostgresCheckSession, check_session
from cdc_assets.sources.postgres.lsn import format_lsn, parse_lsn
from cdc_assets.sources.postgres.pg_values import PgColumn, arrow_schema, copy_query_to_arrow, spark_schema
from cdc_assets.sources.postgres.watermark import PostgresSettledRule

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql import types as T


SETTLED_RULE = PostgresSettledRule()


def validate_postgres_offset(requested: str, confirmed_flush: int, server_flush: int) -> int:
    """The LSN of a requested offset: ``X/Y`` form, inside [slot's confirmed flush, server's flush]."""
    try:
        lsn = parse_lsn(requested)
    except ValueError as error:
        raise OffsetError(f"lsn: {error}") from None
    if not confirmed_flush <= lsn <= server_flush:
        raise OffsetError(
            f"lsn: {requested} is outside the allowed range [{format_lsn(confirmed_flush)}, {format_lsn(server_flush)}]"
            " (not behind the slot's confirmed_flush_lsn, not ahead of the server's WAL)"
        )
    return lsn


RANGE_COLUMNS = (("chunk", "int"), ("part", "int"), ("lo", "string"), ("hi", "string"))


def _range_stager(
    connection: PostgresConnection, source_name: str, table: CapturedTable, staging_path: str, attempt: str,
    start: WindowStart,
):  # fmt: skip
    """The Arrow batch mapper of a chunk read (``cdc_assets.lake.tasks.map_in_tasks``): one ``COPY`` per sub-range
    row, typed by the shared codec and written as one staged file; yields (chunk, rows) per sub-range."""
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
                    rows = staging.write_part(
                        staging_path, attempt, item["chunk"], item["part"], tables, schema, start, table.key_columns
                    )
                    yield pa.RecordBatch.from_arrays(
                        [pa.array([item["chunk"]], pa.int32()), pa.array([rows], pa.int64())], names=["chunk", "rows"]
                    )
        finally:
            conn.close()

    return read


class PostgresWindow(snapshot.PostgresWatermarks):
    """A watermark window's session: its watermarks and its reads on one connection (``WindowSession``)."""

    def __init__(self, conn: psycopg.Connection, source: SourceConfig) -> None:
        super().__init__(conn)
        self.source = source

    def stage_chunks(
        self, spark: SparkSession, table: CapturedTable, chunks: Sequence[Chunk], staging_path: str, attempt: str,
        start: WindowStart,
    ) -> dict[int, int]:  # fmt: skip
        """Read ``chunks`` in parallel sub-ranges (one Spark task each) into staged files of ``attempt``; the rows
        staged per chunk. Returns when every read has finished."""
        current = catalog.with_current_columns(self.conn, table)  # after the low watermark (module docstring)
        ranges = []
        for chunk in chunks:
            observed_max = snapshot.max_integer_key(self.conn, current) if chunk.hi is None else None
            parts = snapshot.sub_ranges(current, chunk, self.source.read_parallelism, observed_max)
            for number, part in enumerate(parts):
                ranges.append(
                    (chunk.index, number, None if part.lo is None else json.dumps(part.lo),
                     None if part.hi is None else json.dumps(part.hi))
                )  # fmt: skip
        stager = _range_stager(self.source.connection, self.source.name, current, staging_path, attempt, start)
        counts = dict.fromkeys((c.index for c in chunks), 0)
        for row in map_in_tasks(spark, ranges, RANGE_COLUMNS, stager, "chunk int, rows long"):
            counts[row["chunk"]] += row["rows"]
        return counts

    def stage_rows_by_key(self, table: CapturedTable, keys: Sequence[tuple], staging_path: str, attempt: str) -> int:
        readable = catalog.with_current_columns(self.conn, table)
        columns = list(readable.columns)
        parts = (
            part
            for start in range(0, len(keys), 1000)
            for part in copy_query_to_arrow(
                self.conn, snapshot.rows_by_key_select(readable, list(keys[start : start + 1000])), columns
            )
        )
        return staging.write_part(staging_path, attempt, FILL_CHUNK, 0, parts, arrow_schema(columns))

    def stage_rows_matching(
        self, table: CapturedTable, row_filter: RowFilter | None, staging_path: str, attempt: str
    ) -> int:
        readable = catalog.with_current_columns(self.conn, table)
        columns = list(readable.columns)
        parts = copy_query_to_arrow(self.conn, snapshot.rows_matching_select(readable, row_filter), columns)
        return staging.write_part(staging_path, attempt, ROWS_CHUNK, 0, parts, arrow_schema(columns))


def _changes_reader(parts: list[LakePath], transactions: LakePath):
    """The changelog rows of a table's spill parts: each change joined with its transaction (position, xid, time)."""

    def frame(spark: SparkSession) -> DataFrame:
        from pyspark.sql import functions as F

        changes = spark.read.option("mergeSchema", "true").parquet(*[p.uri for p in parts])
        return changes.join(F.broadcast(spark.read.parquet(transactions.uri)), "_cdc_commit_lsn")

    return frame


class PostgresDialect:
    settled_rule = SETTLED_RULE

    def __init__(self, source: SourceConfig) -> None:
        self.source = source

    def connect(self) -> psycopg.Connection:
        return connect(self.source.connection, self.source.name)

    def describe(self) -> str:
        return f"replication slot {self.source.slot!r}"

    def discover(self) -> tuple[list[CapturedTable], list[SkippedTable]]:
        with self.connect() as conn:
            catalog.check_replication_role(conn, self.source)
            discovery = catalog.discover(conn, self.source)
            if discovery.tables:
                catalog.ensure_publication(conn, self.source, discovery.tables)
            catalog.ensure_slot(conn, self.source)
        return discovery.tables, discovery.skipped

    def plan_chunks(self, table: CapturedTable) -> ChunkPlan:
        with self.connect() as conn:
            return snapshot.plan_chunks(conn, table)

    def row_filter(self, table: CapturedTable, raw: object) -> RowFilter:
        row_filter = parse_row_filter(raw, table.qualified_name, [c.name for c in table.columns])
        condition = snapshot.filter_condition(table, row_filter)
        with self.connect() as conn:
            try:
                conn.execute(sql.SQL("select 1 from {} where {} limit 0").format(table.identifier, condition))
            except psycopg.Error as error:
                said = error.diag.message_primary or str(error).strip().splitlines()[0]
                raise RowFilterError(
                    f"source {self.source.name!r}: table {table.qualified_name}: filter {row_filter.describe()}: "
                    f"PostgreSQL refuses it: {said} (each value is cast to its column's type; the operators are the "
                    "type's own)"
                ) from None
        return row_filter

    @contextmanager
    def window(self) -> Iterator[PostgresWindow]:
        with self.connect() as conn:
            yield PostgresWindow(conn, self.source)

    # -- stream ----------------------------------------------------------------------------------------------
    def read_batch(
        self, recorded: Offset | None, tables: Mapping[str, CapturedTable], spill_dir: LakePath, max_changes: int,
        max_bytes: int,
    ) -> ChangeBatch:  # fmt: skip
        settings = self.source.stream
        recorded_lsn = None if recorded is None else self.position(recorded)
        with self.connect() as conn:
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            if recorded_lsn is not None and recorded_lsn > confirmed:
                # the offset was recorded but the slot did not follow yet (or change_offset moved it): follow now
                stream.advance_slot(conn, self.source.slot, recorded_lsn)
            batch = stream.when_slot_free(  # a sensor's probe may be peeking the slot: the batch waits for it
                lambda: stream.read_batch(
                    conn, self.source.slot, self.source.publication, dict(tables), spill_dir, max_changes,
                    settings.spill_rows, max_bytes, settings.spill_bytes, self._would_capture(conn),
                )
            )  # fmt: skip
            server_flush = stream.current_flush_lsn(conn)
        offset: dict[str, object] = {
            "lsn": format_lsn(batch.applied_lsn),
            "lsn_commit": format_lsn(batch.last_commit_lsn) if batch.last_commit_lsn is not None else None,
            "lsn_proc": format_lsn(batch.last_end_lsn) if batch.last_end_lsn is not None else None,
            "txId": batch.last_xid,
            "ts_usec": int(batch.last_commit_ts.timestamp() * 1_000_000) if batch.last_commit_ts else None,
            "slot": self.source.slot,
            "publication": self.source.publication,
        }
        positions = _commit_positions(batch.transactions_path)
        changes: dict[str, TableChanges] = {}
        for name, spill in batch.spills.items():
            if not spill.parts or batch.transactions_path is None:
                continue
            changes[name] = TableChanges(
                changes=spill.changes,
                bytes=spill.bytes,
                parts=len(spill.parts),
                frame=_changes_reader(list(spill.parts), batch.transactions_path),
                unchanged_columns=set(spill.unchanged_columns),
                added_columns=list(spill.added_columns),
                truncate=max(((positions[c], q) for c, q in spill.truncations), default=None),
                truncates=len(spill.truncations),
            )
        return ChangeBatch(
            applied=batch.applied_lsn,
            offset=offset,
            tables=changes,
            changes=batch.changes,
            transactions=batch.transactions,
            bytes=batch.bytes,
            cut=batch.cut_by_change_limit,
            last_commit_ts=batch.last_commit_ts,
            lag_bytes=max(0, server_flush - batch.applied_lsn),
        )

    def _would_capture(self, conn: psycopg.Connection) -> Callable[[str, str], bool]:
        """``catalog.would_capture`` inside a savepoint of the batch's transaction: a table dropped since its changes
        were made raises there, and must not end the transaction that holds the slot's cursor."""

        def would_capture(schema: str, name: str) -> bool:
            try:
                with conn.transaction():
                    return catalog.would_capture(conn, self.source, schema, name)
            except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):  # dropped since
                return False

        return would_capture

    def position(self, offset: Offset) -> int:
        return parse_lsn(str(offset["lsn"]))

    def format_position(self, position: int) -> str:
        return format_lsn(position)

    def acknowledge(self, offset: Offset) -> int:
        """Move the slot to the offset's ``lsn`` (only forward)."""
        lsn = self.position(offset)
        with self.connect() as conn:
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            if lsn <= confirmed:
                return confirmed
            return stream.advance_slot(conn, self.source.slot, lsn)

    def validate_offset(self, requested: Mapping[str, str]) -> dict[str, object]:
        unknown = sorted(set(requested) - {"lsn"})
        if unknown or "lsn" not in requested:
            raise OffsetError(
                f"source {self.source.name!r}: a PostgreSQL offset takes exactly the field lsn (X/Y form)"
                + (f"; unknown: {', '.join(unknown)}" if unknown else "; lsn is missing")
            )
        with self.connect() as conn:
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            server = stream.current_flush_lsn(conn)
        lsn = validate_postgres_offset(requested["lsn"], confirmed, server)
        return {"lsn": format_lsn(lsn), "slot": self.source.slot, "publication": self.source.publication}

    def pending(self, lag: SourceLag | None) -> tuple[str | None, int]:
        with self.connect() as conn:
            flush = stream.current_flush_lsn(conn)
            if lag is None:
                confirmed, _ = stream.slot_position(conn, self.source.slot)
                waiting = stream.has_pending_changes(conn, self.source.slot, self.source.publication)
                lag_bytes = flush - confirmed
            else:
                waiting, lag_bytes = lag.changes_waiting, lag.lag_bytes
        if waiting:
            return "changes waiting in the slot", flush
        if lag_bytes > self.source.stream.max_lag_bytes:
            return f"slot lags the server by {lag_bytes} bytes", flush
        return None, flush

    def lag(self) -> SourceLag:
        """The slot's lag: bytes from its confirmed position to the server's flush LSN, and seconds since the oldest
        transaction it holds for the publication committed (decodes up to one transaction)."""
        with self.connect() as conn:
            flush = stream.current_flush_lsn(conn)
            confirmed, _ = stream.slot_position(conn, self.source.slot)
            oldest = stream.oldest_pending_commit(conn, self.source.slot, self.source.publication)
        seconds = 0.0 if oldest is None else max(0.0, (datetime.now(UTC) - oldest).total_seconds())
        return SourceLag(max(0, flush - confirmed), seconds, oldest is not None)

    # -- tables ----------------------------------------------------------------------------------------------
    def spark_fields(self, table: CapturedTable, added: Sequence[object] = ()) -> list[T.StructField]:
        known = {c.name for c in table.columns}
        extra = [c for c in added if isinstance(c, PgColumn) and c.name not in known]
        return list(spark_schema([*table.columns, *extra]).fields)

    def column_names(self, table: CapturedTable) -> list[str]:
        return [c.name for c in table.columns]

    def partitions(self, table: CapturedTable) -> list[str]:
        """The table's leaf partitions now (none for an ordinary table)."""
        with self.connect() as conn:
            return catalog.partitions_of(conn, table)

    def filled_without_changes(self, table: CapturedTable, names: Sequence[str]) -> list[str]:
        with self.connect() as conn:
            return catalog.filled_without_changes(conn, table, names)

    @contextmanager
    def check_session(self) -> Iterator[PostgresCheckSession]:
        with self.connect() as conn, self.connect() as reader, check_session(conn, reader) as session:
            yield session

    def is_permanent(self, error: BaseException) -> bool:
        return isinstance(error, PermanentBatchError)


def _commit_positions(path: LakePath | None) -> dict[int, int]:
    """commit LSN -> commit end LSN (``_cdc_position``) of a batch's transactions, read in the driver."""
    if path is None:
        return {}
    table = pq.read_table(path.path, columns=["_cdc_commit_lsn", "_cdc_position"], filesystem=path.filesystem)
    return dict(zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True))
