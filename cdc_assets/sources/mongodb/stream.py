"""One bounded batch of a MongoDB source's change events, as changelog rows spilled to Parquet.

Contract (``read_batch``):
- One change stream per captured collection, each started at the cluster time just after the recorded position
  (``start_at_operation_time``, inclusive; the test server needs an explicit start and has no client- or
  database-level stream that delivers inserts and updates), ``fullDocument: updateLookup``.
- The bound is taken first: a real server's ``operationTime``; on the test server the newest event of the
  captured collections (``client.current_position``, streams read without their documents). Then the streams are
  merged lazily (``Merge``) by (position, collection, stream order) up to the bound, holding one unread event per
  stream. A stream has reached the bound when it returned an event after it, or (on a server with cluster times) its
  post-batch resume token is at or past it, or (on the test server) it has no event left (an event at or before the
  bound was appended before the bound was known). Streams that do not reach it within ``REACH_SECONDS`` (a real
  server's majority commit lagging) lower the batch's end to where they got.
- Positions group a transaction's events, which are taken whole: groups are taken until ``max_changes`` or
  ``max_bytes`` (canonical JSON bytes) would be passed (at least one group); the streams are read no further than
  the end of the first group that does not fit. ``applied`` is the last taken group's position when a bound cut the
  batch, else the end. Taken rows go to disk as they come (``Spill``: one Parquet file per collection, a row group
  per 32 MB or 50,000 rows), so the driver holds a bounded amount whatever the backlog; a change-stream batch the
  test server makes larger than its message size (it does not cap batches at 16 MB) is read again in smaller
  batches (``client.ChangeCursor``), so a backlog of large documents streams through.
- Rows: insert -> ``c`` with the inserted document; update or replace -> ``u`` with the looked-up document (its
  declared fields typed by ``typed_fields``, as a snapshot read types them). The
  looked-up document is the one at the time the event is read, possibly newer than the event: the mirror row then
  holds a newer document at the event's position, and every later event of that ``_id`` is applied after it, the
  last with a lookup after the last change, so the mirror ends exact. When the lookup finds nothing (the document
  was deleted since; the test server then gives the update's delta without ``_id``, and its ``documentKey`` holds
  the update, not ``{_id}``) the event yields no row: a delete of that ``_id`` follows it in the stream, is
  applied, and is unsettled for every window whose low watermark precedes the update, so nothing is lost.
  delete -> ``d`` with the key alone as before image (``_cdc_before_key_only``). With
  ``full_document_before_change`` (``whenAvailable``/``required``) an update's, replace's or delete's pre-image,
  where the server gives one, is the row's before image (a delete's then not key-only); the mirror never reads it.
- ``until`` (``startup_mode: snapshot``): the bound is lowered to it, so no event after it is taken.
- A stream the server cannot start or go on with because the oplog no longer holds its history (errors 286, 280:
  ``history.is_history_lost``) raises ``history.HistoryLost`` naming its collection; nothing is taken.
- ``drop``, ``rename``, ``dropDatabase`` and ``invalidate`` of a captured collection raise ``PermanentBatchError``
  naming it before anything is written (the offset does not move). The test server's ``drop`` events carry no
  ``ns`` and reach every stream of the database: one counts when the stream's collection no longer exists. A
  captured collection missing at the batch's start (the test server writes no event for a rename) raises the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import pymongo
from pymongo.errors import OperationFailure

from cdc_assets.lake.files import LakePath
from cdc_assets.source import PermanentBatchError
from cdc_assets.sources.mongodb import client as clients
from cdc_assets.sources.mongodb.bson_order import canonical_json
from cdc_assets.sources.mongodb.catalog import ARROW_SCHEMA, KEY_COLUMN, CapturedCollection, document_row, id_key
from cdc_assets.sources.mongodb.history import HistoryLost, describe_cause, is_history_lost
from cdc_assets.sources.mongodb.watermark import format_position, position_of, token_position, token_text

_T = TypeVar("_T")
REACH_SECONDS = 10.0
SPILL_BYTES = 32 << 20  # a table's buffered rows written as a row group past this (canonical JSON bytes)
SPILL_ROWS = 50_000
ENDING = ("drop", "rename", "dropDatabase", "invalidate")


def change_schema(schema: pa.Schema = ARROW_SCHEMA) -> pa.Schema:
    """Changelog rows of a collection whose lake columns are ``schema`` (its declared fields typed)."""
    return pa.schema([
        ("_cdc_op", pa.string()), ("_cdc_position", pa.int64()), ("_cdc_seq", pa.int64()),
        ("_cdc_ts", pa.timestamp("us", tz="UTC")), ("_cdc_before_key_only", pa.bool_()),
        ("_cdc_unchanged", pa.list_(pa.string())), ("after", pa.struct(list(schema))),
        ("before", pa.struct(list(schema))),
    ])  # fmt: skip


CHANGE_SCHEMA = change_schema()


@dataclass
class Event:
    table: CapturedCollection
    position: int
    token: str | None
    raw: dict[str, Any]
    order: int  # in its stream

    @property
    def operation(self) -> str:
        return str(self.raw.get("operationType"))


@dataclass
class StreamBatch:
    applied: int
    rows: dict[str, list[dict[str, Any]]]
    changes: int
    groups: int
    bytes: int
    cut: bool
    waiting: int  # events known to wait after ``applied``
    last_token: str | None
    last_ts: datetime | None
    skipped_lookups: int = 0
    positions: list[int] = field(default_factory=list)


def open_stream(
    client: pymongo.MongoClient, table: CapturedCollection, start: int, full_document: str, split_large_events: bool,
    before_change: str = "off",
) -> clients.ChangeCursor:  # fmt: skip
    collection = client[table.database][table.collection]
    return clients.ChangeCursor(
        collection, start, full_document, split_large_events=split_large_events, before_change=before_change
    )


def _guarded(table: CapturedCollection, action: Callable[[], _T]) -> _T:
    """``action()``, with the server's history-lost error as ``HistoryLost`` naming ``table``, and an event too large
    for a server that cannot split it as a ``PermanentBatchError`` naming ``table`` and the way on (a retry meets the
    same event)."""
    try:
        return action()
    except OperationFailure as error:
        if is_history_lost(error):
            raise HistoryLost(table, describe_cause(error)) from None
        if (hint := clients.split_event_hint(error, table.qualified_name)) is not None:
            raise PermanentBatchError(f"{hint} ({describe_cause(error)})") from None
        raise


def _token(event: Mapping[str, Any]) -> str | None:
    try:
        return token_text(event.get("_id"))
    except ValueError:
        return None


def check_collections_exist(client: pymongo.MongoClient, tables: Sequence[CapturedCollection]) -> None:
    by_database: dict[str, set[str]] = {}
    for table in tables:
        by_database.setdefault(table.database, set()).add(table.collection)
    for database, names in sorted(by_database.items()):
        present = set(client[database].list_collection_names())
        for name in sorted(names - present):
            gone = CapturedCollection(database, name)
            raise PermanentBatchError(_ended(gone, "no longer exists (dropped or renamed)"))


def _ended(table: CapturedCollection, what: str) -> str:
    return (
        f"collection {table.qualified_name} {what}: the stream stops here, nothing of this batch was applied and the "
        "offset did not move; the mirror keeps the collection as it was. Remove the collection from the source's "
        "tables/include (or exclude it) to go on without it, or restore it and re-snapshot its chunks"
    )


def _check_ending(client: pymongo.MongoClient, event: Event) -> None:
    """Raise for an event that ends the captured collection; ignore another collection's drop (test server)."""
    table, raw = event.table, event.raw
    ns = raw.get("ns")
    operation = event.operation
    at = format_position(event.position)
    if isinstance(ns, Mapping):
        ours = ns.get("db") == table.database and (operation == "dropDatabase" or ns.get("coll") == table.collection)
        if operation == "invalidate" or ours:
            raise PermanentBatchError(_ended(table, f"had a {operation} event at cluster time {at}"))
        return
    if operation == "invalidate" or table.collection not in client[table.database].list_collection_names():
        raise PermanentBatchError(_ended(table, f"had a {operation} event at cluster time {at}"))


class Merge:
    """The events of every captured collection's stream after ``start - 1`` and at or before ``reached``, in
    (position, collection, stream order) order, read lazily: at most one unread event per stream is held.

    ``reached`` starts at the batch's bound. The smallest of the streams' next events is yielded once every stream
    has its next event in hand or is known to hold none at or before ``reached``: on the test server a stream without
    an event left has none at or before the bound (every such event was appended before the bound was known); on a
    real server, once its post-batch resume token reached ``reached``. A real server's stream that does not get there
    within ``REACH_SECONDS`` lowers ``reached`` to where it got, which is at or after every event it returned, so at
    or after every event yielded (events past it are left for the next batch)."""

    def __init__(
        self, cursors: Mapping[str, clients.ChangeCursor], tables: Mapping[str, CapturedCollection], start: int,
        bound: int, cluster_time: bool,
    ) -> None:  # fmt: skip
        self.cursors, self.tables, self.start = cursors, tables, start
        self.reached, self.cluster_time = bound, cluster_time
        self.heads: dict[str, Event | None] = {}
        self.done: set[str] = set()
        self.order = 0
        self.deadlines = {name: time.monotonic() + REACH_SECONDS for name in cursors}

    def _pull(self, name: str) -> Event | None:
        raw = _guarded(self.tables[name], self.cursors[name].try_next)
        if raw is None:
            return None
        self.order += 1
        return Event(self.tables[name], position_of(raw["clusterTime"]), _token(raw), raw, self.order)

    def _head(self, name: str) -> Event | None:
        """The stream's next event, or None once it is known to hold none at or before ``reached`` (then it is done:
        ``reached`` only goes down). On a real server this may lower ``reached`` to where the stream got."""
        if name in self.done:
            return None
        event = self.heads.get(name)
        if event is None:
            event = self._pull(name)
            while event is None and self.cluster_time:
                token = self.cursors[name].resume_token
                progress = token_position(token) if token is not None else self.start - 1
                if progress >= self.reached:
                    break
                if time.monotonic() > self.deadlines[name]:
                    # at least the position of every event this stream returned, so of every event yielded so far
                    self.reached = min(self.reached, progress)
                    break
                event = self._pull(name)
            if event is None:
                self.done.add(name)
            self.heads[name] = event
        return event

    def waiting(self) -> int:
        """Events read past ``reached`` (held as heads)."""
        return sum(1 for e in self.heads.values() if e is not None and e.position > self.reached)

    def __iter__(self) -> Iterator[Event]:
        while True:
            heads = [head for name in self.cursors if (head := self._head(name)) is not None]
            candidates = [e for e in heads if e.position <= self.reached]
            if not candidates:
                return
            first = min(candidates, key=lambda e: (e.position, e.table.qualified_name, e.order))
            self.heads[first.table.qualified_name] = None
            yield first


def read_batch(
    client: pymongo.MongoClient, capabilities: clients.Capabilities, latest: clients.LatestEvent,
    tables: Sequence[CapturedCollection], start: int, max_changes: int, max_bytes: int, full_document: str,
    spill_dir: LakePath, on_bound: Callable[[int], None] | None = None, until: int | None = None,
    before_change: str = "off",
) -> tuple[StreamBatch, dict[str, SpilledTable]]:  # fmt: skip
    """Events after position ``start - 1`` and at or before ``until`` (see the module docstring), their rows spilled
    to ``spill_dir``."""
    check_collections_exist(client, tables)
    by_name = {t.qualified_name: t for t in tables}
    if capabilities.cluster_time and (found := clients.operation_time(client)) is not None:
        bound = found
    else:  # the test server: the newest event of the captured collections (read without their documents)
        bound = max(clients.current_position(client, capabilities, latest, [t.namespace for t in tables]), start - 1)
    latest.note(bound)
    if until is not None:
        bound = max(min(bound, until), start - 1)
    if on_bound is not None:
        on_bound(bound)
    cursors: dict[str, clients.ChangeCursor] = {}
    spill = Spill(spill_dir, {name: change_schema(table.arrow_schema) for name, table in by_name.items()})
    try:
        split = capabilities.split_large_events
        for name, table in by_name.items():
            cursors[name] = _guarded(
                table, lambda table=table: open_stream(client, table, start, full_document, split, before_change)
            )
        merge = Merge(cursors, by_name, start, bound, capabilities.cluster_time)
        batch = _rows(_checked(client, merge), lambda: max(merge.reached, start - 1), max_changes, max_bytes, spill.add)
        batch.waiting += merge.waiting()
        return batch, spill.close()
    finally:
        spill.abort()
        for cursor in cursors.values():
            cursor.close()


def _checked(client: pymongo.MongoClient, events: Iterable[Event]) -> Iterator[Event]:
    """``events``, raising at an event that ends a captured collection (before any later event is taken)."""
    for event in events:
        if event.operation in ENDING:
            _check_ending(client, event)
        yield event


def _rows(
    events: Iterable[Event], end: Callable[[], int], max_changes: int, max_bytes: int,
    sink: Callable[[str, dict[str, Any]], None] | None = None,
) -> StreamBatch:  # fmt: skip
    """Whole cluster-time groups of ``events`` (ordered by position) within the bounds, at least one group. Reads
    ``events`` only to the end of the first group that does not fit (and the next event, which ends that group).
    Rows of taken groups go to ``sink`` (table, row) in order, or into ``rows``. ``applied``: the last taken group's
    position when a bound cut the batch, else ``end()`` (called once ``events`` is exhausted)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    emit = sink or (lambda name, row: rows.setdefault(name, []).append(row))
    batch = StreamBatch(0, rows, 0, 0, 0, False, 0, None, None)
    group: list[Event] = []

    def take(group: list[Event]) -> bool:
        made = [(event, _row(event)) for event in group]
        group_bytes = sum(len(r["after"]["document"]) if r and r["after"] else 64 for _, r in made)
        if batch.groups and (batch.changes + len(group) > max_changes or batch.bytes + group_bytes > max_bytes):
            return False
        batch.groups += 1
        batch.changes += len(group)
        batch.bytes += group_bytes
        batch.applied = group[0].position
        seq = 0
        for event, row in made:
            batch.last_token = event.token or batch.last_token
            batch.last_ts = row["_cdc_ts"] if row else batch.last_ts
            if row is None:
                batch.skipped_lookups += 1
                continue
            row["_cdc_seq"] = seq
            seq += 1
            emit(event.table.qualified_name, row)
        return True

    for event in events:
        if event.operation in ENDING:
            continue  # another collection's drop (an ending of ours raised before)
        if group and group[0].position != event.position:
            if not take(group):
                batch.cut, batch.waiting = True, len(group) + 1
                return batch
            group = []
        group.append(event)
    if group and not take(group):
        batch.cut, batch.waiting = True, len(group)
        return batch
    batch.applied = end()
    return batch


def _row(event: Event) -> dict[str, Any] | None:
    raw = event.raw
    at = datetime.fromtimestamp(raw["clusterTime"].time, UTC)
    base = {"_cdc_position": event.position, "_cdc_ts": at, "_cdc_before_key_only": False, "_cdc_unchanged": []}
    operation = event.operation
    if operation in ("insert", "update", "replace"):
        document = raw.get("fullDocument")
        if not isinstance(document, Mapping) or "_id" not in document:
            return None  # deleted since the event (see the module docstring)
        after = document_row(dict(document), event.table.fields)
        return {**base, "_cdc_op": "c" if operation == "insert" else "u", "after": after, "before": _pre_image(event)}
    if operation == "delete":
        before = _pre_image(event)
        if before is not None:
            return {**base, "_cdc_op": "d", "after": None, "before": before}
        key = (raw.get("documentKey") or {})["_id"]
        # the key alone (declared fields NULL, as the document)
        before = {KEY_COLUMN: id_key(key), "_id": canonical_json(key), "document": None, "_cdc_unrepresentable": None}
        return {**base, "_cdc_op": "d", "_cdc_before_key_only": True, "after": None, "before": before}
    return None


def _pre_image(event: Event) -> dict[str, Any] | None:
    """The document before the change (``fullDocumentBeforeChange``) as a lake row, or None: pre-images not asked
    for, not enabled on the collection, expired, or an insert."""
    document = event.raw.get("fullDocumentBeforeChange")
    if not isinstance(document, Mapping) or "_id" not in document:
        return None
    return document_row(dict(document), event.table.fields)


@dataclass
class SpilledTable:
    path: LakePath
    changes: int
    bytes: int
    parts: int


class Spill:
    """A batch's rows on disk as they are taken: one Parquet file per table, a row group written whenever a table's
    buffered rows pass ``SPILL_BYTES`` (canonical JSON bytes) or ``SPILL_ROWS``; the driver holds at most that much
    per table, whatever the batch's size. ``schemas``: a table's changelog schema (``change_schema``; default
    ``CHANGE_SCHEMA``, no declared fields)."""

    def __init__(self, spill_dir: LakePath, schemas: Mapping[str, pa.Schema] | None = None) -> None:
        self.spill_dir = spill_dir
        self.schemas = dict(schemas or {})
        self.buffers: dict[str, list[dict[str, Any]]] = {}
        self.buffered_bytes: dict[str, int] = {}
        self.writers: dict[str, pq.ParquetWriter] = {}
        self.tables: dict[str, SpilledTable] = {}

    def add(self, name: str, row: dict[str, Any]) -> None:
        buffer = self.buffers.setdefault(name, [])
        buffer.append(row)
        size = len(row["after"]["document"]) if row["after"] else 64
        self.buffered_bytes[name] = self.buffered_bytes.get(name, 0) + size
        if self.buffered_bytes[name] >= SPILL_BYTES or len(buffer) >= SPILL_ROWS:
            self._flush(name)

    def _flush(self, name: str) -> None:
        rows = self.buffers.get(name)
        if not rows:
            return
        if name not in self.writers:
            path = self.spill_dir / f"t{len(self.writers):04d}" / "part-00000.parquet"
            path.parent.mkdir()
            schema = self.schemas.get(name, CHANGE_SCHEMA)
            self.writers[name] = pq.ParquetWriter(path.path, schema, filesystem=path.filesystem)
            self.tables[name] = SpilledTable(path, 0, 0, 0)
        self.writers[name].write_table(pa.Table.from_pylist(rows, schema=self.schemas.get(name, CHANGE_SCHEMA)))
        table = self.tables[name]
        table.changes += len(rows)
        table.parts += 1
        self.buffers[name], self.buffered_bytes[name] = [], 0

    def close(self) -> dict[str, SpilledTable]:
        for name in list(self.buffers):
            self._flush(name)
        for name, writer in self.writers.items():
            writer.close()
            self.tables[name].bytes = self.tables[name].path.size()
        self.writers = {}
        return self.tables

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers = {}
