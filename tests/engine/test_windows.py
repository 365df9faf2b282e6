"""Which staged chunk windows are open and which may close, on hand-built window events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from cdc_assets.engine.windows import (
    FILL_CHUNK,
    RECONCILED,
    ROWS_CHUNK,
    STAGED,
    ChunkWindow,
    WindowEvent,
    by_key,
    closable,
    finished_attempts,
    open_windows,
    read_before,
    resnapshot_done,
    unrecorded_attempts,
    waiting_rows_windows,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def window(chunk: int, attempt: str, hw: int, minutes: int = 0, table: str = "public.t") -> ChunkWindow:
    return ChunkWindow(table, chunk, attempt, 10, "5:9:7", hw, 100, T0 + timedelta(minutes=minutes))


def test_staged_window_is_open_until_reconciled() -> None:
    staged = window(0, "a", 500)
    assert open_windows([WindowEvent(STAGED, staged)]) == [staged]
    assert open_windows([WindowEvent(STAGED, staged), WindowEvent(RECONCILED, staged)]) == []


def test_newer_attempt_supersedes_older_one() -> None:
    old, new = window(0, "a", 500, minutes=0), window(0, "b", 900, minutes=5)
    events = [WindowEvent(STAGED, old), WindowEvent(STAGED, new)]
    assert open_windows(events) == [new]
    # reconciling the old attempt does not close the new one
    assert open_windows([*events, WindowEvent(RECONCILED, old)]) == [new]
    assert open_windows([*events, WindowEvent(RECONCILED, new)]) == []


def test_reconciled_attempt_matches_table_and_chunk() -> None:
    a0, a1 = window(0, "run1", 500), window(1, "run1", 500)
    other_table = window(0, "run1", 500, table="public.u")
    events = [WindowEvent(STAGED, a0), WindowEvent(STAGED, a1), WindowEvent(STAGED, other_table)]
    assert open_windows([*events, WindowEvent(RECONCILED, a0)]) == [a1, other_table]


def test_closable_once_the_stream_passed_the_high_watermark() -> None:
    early, late = window(0, "a", 500), window(1, "a", 900)
    assert closable([early, late], 499) == []
    assert closable([early, late], 500) == [early]
    assert closable([early, late], 10_000) == [early, late]


def test_a_fill_window_is_a_window_of_its_own_beside_the_chunks() -> None:
    """A table's fill window (chunk -1) opens and closes like a chunk's, never closes or supersedes a chunk's, and a
    table has one open at a time (the stream opens the next only after the previous one was reconciled)."""
    chunk, fill = window(0, "run1", 500), window(FILL_CHUNK, "fill-1", 700, minutes=1)
    other = window(FILL_CHUNK, "fill-2", 600, table="public.u")
    events = [WindowEvent(STAGED, chunk), WindowEvent(STAGED, fill), WindowEvent(STAGED, other)]
    assert open_windows(events) == [fill, chunk, other]
    assert closable(open_windows(events), 650) == [chunk, other]
    events += [WindowEvent(RECONCILED, fill)]
    assert open_windows(events) == [chunk, other]
    assert finished_attempts(events) == {"public.t": {"fill-1"}}


def test_unknown_event_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown window event 'closed'; allowed: staged, reconciled"):
        open_windows([WindowEvent("closed", window(0, "a", 1))])


def test_attempt_is_finished_once_none_of_its_chunks_is_open() -> None:
    a0, a1 = window(0, "run1", 500), window(1, "run1", 500)
    events = [WindowEvent(STAGED, a0), WindowEvent(STAGED, a1)]
    assert finished_attempts(events) == {}
    # one chunk of the attempt reconciled, the other still waits: its rows are still needed
    assert finished_attempts([*events, WindowEvent(RECONCILED, a0)]) == {}
    assert finished_attempts([*events, WindowEvent(RECONCILED, a0), WindowEvent(RECONCILED, a1)]) == {
        "public.t": {"run1"}
    }


def test_superseded_attempt_is_finished_but_its_successor_waits() -> None:
    old, new = window(0, "a", 500, minutes=0), window(0, "b", 900, minutes=5)
    elsewhere = window(0, "a", 500, table="public.u")  # same attempt id in another table's staging
    events = [WindowEvent(STAGED, old), WindowEvent(STAGED, new), WindowEvent(STAGED, elsewhere)]
    assert finished_attempts(events) == {"public.t": {"a"}}
    assert finished_attempts([*events, WindowEvent(RECONCILED, new)]) == {"public.t": {"a", "b"}}


def test_unrecorded_attempt_is_dropped_only_once_it_is_old_enough() -> None:
    recorded = window(0, "run1", 500)
    elsewhere = window(0, "run3", 500, table="public.u")  # the attempt id is recorded for another table only
    events = [WindowEvent(STAGED, recorded), WindowEvent(STAGED, elsewhere)]
    staged = {"public.t": {"run1": 100.0, "run2": 100.0, "run3": 100.0, "young": 300.0}, "public.v": {"run9": 50.0}}
    assert unrecorded_attempts(events, staged, written_before=200.0) == {
        "public.t": {"run2", "run3"},  # run1 has a window; "young" may still be recorded by its run
        "public.v": {"run9"},
    }
    assert unrecorded_attempts(events, staged, written_before=100.0) == {"public.v": {"run9"}}
    assert unrecorded_attempts([], {}, written_before=1e12) == {}


def read_at(chunk: int, attempt: str, lw: int, table: str = "public.t") -> ChunkWindow:
    return ChunkWindow(table, chunk, attempt, lw, str(lw), lw + 10, 100, T0 + timedelta(minutes=lw))


def test_windows_read_before_a_resnapshot_position_are_never_applied() -> None:
    """A table to be read again after position 100 (the stream restarted there after lost history): its windows
    read before 100 are held back, at or after 100 and other tables' windows are not."""
    old, at, new = read_at(0, "a", 99), read_at(1, "b", 100), read_at(2, "c", 150)
    other = read_at(0, "d", 5, table="public.u")
    assert read_before([old, at, new, other], {"public.t": 100}) == [old]
    assert read_before([old, at, new, other], {}) == []


def test_a_resnapshot_is_done_once_every_chunk_was_reconciled_from_a_read_after_its_position() -> None:
    old0, new0, new1 = read_at(0, "a", 90), read_at(0, "b", 120), read_at(1, "b", 120)
    events = [WindowEvent(STAGED, w) for w in (old0, new0, new1)]
    assert not resnapshot_done([*events, WindowEvent(RECONCILED, old0)], "public.t", [0, 1], 100)
    assert not resnapshot_done([*events, WindowEvent(RECONCILED, new0)], "public.t", [0, 1], 100)  # chunk 1 left
    staged_only = resnapshot_done(events, "public.t", [0, 1], 100)
    assert not staged_only
    both = [*events, WindowEvent(RECONCILED, new0), WindowEvent(RECONCILED, new1)]
    assert resnapshot_done(both, "public.t", [0, 1], 100)
    assert not resnapshot_done(both, "public.t", [0, 1], 121)  # read before a newer restart
    assert not resnapshot_done(both, "public.u", [0], 100)


def test_a_rows_window_and_a_fill_window_of_a_table_never_supersede_each_other() -> None:
    fill, rows = window(FILL_CHUNK, "fill-1", 700), window(ROWS_CHUNK, "rows-1", 650, minutes=1)
    newer_rows = window(ROWS_CHUNK, "rows-2", 800, minutes=2)
    events = [WindowEvent(STAGED, fill), WindowEvent(STAGED, rows)]
    assert open_windows(events) == [rows, fill]  # sorted by chunk: -2 before -1
    assert open_windows([*events, WindowEvent(STAGED, newer_rows)]) == [newer_rows, fill]
    assert open_windows([*events, WindowEvent(RECONCILED, rows)]) == [fill]
    assert [by_key(c) for c in (ROWS_CHUNK, FILL_CHUNK, 0, 7)] == [True, True, False, False]


def test_a_waiting_rows_window_is_open_and_not_read_before_a_resnapshot_marker() -> None:
    rows, other = window(ROWS_CHUNK, "rows-1", 650), window(ROWS_CHUNK, "rows-2", 660, table="public.u")
    events = [WindowEvent(STAGED, rows), WindowEvent(STAGED, other), WindowEvent(STAGED, window(0, "run1", 500))]
    assert waiting_rows_windows(events, {}) == {"public.t": rows, "public.u": other}
    assert waiting_rows_windows([*events, WindowEvent(RECONCILED, rows)], {}) == {"public.u": other}
    # read before the stream restarted after lost history (lw_lsn 10 < 11): never applied, so it waits for nothing
    assert waiting_rows_windows(events, {"public.u": 11}) == {"public.t": rows}
