"""The consistency check of a range of chunks (up to a whole table), a few chunks per watermark window.

Contract: ``check_range(source, spark, table, indexes, chunks_per_window)`` checks the chunks ``indexes`` of
``table`` with ``source.check_chunks``, ``chunks_per_window`` chunks in each window (one source transaction and one
wait for the stream per window), in the order given. A chunk found inconclusive (the stream had not passed its
window's high watermark, a TRUNCATE ran) is checked again, in a new window, after the others: at most ``rounds``
times in all. It returns a ``RangeCheck``: one ``ChunkCheck`` per chunk and what a user needs to act on (which
chunks differ and must be re-materialized, which are still inconclusive). It writes nothing but what
``check_chunks`` writes, and is the same for every source kind: only ``check_chunks`` knows the database.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_assets.source import CdcSource, ChunkCheck


@dataclass(frozen=True)
class RangeCheck:
    table: str
    chunks: tuple[ChunkCheck, ...]

    @property
    def differing(self) -> list[int]:
        """Chunks found conclusively different from the source: re-materialize these partitions."""
        return [c.chunk for c in self.chunks if c.conclusive and not c.matches]

    @property
    def inconclusive(self) -> list[int]:
        return [c.chunk for c in self.chunks if not c.conclusive]

    @property
    def matches(self) -> bool:
        """Every chunk was compared and matched."""
        return not self.differing and not self.inconclusive

    def rows(self) -> tuple[int, int]:
        """Source and mirror rows of the chunks compared (the keys left out of a window are not counted)."""
        compared = [c for c in self.chunks if c.conclusive]
        return sum(c.source_rows for c in compared), sum(c.mirror_rows for c in compared)

    def first_difference(self) -> str | None:
        for check in self.chunks:
            if check.conclusive and not check.matches:
                said = " ".join(part for part in (check.reason, check.first_difference) if part)
                return f"chunk {check.chunk}: {said}"
        return None


def windows(indexes: Sequence[int], per_window: int) -> list[list[int]]:
    """``indexes`` in groups of at most ``per_window``, in order."""
    if per_window < 1:
        raise ValueError(f"chunks_per_window must be a positive integer, got {per_window!r}")
    return [list(indexes[i : i + per_window]) for i in range(0, len(indexes), per_window)]


def check_range(
    source: CdcSource[Any], spark: SparkSession, table: Any, indexes: Sequence[int], chunks_per_window: int,
    wait_seconds: float = 120, rounds: int = 2,
) -> RangeCheck:  # fmt: skip
    """The chunks ``indexes`` of ``table`` checked (see the module docstring)."""
    results: dict[int, ChunkCheck] = {}
    pending = list(indexes)
    for _ in range(rounds):
        for window in windows(pending, chunks_per_window):
            for result in source.check_chunks(spark, table, window, wait_seconds):
                results[result.chunk] = result
        pending = [i for i in pending if not results[i].conclusive]
        if not pending:
            break
    return RangeCheck(table.qualified_name, tuple(results[i] for i in indexes))
