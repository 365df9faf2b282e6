"""A spill part holds each change's images, unchanged-TOAST marks and truncations as the stream's reader wrote them
before the column-wise decode: the rules of ``cdc_assets.sources.postgres.stream`` on hand-built pgoutput messages."""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from pathlib import Path

import pyarrow.parquet as pq

from cdc_assets.lake.files import LakePath
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.pg_values import PgColumn
from cdc_assets.sources.postgres.pgoutput import UNCHANGED_TOAST
from cdc_assets.sources.postgres.stream import TableSpill
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
    for seq, message in enumerate(messages):
        spill.messages.append(message)
        spill.positions.append((100, seq))
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
