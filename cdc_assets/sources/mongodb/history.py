"""The oplog window of a MongoDB source: which positions a change stream can still start after, and what happens when
the stream's recorded position has left it (history lost).

Contract:
- ``OplogWindow``: ``earliest`` is the earliest position a stream may start *after* with every later change still in
  the oplog (None: unknown), ``current`` the server's current position, ``first`` the oplog's first entry where it
  was read, ``how`` where ``earliest`` came from (or why it is unknown). ``reaches(after)``: whether every change
  after position ``after`` is still there (None when unknown); ``describe()`` and ``allowed()`` are the texts of
  messages (``SEC:ORD`` cluster times).
- ``read_window(client, probe, current, natural_order)``, read-only: the first entry of ``local.oplog.rs`` (one
  ``find`` of one document, read concern ``local``; by natural order on a replica set, by ``ts`` on the test server:
  ``first_oplog_entry``) when the user may read it (``earliest`` is that entry's position - 1: a stream
  after it misses nothing); otherwise (no role on ``local``, ``mongos``, no oplog) ``earliest`` is found by probing
  change streams on a captured collection (``probe_start``: the server refuses a start whose history is gone with
  error 286 or 280), second by second (``earliest_second``, a binary search: about 32 probes), so a start in the
  second found is refused (to the second, on the safe side). The source never needs the ``local`` database.
- ``gap_before(after, first)``: a stream starting after position ``after`` would miss changes the oplog, whose
  first entry is ``first``, no longer holds (``after < first - 1``). ``after`` 0 is the test server's position
  before its first event (a start fixed while it had none): no gap.
- ``is_history_lost(error)``: a server error saying the oplog no longer holds the stream's resume point (codes 286
  ``ChangeStreamHistoryLost`` and 280 ``ChangeStreamFatalError``, or their texts). ``HistoryLost`` carries it with
  the collection whose stream failed (None: found before any stream opened, by the window).
- ``history_lost_message(...)``: the collections, the recorded position, the window and the two ways on
  (``change_offset`` to a reachable position, then a re-snapshot; or ``mongodb.on_history_lost: resnapshot``).
  ``unreachable_message(...)``: a requested start outside the window, naming the setting and the allowed range.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pymongo
from pymongo.errors import OperationFailure, PyMongoError
from pymongo.read_concern import ReadConcern

from cdc_assets.sources.mongodb.catalog import CapturedCollection
from cdc_assets.sources.mongodb.watermark import format_position, position_of, timestamp_of

HISTORY_LOST_CODES = {286: "ChangeStreamHistoryLost", 280: "ChangeStreamFatalError"}
HISTORY_LOST_TEXTS = ("ChangeStreamHistoryLost", "resume point may no longer be in the oplog", "history lost")
PROBE_SECONDS = 5.0  # one probe's time limit: a start the server accepts may make it scan the oplog meanwhile


@dataclass(frozen=True)
class OplogWindow:
    earliest: int | None
    current: int
    how: str
    first: int | None = None

    def reaches(self, after: int) -> bool | None:
        """Whether every change after position ``after`` is still in the oplog (None: the window is unknown)."""
        if self.earliest is None:
            return None
        return after >= self.earliest

    def describe(self) -> str:
        now = f"up to {format_position(self.current)} now"
        if self.earliest is None:
            return f"the oplog window: its start is unknown ({self.how}), {now}"
        if self.first is not None:
            return (
                f"the oplog window: every change after {format_position(self.earliest)} (its first entry is "
                f"{format_position(self.first)}, read from {self.how}), {now}"
            )
        return f"the oplog window: every change after {format_position(self.earliest)} (found by {self.how}), {now}"

    def allowed(self) -> str:
        if self.earliest is None:
            return f"a cluster time the server still holds changes after, at or before {format_position(self.current)}"
        return f"a cluster time from {format_position(self.earliest)} to {format_position(self.current)}"


def gap_before(after: int, first: int | None) -> bool:
    return first is not None and 0 < after < first - 1


class HistoryLost(Exception):
    """The oplog no longer holds every change after the stream's start (see the module docstring)."""

    def __init__(self, table: CapturedCollection | None, cause: str) -> None:
        super().__init__(cause)
        self.table = table
        self.cause = cause


def is_history_lost(error: BaseException) -> bool:
    if not isinstance(error, OperationFailure):
        return False
    if error.code in HISTORY_LOST_CODES:
        return True
    text = f"{error} {getattr(error, 'details', None) or ''}"
    return any(marker.lower() in text.lower() for marker in HISTORY_LOST_TEXTS)


def describe_cause(error: OperationFailure) -> str:
    name = HISTORY_LOST_CODES.get(error.code or 0, "error")
    return f"{name} (code {error.code}): {str(error).splitlines()[0][:300]}"


def earliest_second(reaches_second: Callable[[int], bool], low: int, high: int) -> int | None:
    """The smallest second ``s`` in ``[low, high]`` with ``reaches_second(s)`` (assumed monotone: once the oplog
    holds every change after a time, it holds every change after any later one), or None when ``high`` is not."""
    if low > high or not reaches_second(high):
        return None
    while low < high:
        middle = (low + high) // 2
        if reaches_second(middle):
            high = middle
        else:
            low = middle + 1
    return low


def first_oplog_entry(client: pymongo.MongoClient, natural_order: bool = True) -> int | None:
    """The position of ``local.oplog.rs``'s first entry, or None where it cannot be read.

    ``natural_order`` (a replica set member: ``Capabilities.cluster_time``): the oplog is a capped collection whose
    natural order is the order its entries were written in, so the first record is the first entry (one record
    read). Else (the test server) the entry with the smallest ``ts``: its oplog is an ordinary collection whose
    natural order is not its insertion order (the H2 backend's is the ``_id`` order: the demo's "first" entry by
    ``$natural`` was 3 minutes after its oldest one, and every MongoDB stream run failed "history lost"); it is
    never truncated, and sorting it is the test server's own small cost."""
    try:
        oplog = client.local.get_collection("oplog.rs", read_concern=ReadConcern("local"))
        entry = oplog.find_one({}, {"ts": 1}, sort=[("$natural" if natural_order else "ts", 1)])
    except PyMongoError:  # no role on local (Unauthorized), mongos, no oplog
        return None
    if not entry or "ts" not in entry:
        return None
    try:
        return position_of(entry["ts"])
    except (AttributeError, TypeError):
        return None


def probe_start(client: pymongo.MongoClient, table: CapturedCollection, start: int) -> bool:
    """Whether the server accepts a change stream of ``table`` starting at position ``start`` (inclusive): False
    when it refuses it as history lost; a probe that runs out of time was accepted (the check comes first)."""
    collection = client[table.database][table.collection]
    try:
        with pymongo.timeout(PROBE_SECONDS):
            with collection.watch(
                start_at_operation_time=timestamp_of(max(start, 1)), batch_size=1, max_await_time_ms=10
            ) as stream:
                stream.try_next()
    except PyMongoError as error:
        if is_history_lost(error):
            return False
        if error.timeout:
            return True
        raise
    return True


def read_window(
    client: pymongo.MongoClient, probe: CapturedCollection | None, current: int, natural_order: bool = True
) -> OplogWindow:
    """The oplog window (see the module docstring; ``natural_order`` as for ``first_oplog_entry``)."""
    first = first_oplog_entry(client, natural_order)
    if first is not None:
        return OplogWindow(first - 1, current, "local.oplog.rs", first)
    if probe is None:
        return OplogWindow(None, current, "the user may not read local.oplog.rs and no collection is captured")
    found = earliest_second(lambda s: probe_start(client, probe, (s << 32) | 1), 0, timestamp_of(current).time)
    if found is None:
        return OplogWindow(None, current, "the server refuses even a stream starting now")
    # the probe started at found:1, so every change after found:0 is held
    return OplogWindow(found << 32, current, "change-stream probes (the user may not read local.oplog.rs)")


def _names(tables: Sequence[CapturedCollection]) -> str:
    names = [t.qualified_name for t in tables]
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def history_lost_message(
    source: str, tables: Sequence[CapturedCollection], failed: CapturedCollection | None, recorded: int,
    window: OplogWindow, cause: str,
) -> str:  # fmt: skip
    """The message of a batch stopped by lost history (the stream stays where it was)."""
    streams = f"the change streams of {_names(tables)}"
    if failed is not None:
        streams = f"the change stream of {failed.qualified_name}"
    return (
        f"source {source!r}: history lost: {streams} cannot go on after the recorded position "
        f"{format_position(recorded)} (the stream asset's offset sec:ord): the oplog no longer holds every change "
        f"after it ({cause}); {window.describe()}. Nothing of this batch was applied and the offset did not move. "
        "Two ways on: record a reachable position with the change_offset job "
        f"(timestamp: {window.allowed()}; the changes in between are then never applied, so re-materialize every chunk "
        f"partition of the captured collections afterwards), or set mongodb.on_history_lost: resnapshot on source "
        f"{source!r} (the next batch restarts the stream at the current position and every chunk of every captured "
        "collection is read again)"
    )


def resnapshot_reason(
    source: str, tables: Sequence[CapturedCollection], failed: CapturedCollection | None, recorded: int, restart: int,
    window: OplogWindow, cause: str,
) -> str:  # fmt: skip
    """Why a batch restarted the stream at ``restart`` and every chunk is read again (``on_history_lost:
    resnapshot``)."""
    streams = f"the change streams of {_names(tables)}"
    if failed is not None:
        streams = f"the change stream of {failed.qualified_name}"
    return (
        f"source {source!r}: history lost: {streams} could not go on after the recorded position "
        f"{format_position(recorded)} ({cause}); {window.describe()}. mongodb.on_history_lost is resnapshot: the "
        f"stream restarted at {format_position(restart)} and every chunk of every captured collection is read again "
        "in windows opened after it (the changes in between are not in the changelog)"
    )


def unreachable_message(field: str, text: str, position: int, window: OplogWindow, cause: str = "") -> str:
    """A requested start (``change_offset``'s field or ``startup_timestamp``) before the oplog window."""
    because = f" ({cause})" if cause else ""
    return (
        f"{field}: {text!r} is cluster time {format_position(position)}, before the oplog window: the oplog no longer "
        f"holds every change after it{because}; {window.describe()}; allowed: {window.allowed()}"
    )
