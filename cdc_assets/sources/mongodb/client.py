"""Connections of the MongoDB source: clients that only read, their errors without credentials, the server's
capabilities, and the current position of the change stream.

Contract:
- ``connect(connection, listeners)`` returns a ``MongoClient`` with the configured timeouts, read concern
  ``majority`` and reads from the primary; the connection string (a ``Secret``) is passed to the driver only.
  Nothing in this package sends a write command (``tests/integration/test_mongodb_pipeline.py`` checks every command
  of a whole run with a ``CommandAudit`` listener).
- ``source_error(error, connection, doing)``: a ``SourceError`` whose message says what failed and what to check,
  with the connection string redacted (``cdc_assets.config.redact_uri``) and any credential of it scrubbed from the
  driver's text.
- ``Capabilities.of(client)``: whether the server keeps cluster times (a replica set or ``mongos``: replies carry
  ``operationTime``, sessions and ``afterClusterTime`` work, change-stream batches carry a post-batch resume token).
  The test server (mongo-java-server) keeps none of these. And whether it splits a change event larger than 16 MB
  into fragments (``$changeStreamSplitLargeEvent``: MongoDB 7.0 and later, 6.0 from 6.0.9; ``splits_large_events``).
- ``ChangeCursor``: one collection's change stream, event by event. Where the server splits large events the stage
  ends its pipeline, and a split event's fragments are returned as the one event they were cut from
  (``assemble_split_event``), with the last fragment's resume token: without the stage an update of a document near
  16 MB (``updateLookup`` adds the whole document to the event) fails every read of the stream with
  ``BSONObjectTooLarge``, so the stream could never pass it. A server without the stage still fails there; the
  error names the collection and the way on (``split_event_hint``).
- ``current_position(...)``: the position (``watermark.position_of``) the change stream has reached now. With
  cluster times: the ``operationTime`` of a ``ping`` in a causally consistent session (the node's last applied
  cluster time). Without (the test server): the newest event of the captured collections' change streams, read from
  the newest position this process has seen before (``LatestEvent``): every event at or before it has been written
  (it is in the oplog, and the test server appends a write's entry after applying the write and before replying),
  and no event at or before it can appear later (the server numbers oplog entries from one counter as it appends
  them; one writer at a time, as in the tests: concurrent writers could append out of order; docs/mongodb.md).
- ``CommandAudit(path)``: a ``CommandListener`` appending each started command's name to a file (picklable, so
  Spark tasks carry it): the tests' proof that no write command is sent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pymongo
from pymongo import monitoring
from pymongo.change_stream import ChangeStream
from pymongo.collection import Collection
from pymongo.errors import OperationFailure, ProtocolError

from cdc_assets.config import MongoConnection, redact_uri
from cdc_assets.source import SourceError
from cdc_assets.sources.mongodb.watermark import position_of, timestamp_of

FIRST_POSITION = (1 << 32) | 1  # Timestamp(1, 1): before every event (the test server accepts it as a start)
# events per change-stream batch (the server caps a batch at 16 MB whatever it is): the test server scans its whole
# oplog for every batch, so the driver's default of 101 made reading 22,000 events take 64 s there, 10,000 3 s
STREAM_BATCH_SIZE = 10_000
MAX_AWAIT_MS = 100
WRITE_COMMANDS = frozenset({
    "insert", "update", "delete", "findandmodify", "create", "createindexes", "drop", "dropdatabase", "dropindexes",
    "renamecollection", "collmod", "applyops", "bulkwrite", "committransaction", "aborttransaction",
})  # fmt: skip


class CommandAudit(monitoring.CommandListener):
    """Appends the name of every command a client starts to ``path`` (one per line)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        with open(self.path, "a") as log:
            log.write(f"{os.getpid()} {event.command_name}\n")

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


def connect(connection: MongoConnection, listeners: Sequence[monitoring.CommandListener] = ()) -> pymongo.MongoClient:
    return pymongo.MongoClient(
        connection.uri.value,
        serverSelectionTimeoutMS=connection.server_selection_timeout_ms,
        connectTimeoutMS=connection.connect_timeout_ms,
        readConcernLevel="majority",
        readPreference="primary",
        appname="cdc-lake",
        event_listeners=list(listeners),
    )


def scrub(text: str, connection: MongoConnection) -> str:
    """``text`` without the connection string or its user information."""
    uri = connection.uri.value
    text = text.replace(uri, redact_uri(uri))
    _, _, rest = uri.partition("://")
    authority = rest.partition("/")[0]
    if "@" in authority:
        userinfo = authority.rsplit("@", 1)[0]
        for secret in {userinfo, *userinfo.split(":")}:
            if secret:
                text = text.replace(secret, "***")
    return text


def source_error(error: BaseException, connection: MongoConnection, doing: str) -> SourceError:
    text = str(error).splitlines()[0] if str(error) else ""
    text = text.split(", Topology Description:")[0]  # the driver's dump of its view of the servers: noise here
    cause = scrub(f"{type(error).__name__}: {text}", connection)[:800]
    return SourceError(
        f"MongoDB at {connection.describe()}: {doing} failed: {cause}. Check that the server is reachable from here "
        f"(connection.server_selection_timeout_ms is {connection.server_selection_timeout_ms} ms), that the "
        "connection string in the environment is right and that the user may read the captured collections and "
        "open change streams (roles read and changeStream)"
    )


SPLIT_EVENT = "splitEvent"
SPLIT_STAGE = {"$changeStreamSplitLargeEvent": {}}
TOO_LARGE_CODES = (10334, 17419)  # BSONObjectTooLarge; "resulting document after ... exceeds" (an event's size)


def splits_large_events(version: Sequence[int]) -> bool:
    """Whether a server of ``version`` (``buildInfo``'s ``versionArray``) has ``$changeStreamSplitLargeEvent``:
    7.0 and later, and 6.0 from 6.0.9 (not the 6.1-6.3 rapid releases)."""
    release = tuple([*version[:3], 0, 0, 0][:3])
    return release >= (7, 0, 0) or (6, 0, 9) <= release < (6, 1, 0)


def assemble_split_event(fragments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The change event ``$changeStreamSplitLargeEvent`` cut into ``fragments`` (each with ``splitEvent: {fragment,
    of}``, numbered from 1, in order): every field from the fragment that holds it, and the resume token (``_id``) of
    the last fragment, so that resuming after the event resumes after all of it. ``ValueError`` when fragments are
    missing, out of order or disagree on a field."""
    if not fragments:
        raise ValueError("a split change event without fragments")
    total = fragments[0][SPLIT_EVENT]["of"]
    numbers = [(f[SPLIT_EVENT]["fragment"], f[SPLIT_EVENT]["of"]) for f in fragments]
    if numbers != [(n, total) for n in range(1, total + 1)]:
        raise ValueError(f"a split change event's fragments (fragment, of) are {numbers}: expected 1 to {total}")
    event: dict[str, Any] = {}
    for fragment in fragments:
        for name, value in fragment.items():
            if name in ("_id", SPLIT_EVENT):
                continue
            if name in event and event[name] != value:
                raise ValueError(f"a split change event's fragments disagree on its field {name!r}")
            event[name] = value
    event["_id"] = fragments[-1]["_id"]
    return event


def whole_split_event(first: Mapping[str, Any], next_fragment: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
    """The split event whose first fragment is ``first``, its other fragments read with ``next_fragment``."""
    fragments = [first]
    while len(fragments) < first[SPLIT_EVENT]["of"]:
        fragments.append(next_fragment())
    return assemble_split_event(fragments)


def split_event_hint(error: OperationFailure, collection: str) -> str | None:
    """The way on when ``error`` is a change event too large for a reply, else None."""
    if error.code not in TOO_LARGE_CODES and "BSONObjectTooLarge" not in str(error):
        return None
    return (
        f"collection {collection}: a change event is larger than 16 MB (a document near 16 MB with "
        "full_document: updateLookup) and this server cannot split it ($changeStreamSplitLargeEvent needs MongoDB "
        "6.0.9 or 7.0+): upgrade the server; until then the stream stops before this event (its offset stays, "
        "nothing is lost)"
    )


@dataclass(frozen=True)
class Capabilities:
    cluster_time: bool  # replies carry operationTime; sessions, afterClusterTime, post-batch resume tokens
    split_large_events: bool = False  # $changeStreamSplitLargeEvent

    @classmethod
    def of(cls, client: pymongo.MongoClient) -> Capabilities:
        try:
            hello = client.admin.command("hello")
        except OperationFailure:  # the test server knows only the legacy name
            hello = client.admin.command("isMaster")
        replicated = "setName" in hello or hello.get("msg") == "isdbgrid"
        splits = replicated and splits_large_events(client.admin.command("buildInfo").get("versionArray", [0]))
        return cls(cluster_time=replicated and "logicalSessionTimeoutMinutes" in hello, split_large_events=splits)


class ChangeCursor:
    """One collection's change stream from ``start`` (inclusive), read event by event.

    The test server does not cap a change-stream batch at 16 MB as MongoDB does: a batch of large documents (seven
    events of a 12 MB document) failed with "Message length ... is larger than server max message size". On that
    error the stream is opened again after the last event it returned (``resume_after`` its token; before any
    event, at ``start`` again) with a batch a sixteenth as large, down to one event; a real server never sends such
    a batch.

    With ``split_large_events`` the pipeline ends with ``$changeStreamSplitLargeEvent`` and ``try_next`` returns a
    split event whole (``assemble_split_event``); the stream is only ever resumed after a whole event."""

    def __init__(
        self, collection: Collection, start: int, full_document: str | None = None,
        pipeline: Sequence[Mapping[str, Any]] = (), split_large_events: bool = False, before_change: str = "off",
    ) -> None:  # fmt: skip
        self.collection, self.start, self.full_document = collection, start, full_document
        self.before_change = None if before_change == "off" else before_change
        self.pipeline = [*pipeline, SPLIT_STAGE] if split_large_events else list(pipeline)
        self.batch_size = STREAM_BATCH_SIZE
        self.last_token: Mapping[str, Any] | None = None
        self.stream = self._open()

    def _open(self) -> ChangeStream:
        """The stream opened after the last event returned (its first batch comes with the ``aggregate`` reply)."""
        while True:
            where: dict[str, Any] = (
                {"resume_after": self.last_token} if self.last_token is not None
                else {"start_at_operation_time": timestamp_of(max(self.start, FIRST_POSITION))}
            )  # fmt: skip
            try:
                return self.collection.watch(
                    list(self.pipeline), full_document=self.full_document, max_await_time_ms=MAX_AWAIT_MS,
                    batch_size=self.batch_size, full_document_before_change=self.before_change, **where,
                )  # fmt: skip
            except ProtocolError as error:
                self._smaller(error)

    def _smaller(self, error: ProtocolError) -> None:
        if "max message size" not in str(error) or self.batch_size == 1:
            raise error
        self.batch_size = max(1, self.batch_size // 16)

    def try_next(self) -> dict[str, Any] | None:
        while True:
            try:
                raw = self.stream.try_next()
                if raw is not None and SPLIT_EVENT in raw:
                    # its other fragments are in the same oplog entry, so the stream returns them next (``next``
                    # waits for a ``getMore`` when a batch ended between them)
                    raw = whole_split_event(raw, self.stream.next)
            except ProtocolError as error:
                self._smaller(error)
                self.stream.close()
                self.stream = self._open()
                continue
            if raw is not None:
                self.last_token = raw["_id"]
            return raw

    @property
    def resume_token(self) -> Mapping[str, Any] | None:
        return self.stream.resume_token

    def close(self) -> None:
        self.stream.close()


class LatestEvent:
    """The newest event position seen on the captured collections' change streams (the test server's current
    position; see the module docstring). Thread-safe; remembers what it saw, so each call reads only newer events.

    One per server and process (``of_server``): what it says holds for the server, not for one source object, and a
    sensor opens a new source object every tick: each would otherwise read the whole backlog after the acknowledged
    position again (minutes on the test server after a long stop). ``seen`` moves with every event read, so a read
    abandoned at a deadline (``cdc_assets.deadline``) still leaves the next one less to read."""

    _of_server: ClassVar[dict[str, LatestEvent]] = {}
    _of_server_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self.seen = 0
        self.lock = threading.Lock()

    @classmethod
    def of_server(cls, server: str) -> LatestEvent:
        """The process's ``LatestEvent`` of ``server`` (the connection string)."""
        with cls._of_server_lock:
            return cls._of_server.setdefault(server, cls())

    def advance(self, client: pymongo.MongoClient, collections: Iterable[tuple[str, str]]) -> int:
        with self.lock:
            start = max(self.seen + 1, FIRST_POSITION)
            newest = self.seen
            for database, collection in collections:
                # positions only: the documents stay on the server
                cursor = ChangeCursor(client[database][collection], start, pipeline=[{"$project": {"fullDocument": 0}}])
                try:
                    while (event := cursor.try_next()) is not None:
                        newest = max(newest, position_of(event["clusterTime"]))
                        self.seen = newest  # every event at or before it is written, whatever collection it is in
                finally:
                    cursor.close()
            return newest

    def note(self, position: int) -> None:
        with self.lock:
            self.seen = max(self.seen, position)


def operation_time(client: pymongo.MongoClient) -> int | None:
    """The cluster time of a ``ping`` reply (a causally consistent session's ``operation_time``), or None."""
    with client.start_session(causal_consistency=True) as session:
        client.admin.command("ping", session=session)
        ts = session.operation_time
    return None if ts is None else position_of(ts)


def current_position(
    client: pymongo.MongoClient, capabilities: Capabilities, latest: LatestEvent, collections: Iterable[tuple[str, str]]
) -> int:
    if capabilities.cluster_time:
        found = operation_time(client)
        if found is not None:
            latest.note(found)
            return found
    return latest.advance(client, collections)


def is_write(command_name: str) -> bool:
    return command_name.lower() in WRITE_COMMANDS


def read_audit(path: str | Path) -> list[str]:
    file = Path(path)
    return [line.split(" ", 1)[1] for line in file.read_text().splitlines()] if file.exists() else []
