"""A spill part holds each change's images, unchanged-TOAST marks and truncations as the stream's reader wrote them
before the column-wise decode: the rules of ``cdc_assets.sources.postgres.stream`` on hand-built pgoutput messages;
and the parts written on the ``PartWriter``'s threads are those written in place, within its bounds."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import date
from decimal import Decimal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cdc_assets.lake.files import LakePath
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.pg_values import PgColumn
from cdc_assets.sources.postgres.pgoutput import UNCHANGED_TOAST, PgOutputError
from cdc_assets.sources.postgres.stream import PartWriter, TableSpill
from tests.sources.postgres.test_row_images import delete, insert, update

U = UNCHANGED_TOAST
COLUMNS = [
    PgColumn("id", 20, -1, "bigint", "N", None, None, True),
    PgColumn("amount", 1700, (12 << 16 | 2) + 4, "numeric(12,2)", "N", None, None, False),
    PgColumn("day", 1082, -1, "date", "D", None, None, False),
    PgColumn("big", 25, -1, "text", "S", None, None, False),
]
TABLE = CapturedTable("src", "public", "t", tuple(COLUMNS), ("id",), True, False, 1000)


def spill_part(tmp_path: Path, messages: list[bytes], truncates: int = 0) -> tuple[TableSpill, list[dict]]:
    spill = TableSpill(TABLE, list(COLUMNS), LakePath(tmp_path / "t"))
    spill.messages += messages
    spill.commit_lsns += [100] * len(messages)
    spill.seqs += range(len(messages))
    for seq in range(truncates):
        spill.truncate_positions.append((200, seq))
    spill.flush()
    assert spill.pending == 0
    return spill, pq.read_table(spill.parts[-1].path).to_pylist()


def test_images_ops_and_typed_values(tmp_path: Path) -> None:
    _, rows = spill_part(
        tmp_path,
        [
            insert(["1", "12.50", "2024-02-29", "x"]),
            update(["2", None, None, "y"], ["7", None, None, None], b"K"),  # the key changed from 7
            delete(["3", None, None, None], b"K"),
        ],
    )
    assert [(r["_cdc_op"], r["_cdc_commit_lsn"], r["_cdc_seq"]) for r in rows] == [("c", 100, 0), ("u", 100, 1),
                                                                                  ("d", 100, 2)]  # fmt: skip
    assert rows[0]["after"] == {"id": 1, "amount": Decimal("12.50"), "day": date(2024, 2, 29), "big": "x",
                                "_cdc_unrepresentable": None}  # fmt: skip
    assert rows[0]["before"] is None
    assert rows[1]["after"]["id"] == 2 and rows[1]["before"]["id"] == 7 and rows[1]["_cdc_before_key_only"]
    assert rows[2]["after"] is None and rows[2]["before"]["id"] == 3 and rows[2]["_cdc_before_key_only"]
    assert [r["_cdc_unchanged"] for r in rows] == [[], [], []]


def test_unchanged_toast_takes_the_full_old_row_else_is_named(tmp_path: Path) -> None:
    spill, rows = spill_part(
        tmp_path,
        [
            update(["1", "1.00", None, U], ["1", "0.50", None, "old big"], b"O"),  # replica identity FULL
            update(["2", "2.00", None, U], ["2", None, None, None], b"K"),  # only the key: not known
            update(["3", "3.00", None, U]),  # no old row
            update(["4", "4.00", None, U], ["4", "0.50", None, None], b"O"),  # the old row's value is NULL
        ],
    )
    assert [r["after"]["big"] for r in rows] == ["old big", None, None, None]
    assert [r["_cdc_unchanged"] for r in rows] == [[], ["big"], ["big"], ["big"]]
    assert rows[0]["before"]["big"] == "old big"
    assert spill.unchanged_columns == {"big"}


def test_truncations_follow_the_changes_and_a_part_of_truncations_alone(tmp_path: Path) -> None:
    _, rows = spill_part(tmp_path, [insert(["1", None, None, None])], truncates=2)
    assert [(r["_cdc_op"], r["_cdc_commit_lsn"], r["_cdc_seq"]) for r in rows] == [("c", 100, 0), ("t", 200, 0),
                                                                                  ("t", 200, 1)]  # fmt: skip
    assert [(r["after"] is None, r["before"] is None, r["_cdc_unchanged"]) for r in rows[1:]] == [(True, True, [])] * 2
    _, alone = spill_part(tmp_path / "alone", [], truncates=1)
    assert [(r["_cdc_op"], r["after"], r["before"], r["_cdc_unchanged"]) for r in alone] == [("t", None, None, [])]


def test_a_part_written_by_the_writer_threads_is_the_part_written_in_place(tmp_path: Path) -> None:
    messages = [insert([str(n), f"{n}.25", "2024-01-01", "v" * n]) for n in range(1, 40)]
    messages += [delete([str(n), None, None, None]) for n in range(1, 40, 3)]
    _, in_place = spill_part(tmp_path / "in_place", messages, truncates=1)
    writer = PartWriter(2, 1 << 20)
    try:
        spills = [TableSpill(TABLE, list(COLUMNS), LakePath(tmp_path / f"part_{n}"), writer=writer) for n in (0, 1)]
        for spill in spills:  # two parts of each spill, written while the next ones are handed over
            for first, end in ((0, 20), (20, len(messages))):
                spill.messages += messages[first:end]
                spill.commit_lsns += [100] * (end - first)
                spill.seqs += range(first, end)
                spill.pending_bytes += sum(map(len, messages[first:end]))
                if end == len(messages):
                    spill.truncate_positions.append((200, 0))
                spill.flush()
                assert spill.pending == 0 and spill.pending_bytes == 0
        writer.wait()
    finally:
        writer.close()
    for spill in spills:
        assert [p.path.rsplit("/", 1)[-1] for p in spill.parts] == ["part-00000.parquet", "part-00001.parquet"]
        assert [row for part in spill.parts for row in pq.read_table(part.path).to_pylist()] == in_place


def submitting(writer: PartWriter, write: Callable[[], None], size: int, seconds: float) -> threading.Thread:
    """``writer.submit`` on a thread, joined for up to ``seconds``: alive while it waits for room (the writer itself
    is used by one thread at a time: join it before the next call)."""
    thread = threading.Thread(target=writer.submit, args=(write, size), daemon=True)
    thread.start()
    thread.join(seconds)
    return thread


def test_the_writer_holds_at_most_its_threads_and_its_bytes_in_flight_and_raises_a_parts_error() -> None:
    writer = PartWriter(2, 100)
    release = threading.Event()
    written: list[str] = []

    def part(name: str) -> Callable[[], None]:
        def write() -> None:
            release.wait(30)
            written.append(name)

        return write

    try:
        assert not submitting(writer, part("a"), 60, 5).is_alive()
        assert not submitting(writer, part("b"), 40, 5).is_alive()  # two threads, 100 bytes: room for both
        waiting = submitting(writer, part("c"), 10, 0.5)
        assert waiting.is_alive()  # both threads busy: waits for "a"
        release.set()
        waiting.join(5)
        assert not waiting.is_alive()
        writer.wait()
        assert sorted(written) == ["a", "b", "c"]  # "c" may end before "b": it waited for a thread, not for "b"
        release.clear()
        assert not submitting(writer, part("d"), 90, 5).is_alive()
        waiting = submitting(writer, part("e"), 20, 0.5)
        assert waiting.is_alive()  # 110 bytes would be in flight: waits for "d"
        release.set()
        waiting.join(5)
        writer.wait()
        assert written[3:] == ["d", "e"]
        assert not submitting(writer, part("huge"), 500, 5).is_alive()  # larger than the room, none in flight
        writer.wait()
        assert written[-1] == "huge"

        def failing() -> None:
            raise PgOutputError("row change value is not valid UTF-8 text")

        writer.submit(failing, 1)
        with pytest.raises(PgOutputError, match="not valid UTF-8"):
            writer.wait()
        writer.submit(failing, 1)
    finally:
        writer.close()  # the failed part in flight is waited for, its error left to the read
