"""One bounded batch of a MongoDB source's change events, as changelog rows spilled to Parquet.

Contract (``read_batch``):
- One change stream per captured collection, each started at the cluster time just after the recorded position
  (``start_at_operation_time``, inclusive; the test server needs an explicit start and has no client- or
  database-level stream that delivers inserts and updates), ``fullDocument: updateLookup``.
- The bound is taken first (``client.current_position``), then each stream is read up to it: events at or before
  it are kept. A stream has reached the bound when it returned an event after it, or (on a server with cluster
  times) its post-batch resume token is at or past it, or (on the test server) it has no event left (an event at
  or before the bound was appended before the bound was known). Streams that do not reach it within
  ``REACH_SECONDS`` (a real server's majority commit lagging) lower the batch's end to where they got.
- Events are merged by (position, collection, stream order); positions group a transaction's events, which are
  taken whole: groups are taken until ``max_changes`` or ``max_bytes`` (canonical JSON bytes) would be passed (at
  least one group). ``applied`` is the last taken group's position when a bound cut the batch, else the end.
- Rows: insert -> ``c`` with the inserted document; update or replace -> ``u`` with the looked-up document. The
  looked-up document is the one at the time the event is read, possibly newer than the event: the mirror row then
  holds a newer document at the event's position, and every later event of that ``_id`` is applied after it, the
  last with a lookup after the last change, so the mirror ends exact. When the lookup finds nothing (the document
  was deleted since; the test server then gives the update's delta without ``_id``, and its ``documentKey`` holds
  the update, not ``{_id}``) the event yields no row: a delete of that ``_id`` follows it in the stream, is
  applied, and is unsettled for every window whose low watermark precedes the update, so nothing is lost.
  delete -> ``d`` with the key alone as before image (``_cdc_before_key_only``). No pre-images.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
import pymongo
from pymongo.change_stream import ChangeStream
from pymongo.errors import OperationFailure

from cdc_assets.source import PermanentBatchError
from cdc_assets.sources.mongodb import client as clients
from cdc_assets.sources.mongodb.bson_order import canonical_json
from cdc_assets.sources.mongodb.catalog import ARROW_SCHEMA, KEY_COLUMN, CapturedCollection, document_row, id_key
from cdc_assets.sources.mongodb.history import HistoryLost, describe_cause, is_history_lost
from cdc_assets.sources.mongodb.watermark import format_position, position_of, timestamp_of, token_position, token_text

_T = TypeVar("_T")
REACH_SECONDS = 10.0
MAX_AWAIT_MS = 100
ENDING = ("drop", "rename", "dropDatabase", "invalidate")
CHANGE_SCHEMA = pa.schema([
    ("_cdc_op", pa.string()), ("_cdc_position", pa.int64()), ("_cdc_seq", pa.int64()),
    ("_cdc_ts", pa.timestamp("us", tz="UTC")), ("_cdc_before_key_only", pa.bool_()),
    ("_cdc_unchanged", pa.list_(pa.string())), ("after", pa.struct(list(ARROW_SCHEMA))),
    ("before", pa.struct(list(ARROW_SCHEMA))),
])  # fmt: skip


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


def open_stream(client: pymongo.MongoClient, table: CapturedCollection, start: int, full_document: str) -> ChangeStream:
    return client[table.database][table.collection].watch(
        start_at_operation_time=timestamp_of(max(start, clients.FIRST_POSITION)),
        full_document=full_document,
        max_await_time_ms=MAX_AWAIT_MS,
    )


def _guarded(table: CapturedCollection, action: Callable[[], _T]) -> _T:
    """``action()``, with the server's history-lost error as ``HistoryLost`` naming ``table``."""
    try:
        return action()
    except OperationFailure as error:
        if is_history_lost(error):
            raise HistoryLost(table, describe_cause(error)) from None
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


def read_batch(
    client: pymongo.MongoClient, capabilities: clients.Capabilities, latest: clients.LatestEvent,
    tables: Sequence[CapturedCollection], start: int, max_changes: int, max_bytes: int, full_document: str,
    on_bound: Callable[[int], None] | None = None, until: int | None = None,
) -> StreamBatch:  # fmt: skip
    """Events after position ``start - 1`` (see the module docstring)."""
    check_collections_exist(client, tables)
    streams: dict[str, ChangeStream] = {}
    try:
        for table in tables:
            streams[table.qualified_name] = _guarded(
                table, lambda table=table: open_stream(client, table, start, full_document)
            )
        buffered: dict[str, list[Event]] = {name: [] for name in streams}
        order = 0

        def pull(name: str, table: CapturedCollection) -> Event | None:
            nonlocal order
            raw = _guarded(table, streams[name].try_next)
            if raw is None:
                return None
            order += 1
            event = Event(table, position_of(raw["clusterTime"]), _token(raw), raw, order)
            buffered[name].append(event)
            return event

        by_name = {t.qualified_name: t for t in tables}
        if capabilities.cluster_time and (found := clients.operation_time(client)) is not None:
            bound = found
        else:  # the test server: every stream drained, the newest event is the bound
            for name, table in by_name.items():
                while pull(name, table) is not None:
                    pass
            newest = max((e.position for events in buffered.values() for e in events), default=0)
            bound = max(latest.seen, newest, start - 1)
        latest.note(bound)
        if until is not None:
            bound = max(min(bound, until), start - 1)
        if on_bound is not None:
            on_bound(bound)
        reached = bound
        for name, table in by_name.items():
            deadline = time.monotonic() + REACH_SECONDS
            while not buffered[name] or buffered[name][-1].position <= bound:
                if pull(name, table) is not None:
                    continue
                if not capabilities.cluster_time:
                    break  # no event left: everything at or before the bound was read
                token = streams[name].resume_token
                progress = token_position(token) if token is not None else start - 1
                if progress >= bound:
                    break
                if time.monotonic() > deadline:
                    reached = min(reached, progress)
                    break
        events = sorted(
            (e for events in buffered.values() for e in events if e.position <= reached),
            key=lambda e: (e.position, e.table.qualified_name, e.order),
        )
        waiting = sum(1 for events in buffered.values() for e in events if e.position > reached)
        for event in events:
            if event.operation in ENDING:
                _check_ending(client, event)
        return _rows(events, max(reached, start - 1), max_changes, max_bytes, waiting)
    finally:
        for stream in streams.values():
            stream.close()


def _rows(events: list[Event], end: int, max_changes: int, max_bytes: int, waiting: int) -> StreamBatch:
    groups: list[list[Event]] = []
    for event in events:
        if event.operation in ENDING:
            continue  # another collection's drop (an ending of ours raised before)
        if groups and groups[-1][0].position == event.position:
            groups[-1].append(event)
        else:
            groups.append([event])
    rows: dict[str, list[dict[str, Any]]] = {}
    taken = changes = size = skipped = 0
    last_token: str | None = None
    last_ts: datetime | None = None
    for group in groups:
        made = [(event, _row(event)) for event in group]
        group_bytes = sum(len(r["after"]["document"]) if r and r["after"] else 64 for _, r in made)
        if taken and (changes + len(group) > max_changes or size + group_bytes > max_bytes):
            break
        taken += 1
        changes += len(group)
        size += group_bytes
        seq = 0
        for event, row in made:
            last_token = event.token or last_token
            last_ts = row["_cdc_ts"] if row else last_ts
            if row is None:
                skipped += 1
                continue
            row["_cdc_seq"] = seq
            seq += 1
            rows.setdefault(event.table.qualified_name, []).append(row)
    cut = taken < len(groups)
    applied = groups[taken - 1][0].position if cut else end
    waiting += sum(len(g) for g in groups[taken:])
    return StreamBatch(applied, rows, changes, taken, size, cut, waiting, last_token, last_ts, skipped)


def _row(event: Event) -> dict[str, Any] | None:
    raw = event.raw
    at = datetime.fromtimestamp(raw["clusterTime"].time, UTC)
    base = {"_cdc_position": event.position, "_cdc_ts": at, "_cdc_before_key_only": False, "_cdc_unchanged": []}
    operation = event.operation
    if operation in ("insert", "update", "replace"):
        document = raw.get("fullDocument")
        if not isinstance(document, Mapping) or "_id" not in document:
            return None  # deleted since the event (see the module docstring)
        return {**base, "_cdc_op": "c" if operation == "insert" else "u", "after": document_row(dict(document)),
                "before": None}  # fmt: skip
    if operation == "delete":
        key = (raw.get("documentKey") or {})["_id"]
        before = {KEY_COLUMN: id_key(key), "_id": canonical_json(key), "document": None, "_cdc_unrepresentable": None}
        return {**base, "_cdc_op": "d", "_cdc_before_key_only": True, "after": None, "before": before}
    return None


def spill(rows: Mapping[str, list[dict[str, Any]]], spill_dir: Path) -> dict[str, tuple[Path, int, int]]:
    """One Parquet file per table: (path, changes, bytes)."""
    written = {}
    for name, table_rows in rows.items():
        path = spill_dir / f"t{len(written):04d}" / "part-00000.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(table_rows, schema=CHANGE_SCHEMA), path)
        written[name] = (path, len(table_rows), path.stat().st_size)
    return written
