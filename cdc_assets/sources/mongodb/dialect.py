"""``MongoDialect``: what MongoDB answers to the generic pipeline (``cdc_assets.dialect.SourceDialect``).

Contract:
- Read-only: every client is ``client.connect``'s (read concern ``majority``); nothing here sends a write command,
  and MongoDB keeps no state for us (no slot): ``acknowledge`` tells the server nothing.
- ``discover()``: the captured collections (``catalog.discover``). It also fixes where the stream starts when no
  offset is recorded yet, stored once in the lake's control folder (``_cdc/mongodb_stream_start.json``; first
  writer wins; a later change of ``startup_mode``/``startup_timestamp`` does not move it: ``change_offset`` does):
  ``initial``, ``latest``, ``snapshot``: the current position (``client.current_position``), so every snapshot
  window opens after it and the first batch reads every event after it (nothing is missed; see docs/mongodb.md);
  ``timestamp``: the position of ``startup_timestamp`` (the first batch reads the events after it), refused with
  ``SourceError`` naming the setting, the oplog window (``history.read_window``) and the allowed range when it is
  in the future or before the window. Which chunks are read in each mode is the planner sensor's business.
- ``window()``: a session whose low watermark is the current position (``client.current_position``) with its
  decimal text, and whose high watermark is the current position after the reads. Chunk reads run in Spark tasks
  (``snapshot.chunk_stager``, one per chunk), each staging one file; a fill window reads by key in the driver; a
  rows window (an ad-hoc snapshot of chosen rows) reads in the driver with the filter's query document
  (``filter_query.query_document``: ``row_filter`` validates field paths and typed values; no server round trip).
- ``read_batch`` is ``stream.read_batch`` from the recorded offset's position + 1 (no offset: the stored start + 1),
  spilled as it is read (one Parquet file per collection). The offset has Debezium's MongoDB fields ``sec`` and
  ``ord`` (the applied position's cluster time: every event at or before it is applied) and ``resume_token`` (the
  token of the last applied event, the test server's form of the position when none is known), plus ``position``.
  ``position(offset)`` is ``(sec << 32) | ord``. ``bounded_reads``: it takes ``until`` (no event after it is read;
  at or before the start: no stream is opened). After its events are read it lists the collections again: one the
  source captures now that the run's ``tables`` lacks (created, or newly matching, while the run was in flight; a
  change stream is opened per captured collection, so its events would be left behind) raises
  ``CapturedTablesChanged`` and the pipeline resolves the tables and reads the batch again.
- History lost: the start is before the oplog's first entry (``local.oplog.rs``, where the user may read it), or the
  server refuses a stream with error 286/280 (``history.HistoryLost``). With ``mongodb.on_history_lost: fail`` (the
  default) the batch raises ``PermanentBatchError`` naming the collections, the recorded position, the oplog window
  and the two ways on; nothing is applied and the offset does not move. With ``resnapshot`` the batch holds no event,
  its offset is the current position and ``ChangeBatch.resnapshot`` says why: the pipeline records that every chunk
  of every captured collection is read again in windows opened after it (docs/mongodb.md: why that is exact).
- ``validate_offset``: exactly one of ``resume_token`` (its cluster time is the position) or ``timestamp`` (``SEC``
  or ``SEC:ORD``: changes after that cluster time are streamed); it must parse, must not be after the server's
  current position and must be inside the oplog window; errors name the field, the window and the allowed forms.
- ``pending`` / ``lag``: the current position against the lake's acknowledged position (``SourceLake.acknowledged``,
  written by ``CdcPipeline.acknowledge`` after a batch's or ``change_offset``'s offset was recorded, so it follows
  the recorded offset, backwards too; before the first: the stream start): events wait when the current position is
  past it. ``startup_mode: snapshot``: no event waits (only staged windows and checks ask for batches). On the test
  server a new dialect object starts looking for the newest event from the stored stream start or acknowledged
  position (each was the newest event some process had seen, or before it), not from the oplog's start.
- Columns: ``spark_fields``/``column_names`` are the collection's lake columns (``catalog``: the fixed ones and the
  declared fields, typed by ``typed_fields``); ``filled_without_changes`` names the declared fields among the added
  columns (rows written before hold NULL there while their documents may hold values: the planner reads every chunk
  again).
- Connection failures raise ``SourceError`` with the connection string redacted (``client.source_error``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import pymongo
from pymongo import monitoring
from pymongo.errors import PyMongoError

from cdc_assets.config import MongoConnection, MongoOptions, SourceConfig
from cdc_assets.dialect import ChangeBatch, Offset, OffsetError, TableChanges
from cdc_assets.engine.chunks import Chunk, ChunkPlan
from cdc_assets.engine.row_filter import RowFilter, parse_row_filter
from cdc_assets.engine.windows import FILL_CHUNK, ROWS_CHUNK, WindowStart
from cdc_assets.lake import staging
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.schema import spark_fields
from cdc_assets.lake.tasks import map_in_tasks
from cdc_assets.source import CapturedTablesChanged, PermanentBatchError, SourceError, SourceLag
from cdc_assets.sources.mongodb import catalog, filter_query, history, snapshot, stream
from cdc_assets.sources.mongodb import client as clients
from cdc_assets.sources.mongodb.catalog import CapturedCollection, SkippedCollection
from cdc_assets.sources.mongodb.consistency import MongoCheckSession
from cdc_assets.sources.mongodb.watermark import (
    TIMESTAMP_FORMS,
    TOKEN_FORMS,
    MongoSettledRule,
    format_position,
    parse_timestamp,
    timestamp_of,
    token_position,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql import types as T

SETTLED_RULE = MongoSettledRule()
START_FILE = "mongodb_stream_start.json"
# written before the acknowledged position moved to the generic _cdc/acknowledged (always written beside it):
# no longer read, removed when found
LEGACY_ACKNOWLEDGED_FILE = "mongodb_acknowledged.json"


def _write_once(path: LakePath, data: dict[str, Any]) -> None:
    path.write_new(json.dumps(data))  # first writer wins


def _read_position(path: LakePath) -> int | None:
    try:
        return int(json.loads(path.read_text())["position"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


class MongoWindow:
    """A watermark window's session (``WindowSession``)."""

    def __init__(self, dialect: MongoDialect) -> None:
        self.dialect = dialect
        self.low = 0

    def low_watermark(self) -> tuple[int, str]:
        self.low = self.dialect.current_position()
        return self.low, str(self.low)

    def high_watermark(self) -> int:
        return self.dialect.current_position()

    def stage_chunks(
        self, spark: SparkSession, table: CapturedCollection, chunks: Sequence[Chunk], staging_path: str, attempt: str,
        start: WindowStart,
    ) -> dict[int, int]:  # fmt: skip
        dialect = self.dialect
        ranges = [(c.index, None if c.lo is None else c.lo[0], None if c.hi is None else c.hi[0]) for c in chunks]
        stager = snapshot.chunk_stager(
            dialect.connection, table, staging_path, attempt, self.low, dialect.capabilities.cluster_time,
            dialect.listeners, start,
        )  # fmt: skip
        columns = (("chunk", "int"), ("lo", "string"), ("hi", "string"))
        counts = dict.fromkeys((c.index for c in chunks), 0)
        try:
            for row in map_in_tasks(spark, ranges, columns, stager, "chunk int, rows long"):
                counts[row["chunk"]] += row["rows"]
        except Exception as error:
            if "ServerSelectionTimeoutError" in str(error) or "AutoReconnect" in str(error):
                raise clients.source_error(error, dialect.connection, f"reading {table.qualified_name}") from None
            raise
        return counts

    def stage_rows_by_key(
        self, table: CapturedCollection, keys: Sequence[tuple], staging_path: str, attempt: str
    ) -> int:
        dialect = self.dialect

        def stage(batch_size: int) -> int:
            parts = snapshot.rows_by_key(
                dialect.client, table, keys, self.low, dialect.capabilities.cluster_time, batch_size
            )
            return staging.write_part(staging_path, attempt, FILL_CHUNK, 0, parts, table.arrow_schema)

        return snapshot.read_whole(stage)

    def stage_rows_matching(
        self, table: CapturedCollection, row_filter: RowFilter | None, staging_path: str, attempt: str
    ) -> int:
        dialect = self.dialect
        query = filter_query.query_document(row_filter)

        def stage(batch_size: int) -> int:
            parts = snapshot.read_chunk(
                dialect.client, table, None, None, self.low, dialect.capabilities.cluster_time, batch_size, query
            )
            return staging.write_part(staging_path, attempt, ROWS_CHUNK, 0, parts, table.arrow_schema)

        return snapshot.read_whole(stage)


def _reader(path: LakePath):
    def frame(spark: SparkSession) -> DataFrame:
        return spark.read.parquet(path.uri)

    return frame


class MongoDialect:
    settled_rule = SETTLED_RULE
    bounded_reads = True

    def __init__(
        self, source: SourceConfig, control: str | os.PathLike[str] | LakePath,
        listeners: Sequence[monitoring.CommandListener] = (),
    ) -> None:  # fmt: skip
        if not isinstance(source.connection, MongoConnection):
            raise TypeError(f"source {source.name!r} is not a MongoDB source")
        self.source = source
        self.connection: MongoConnection = source.connection
        self.control = LakePath(control)
        self.lake = SourceLake.of_control(self.control)
        self.listeners = tuple(listeners)
        options = source.mongodb if source.mongodb is not None else MongoOptions()
        self.full_document = options.full_document
        self.before_change = options.full_document_before_change
        self.on_history_lost = options.on_history_lost
        self._client: pymongo.MongoClient | None = None
        self._capabilities: clients.Capabilities | None = None
        self._tables: list[CapturedCollection] | None = None
        self.latest = clients.LatestEvent.of_server(self.connection.uri.value)
        self._seeded = False
        self._oplog_unreadable = False
        self._first_of_untruncated_oplog: int | None = None

    # -- connection ------------------------------------------------------------------------------------------
    @property
    def client(self) -> pymongo.MongoClient:
        if self._client is None:
            self._client = clients.connect(self.connection, self.listeners)
        return self._client

    @property
    def capabilities(self) -> clients.Capabilities:
        if self._capabilities is None:
            self._capabilities = self._call("asking the server what it is", self._ask_capabilities)
        return self._capabilities

    def _ask_capabilities(self) -> clients.Capabilities:
        return clients.Capabilities.of(self.client)

    def _call(self, doing: str, action):
        try:
            return action()
        except PyMongoError as error:
            raise clients.source_error(error, self.connection, doing) from None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def describe(self) -> str:
        return f"the change streams of MongoDB at {self.connection.describe()}"

    def _captured(self) -> list[CapturedCollection]:
        if self._tables is None:
            self._tables = self.discover()[0]
        return self._tables

    def current_position(self) -> int:
        capabilities = self.capabilities
        namespaces = [t.namespace for t in self._captured()]
        if not self._seeded:  # every event at or before a stored position was seen by the process that stored it
            for stored in (_read_position(self.control / START_FILE), self.lake.acknowledged()):
                if stored is not None:
                    self.latest.note(stored)
            self._seeded = True
        return self._call(
            "reading the current cluster time",
            lambda: clients.current_position(self.client, capabilities, self.latest, namespaces),
        )

    # -- the oplog window ------------------------------------------------------------------------------------
    def _first_oplog_entry(self) -> int | None:
        """``local.oplog.rs``'s first entry, or None (asked once per object when the user may not read it). On the
        test server (no cluster time), whose oplog is never truncated, the first entry found is kept: finding it
        sorts the whole oplog there (23 s for 40,000 entries of the demo's file-backed server under load)."""
        if self._oplog_unreadable:
            return None
        if self._first_of_untruncated_oplog is not None:
            return self._first_of_untruncated_oplog
        replica_set = self.capabilities.cluster_time
        first = history.first_oplog_entry(self.client, natural_order=replica_set)
        self._oplog_unreadable = first is None
        if not replica_set:
            self._first_of_untruncated_oplog = first
        return first

    def oplog_window(self) -> history.OplogWindow:
        current = self.current_position()
        tables = self._captured()
        probe = tables[0] if tables else None
        natural = self.capabilities.cluster_time
        return self._call(
            "reading the oplog window", lambda: history.read_window(self.client, probe, current, natural_order=natural)
        )

    def _refusal(self, field: str, text: str, position: int) -> str | None:
        """Why a stream cannot start after ``position`` (a requested offset or start), or None. A start the server
        may take costs one read of the oplog's first entry or one probe; the window's bounds (for the message, by
        probes where ``local`` cannot be read) are found only for a refusal."""
        current = self.current_position()
        future = position > current or timestamp_of(position).time > int(datetime.now(UTC).timestamp())
        if not future:
            first = self._first_oplog_entry()
            tables = self._captured()
            if first is not None:
                reachable = position >= first - 1
            elif tables:
                reachable = self._call(
                    "probing the oplog", lambda: history.probe_start(self.client, tables[0], position + 1)
                )
            else:
                reachable = True  # nothing captured, nothing to miss
            if reachable:
                return None
        window = self.oplog_window()
        if future:
            return (
                f"{field}: {text!r} is cluster time {format_position(position)}, in the future: the server is at "
                f"{format_position(current)}; allowed: {window.allowed()}"
            )
        return history.unreachable_message(field, text, position, window)

    # -- tables ----------------------------------------------------------------------------------------------
    def discover(self) -> tuple[list[CapturedCollection], list[SkippedCollection]]:
        tables, skipped = self._call("listing collections", lambda: catalog.discover(self.client, self.source))
        self._tables = tables
        if _read_position(self.control / START_FILE) is None:
            position = self._startup_position()
            _write_once(
                self.control / START_FILE,
                {"position": position, "at": datetime.now(UTC).isoformat(), "startup_mode": self.source.startup_mode,
                 "startup_timestamp": self.source.startup_timestamp},
            )  # fmt: skip
        return tables, skipped

    def _startup_position(self) -> int:
        """Where the stream starts when no offset is recorded (see the module docstring)."""
        text = self.source.startup_timestamp
        if self.source.startup_mode != "timestamp" or text is None:
            return self.current_position()
        try:
            position = parse_timestamp(text)
        except ValueError as error:
            raise SourceError(f"source {self.source.name!r}: startup_timestamp: {error}") from None
        refusal = self._refusal("startup_timestamp", text, position)
        if refusal is not None:
            raise SourceError(
                f"source {self.source.name!r} (startup_mode: timestamp): {refusal}. Set startup_timestamp inside the "
                "window, or use startup_mode initial (snapshot, then stream) or latest (stream from now)"
            )
        return position

    def stream_start(self) -> int:
        position = _read_position(self.control / START_FILE)
        if position is None:
            self.discover()
            position = _read_position(self.control / START_FILE)
        assert position is not None
        return position

    def plan_chunks(self, table: CapturedCollection) -> ChunkPlan:
        return self._call(
            f"planning chunks of {table.qualified_name}",
            lambda: snapshot.plan_chunks(self.client, table, self._chunk_size(table)),
        )

    def row_filter(self, table: CapturedCollection, raw: object) -> RowFilter:
        """Field paths of documents (no fixed columns); the query document is built once to refuse a typed value
        that decodes to no allowed BSON scalar."""
        row_filter = parse_row_filter(raw, table.qualified_name, None)
        filter_query.query_document(row_filter)
        return row_filter

    def _chunk_size(self, table: CapturedCollection) -> int:
        for configured in self.source.tables:
            if (configured.schema, configured.name) == table.namespace and configured.chunk_size:
                return configured.chunk_size
        return self.source.chunk_size

    @contextmanager
    def window(self) -> Iterator[MongoWindow]:
        yield MongoWindow(self)

    # -- stream ----------------------------------------------------------------------------------------------
    def read_batch(
        self, recorded: Offset | None, tables: Mapping[str, CapturedCollection], spill_dir: LakePath, max_changes: int,
        max_bytes: int, until: int | None = None,
    ) -> ChangeBatch:  # fmt: skip
        after = self.stream_start() if recorded is None else self.position(recorded)
        if until is not None and until <= after:  # nothing to read up to until
            return self._batch(after, None, recorded)
        capabilities = self.capabilities
        captured = list(tables.values())
        try:
            first = self._first_oplog_entry()
            if history.gap_before(after, first):
                raise history.HistoryLost(None, f"the oplog's first entry {format_position(first)} is after it")
            batch, written = self._call(
                "reading the change streams",
                lambda: stream.read_batch(
                    self.client, capabilities, self.latest, captured, after + 1, max_changes, max_bytes,
                    self.full_document, spill_dir, until=until, before_change=self.before_change,
                ),
            )  # fmt: skip
        except history.HistoryLost as lost:
            return self._history_lost(lost, after, captured)
        newly_captured = self._newly_captured(tables)
        if newly_captured:
            raise CapturedTablesChanged(newly_captured)
        changes = {
            name: TableChanges(changes=table.changes, bytes=table.bytes, parts=table.parts, frame=_reader(table.path))
            for name, table in written.items()
        }
        return self._batch(
            batch.applied, batch.last_token, recorded, tables=changes, changes=batch.changes,
            transactions=batch.groups, bytes=batch.bytes, cut=batch.cut, last_commit_ts=batch.last_ts,
            lag_bytes=batch.waiting,
        )  # fmt: skip

    def _newly_captured(self, tables: Mapping[str, CapturedCollection]) -> list[str]:
        """The collections the source captures now that ``tables`` (the run's) lacks. Listed after the batch's events
        were read, so a collection created before the batch's end is listed: its events up to the end would
        otherwise be left behind (a change stream is opened per captured collection). A named collection that is
        gone is the stream's to report (its drop event names it), not this listing's."""

        def listing() -> list[CapturedCollection] | None:
            try:
                return catalog.discover(self.client, self.source)[0]
            except SourceError:  # a named collection is gone (an unreachable server raises PyMongoError)
                return None

        captured = self._call("listing collections", listing)
        return sorted(c.qualified_name for c in captured or [] if c.qualified_name not in tables)

    def _batch(self, applied: int, token: str | None, recorded: Offset | None, **figures: Any) -> ChangeBatch:
        """A ``ChangeBatch`` ending at ``applied``: the offset's token is the last applied event's, else (the test
        server) the position's own form, else the recorded one (a real server: no event read since)."""
        if token is None or token_position(token) != applied:
            if not self.capabilities.cluster_time:
                token = f"{timestamp_of(applied).time:08x}{timestamp_of(applied).inc:08x}"
            elif token is None and recorded is not None:
                token = recorded.get("resume_token")  # type: ignore[assignment]
        at = timestamp_of(applied)
        defaults: dict[str, Any] = {
            "tables": {}, "changes": 0, "transactions": 0, "bytes": 0, "cut": False, "last_commit_ts": None,
            "lag_bytes": 0,
        }  # fmt: skip
        return ChangeBatch(
            applied=applied, offset={"sec": at.time, "ord": at.inc, "resume_token": token}, **(defaults | figures)
        )

    def _history_lost(self, lost: history.HistoryLost, after: int, tables: list[CapturedCollection]) -> ChangeBatch:
        window = self.oplog_window()
        if self.on_history_lost != "resnapshot":
            raise PermanentBatchError(
                history.history_lost_message(self.source.name, tables, lost.table, after, window, lost.cause)
            )
        restart = window.current
        reason = history.resnapshot_reason(self.source.name, tables, lost.table, after, restart, window, lost.cause)
        return self._batch(restart, None, None, resnapshot=reason)

    def position(self, offset: Offset) -> int:
        try:
            return (int(str(offset["sec"])) << 32) | int(str(offset["ord"]))
        except (KeyError, ValueError) as error:
            raise OffsetError(f"a MongoDB offset needs integer fields sec and ord: {error}") from None

    def format_position(self, position: int) -> str:
        return format_position(position)

    def acknowledge(self, offset: Offset) -> int:
        """MongoDB keeps nothing for us: nothing to tell the server (``CdcPipeline.acknowledge`` records the position
        in the lake, which ``pending`` and ``lag`` read)."""
        (self.control / LEGACY_ACKNOWLEDGED_FILE).unlink()
        return self.position(offset)

    def validate_offset(self, requested: Mapping[str, str]) -> dict[str, object]:
        given = sorted(k for k in requested if k in ("resume_token", "timestamp"))
        unknown = sorted(set(requested) - {"resume_token", "timestamp"})
        if unknown or len(given) != 1:
            raise OffsetError(
                f"source {self.source.name!r}: a MongoDB offset takes exactly one of resume_token ({TOKEN_FORMS}) "
                f"or timestamp ({TIMESTAMP_FORMS})" + (f"; unknown: {', '.join(unknown)}" if unknown else "")
            )
        field = given[0]
        text = str(requested[field])
        try:
            position = token_position(text) if field == "resume_token" else parse_timestamp(text)
        except ValueError as error:
            raise OffsetError(f"{field}: {error}") from None
        refusal = self._refusal(field, text, position)
        if refusal is not None:
            raise OffsetError(refusal)
        at = timestamp_of(position)
        token = text if field == "resume_token" else None
        return {"sec": at.time, "ord": at.inc, "resume_token": token}

    def _acknowledged(self) -> int:
        """The lake's acknowledged position (the recorded offset's, once acknowledged), else the stream start."""
        acknowledged = self.lake.acknowledged()
        return acknowledged if acknowledged is not None else self.stream_start()

    def pending(self, lag: SourceLag | None) -> tuple[str | None, int]:
        current = self.current_position()
        if self.source.startup_mode == "snapshot":
            return None, current  # no streaming: only staged windows and waiting checks ask for a batch
        waiting = current > self._acknowledged() if lag is None else lag.changes_waiting
        return ("change events wait after the recorded position" if waiting else None), current

    def lag(self) -> SourceLag:
        current = self.current_position()
        behind = self._acknowledged()
        seconds = 0.0
        if current > behind:
            seconds = max(0.0, datetime.now(UTC).timestamp() - timestamp_of(behind).time)
        return SourceLag(0, seconds if current > behind else 0.0, current > behind)

    def spark_fields(self, table: CapturedCollection, added: Sequence[object] = ()) -> list[T.StructField]:
        return spark_fields(table.arrow_schema)

    def column_names(self, table: CapturedCollection) -> list[str]:
        return table.column_names

    def partitions(self, table: CapturedCollection) -> list[str]:
        return []

    def filled_without_changes(self, table: CapturedCollection, names: Sequence[str]) -> list[str]:
        """Declared fields among ``names`` (declared since the caller last looked): rows written before hold NULL
        there although their documents may have values, so their chunks must be read again."""
        declared = {f.name for f in table.fields}
        return [n for n in names if n in declared]

    @contextmanager
    def check_session(self) -> Iterator[MongoCheckSession]:
        def read(table: CapturedCollection, lo: str | None, hi: str | None, low: int) -> list[dict[str, Any]]:
            parts = self._call(
                f"reading {table.qualified_name} for a consistency check",
                lambda: snapshot.read_whole(
                    lambda batch_size: list(
                        snapshot.read_chunk(self.client, table, lo, hi, low, self.capabilities.cluster_time, batch_size)
                    )
                ),
            )
            return [row for part in parts for row in part.to_pylist()]

        yield MongoCheckSession(self.current_position, read)

    def is_permanent(self, error: BaseException) -> bool:
        return isinstance(error, PermanentBatchError)
