"""Chunk windows: which staged chunk reads still wait for reconciliation, and which may close now.

Contract:
- A ``ChunkWindow`` is one attempt at reading one chunk: the low watermark (``low_watermark``: the source's text
  of it, opaque here and read by the source's ``SettledRule``, ``cdc_assets.lake.settled``; PostgreSQL: the
  ``pg_current_snapshot()`` text; and ``lw_lsn``, the source's position taken just before it: for diagnosis, and
  for the re-snapshot rule below), and the high watermark ``hw`` (a position of the change stream).
- The window log holds events ``staged`` (an attempt's rows are in staging) and ``reconciled`` (that attempt was
  applied to the mirror). ``open_windows(events)``: for each chunk, its latest staged attempt, unless that attempt is
  reconciled. An older attempt is superseded by a newer one (a re-materialized partition) and never applied.
- ``finished_attempts(events)``: per table, the staged attempts none of whose windows is open (each was reconciled
  or superseded): their staged rows are never read again, so staging may drop them.
- ``unrecorded_attempts(events, staged, written_before)``: of ``staged`` (per table, each staged attempt with the
  time its newest staged file was written), the attempts no window event names and whose newest file was written
  before ``written_before``: left by a snapshot run that died between its staging write and its window record (its
  rerun staged a new attempt). A run records its windows seconds after its staging write, so with a
  ``written_before`` far enough back (the upkeep: one day) no window will name them, and staging may drop them.
- A window of chunk ``FILL_CHUNK`` (-1) is a **fill window** of its table: the stream read, by key, the rows whose
  mirror rows hold unknown values (``cdc_assets.lake.mirror``), inside a watermark window of its own. It is open,
  superseded and closed like a chunk's (one per table at a time), and reconciled by the same rule, without a key
  range.
- A window of chunk ``ROWS_CHUNK`` (-2) is a **rows window** of its table: an ad-hoc snapshot of the rows matching a
  filter (``cdc_assets.engine.row_filter``; the ``<source>_snapshot_rows`` job), read inside a watermark window of
  its own and reconciled like a fill window (by key, without a key range: nothing deleted). Its own chunk number, so
  a fill window and a rows window of a table never supersede each other; one per table at a time (a new one would
  supersede a waiting one, so the job refuses to start one while another waits: ``waiting_rows_windows``).
  ``by_key(chunk)``: the window read rows by key or by filter (a fill or a rows window), not a chunk's key range;
  such windows are not partitions of the table's asset.
- ``closable(windows, applied_lsn)``: the open windows whose ``hw`` the stream has passed (``hw <= applied_lsn``):
  every transaction visible to their reads is in the lake, so they can be reconciled.
- Re-snapshots after lost history (``SourceLake.mark_resnapshot``: every chunk of a table read again in windows whose
  reads start at or after a position ``since``, where the stream restarted). ``read_before(windows, since)``: the
  windows of such tables whose reads started before it (``lw_lsn < since[table]``): the changes the source lost are
  not in the changelog, so their reconciliation could keep a document those changes replaced or deleted; they are
  never applied (a window read after ``since`` supersedes each). ``resnapshot_done(events, table, chunks, since)``:
  every one of ``chunks`` has a reconciled window of ``table`` read at or after ``since``: the table is whole again.
- ``WindowStart``: what the reads of a window know of it when they start: the position taken just before the low
  watermark (``lw_lsn`` of its windows) and the time it was taken. A chunk's staged files carry them as the mirror's
  row columns, so that a chunk the mirror can take whole is landed without rewriting its rows
  (``cdc_assets.lake.adopt``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

STAGED = "staged"
FILL_CHUNK = -1
ROWS_CHUNK = -2
RECONCILED = "reconciled"


@dataclass(frozen=True)
class ChunkWindow:
    table: str
    chunk: int
    attempt: str
    lw_lsn: int
    low_watermark: str  # the source's text of it (opaque to the engine)
    hw: int
    rows: int
    at: datetime


@dataclass(frozen=True)
class WindowStart:
    position: int
    at: datetime


@dataclass(frozen=True)
class WindowEvent:
    event: str
    window: ChunkWindow


def open_windows(events: Iterable[WindowEvent]) -> list[ChunkWindow]:
    latest: dict[tuple[str, int], ChunkWindow] = {}
    reconciled: set[str] = set()
    for item in events:
        key = (item.window.table, item.window.chunk)
        if item.event == STAGED:
            current = latest.get(key)
            if current is None or (item.window.at, item.window.attempt) > (current.at, current.attempt):
                latest[key] = item.window
        elif item.event == RECONCILED:
            reconciled.add(item.window.attempt + f"@{item.window.table}@{item.window.chunk}")
        else:
            raise ValueError(f"unknown window event {item.event!r}; allowed: {STAGED}, {RECONCILED}")
    return sorted(
        (w for w in latest.values() if f"{w.attempt}@{w.table}@{w.chunk}" not in reconciled),
        key=lambda w: (w.table, w.chunk),
    )


def by_key(chunk: int) -> bool:
    return chunk < 0


def waiting_rows_windows(events: Iterable[WindowEvent], since: Mapping[str, int]) -> dict[str, ChunkWindow]:
    """Per table, its rows window that waits for the stream (open and not read before a re-snapshot marker's
    position ``since``: such a window is never applied, and waits for nothing)."""
    pending = [w for w in open_windows(events) if w.chunk == ROWS_CHUNK]
    stale = set(read_before(pending, since))
    return {w.table: w for w in pending if w not in stale}


def closable(windows: Iterable[ChunkWindow], applied_lsn: int) -> list[ChunkWindow]:
    return [w for w in windows if w.hw <= applied_lsn]


def read_before(windows: Iterable[ChunkWindow], since: Mapping[str, int]) -> list[ChunkWindow]:
    return [w for w in windows if w.table in since and w.lw_lsn < since[w.table]]


def resnapshot_done(events: Iterable[WindowEvent], table: str, chunks: Iterable[int], since: int) -> bool:
    covered = {
        item.window.chunk
        for item in events
        if item.event == RECONCILED and item.window.table == table and item.window.lw_lsn >= since
    }
    return set(chunks) <= covered


def finished_attempts(events: Iterable[WindowEvent]) -> dict[str, set[str]]:
    events = list(events)
    still_open = {(w.table, w.attempt) for w in open_windows(events)}
    finished: dict[str, set[str]] = {}
    for item in events:
        key = (item.window.table, item.window.attempt)
        if item.event == STAGED and key not in still_open:
            finished.setdefault(item.window.table, set()).add(item.window.attempt)
    return finished


def unrecorded_attempts(
    events: Iterable[WindowEvent], staged: Mapping[str, Mapping[str, float]], written_before: float
) -> dict[str, set[str]]:
    recorded = {(item.window.table, item.window.attempt) for item in events}
    unrecorded: dict[str, set[str]] = {}
    for table, attempts in staged.items():
        for attempt, newest in attempts.items():
            if (table, attempt) not in recorded and newest < written_before:
                unrecorded.setdefault(table, set()).add(attempt)
    return unrecorded
