"""``check_range`` on hand-built chunk results: windows of ``chunks_per_window`` chunks in the order given,
inconclusive chunks checked again after the others, and what the result names (differing and inconclusive chunks)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from cdc_assets.range_check import check_range, windows
from cdc_assets.source import ChunkCheck


@dataclass(frozen=True)
class Table:
    qualified_name: str = "public.t"
    key_columns: tuple[str, ...] = ("id",)


@dataclass
class HandBuiltChecks:
    """A source whose ``check_chunks`` answers from a script: chunk -> results of its successive checks."""

    script: dict[int, list[str]] = field(default_factory=dict)  # "match", "differ" or "inconclusive"
    windows_asked: list[list[int]] = field(default_factory=list)

    def check_chunks(self, spark: object, table: Table, indexes: Sequence[int], wait_seconds: float = 120):
        self.windows_asked.append(list(indexes))
        results = []
        for index in indexes:
            outcomes = self.script.get(index)
            outcome = outcomes.pop(0) if outcomes else "match"
            results.append(ChunkCheck(
                table.qualified_name, index, conclusive=outcome != "inconclusive", matches=outcome == "match",
                source_rows=10, mirror_rows=10 if outcome == "match" else 9,
                first_difference=f"id={index * 10}" if outcome == "differ" else None,
                reason="stream behind" if outcome == "inconclusive" else None,
            ))  # fmt: skip
        return results


def test_windows_keep_chunk_order_and_refuse_a_bad_size() -> None:
    assert windows([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]
    assert windows([], 3) == []
    with pytest.raises(ValueError, match="chunks_per_window must be a positive integer, got 0"):
        windows([1], 0)


def test_every_chunk_is_checked_in_windows_and_differing_chunks_are_named() -> None:
    source = HandBuiltChecks({2: ["differ"], 5: ["differ"]})
    result = check_range(source, None, Table(), range(7), chunks_per_window=3)
    assert source.windows_asked == [[0, 1, 2], [3, 4, 5], [6]]
    assert [c.chunk for c in result.chunks] == list(range(7))
    assert result.differing == [2, 5] and result.inconclusive == [] and not result.matches
    assert result.first_difference() == "chunk 2: id=20"
    assert result.rows() == (70, 68)


def test_an_inconclusive_window_is_checked_again_after_the_others() -> None:
    source = HandBuiltChecks({1: ["inconclusive", "match"], 3: ["inconclusive", "inconclusive"]})
    result = check_range(source, None, Table(), [0, 1, 2, 3, 4], chunks_per_window=2, rounds=2)
    assert source.windows_asked == [[0, 1], [2, 3], [4], [1, 3]]
    assert result.inconclusive == [3] and result.differing == [] and not result.matches
    assert result.rows() == (40, 40)  # the inconclusive chunk is not counted
    assert check_range(HandBuiltChecks(), None, Table(), [2, 3], chunks_per_window=8).matches
    with pytest.raises(ValueError, match="chunks_per_window"):
        check_range(source, None, Table(), [0], chunks_per_window=0)
