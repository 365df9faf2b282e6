"""Chunk planning: split a table's key space into ranges of about ``chunk_size`` rows.

Contract:
- A ``Chunk`` is the half-open key range ``[lo, hi)`` of a table, compared lexicographically over the key columns
  in the source's order. ``lo is None`` means unbounded below (the first chunk); ``hi is None`` means open-ended
  (the last chunk: rows inserted after planning beyond the last boundary belong to it, and arrive by stream).
  Bounds are tuples of the key values in the source's *text* form (``str``), so they serialize to JSON exactly and
  are cast back to the column type where they are used.
- Chunks of one plan are contiguous and cover the whole key space: chunk ``i`` ends where chunk ``i+1`` starts.
- ``plan_even_integer_chunks`` splits ``[min, max]`` of a single integer key evenly, when the keys are dense enough
  (``distribution_factor`` = (max - min + 1) / rows within ``EVEN_SPLIT_FACTOR_RANGE``, as Flink CDC does);
  otherwise the caller finds boundaries by ordered scans and uses ``chunks_from_boundaries``.
- A plan is immutable once stored: partitions are named by chunk index, and an index always means one range.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

EVEN_SPLIT_FACTOR_RANGE = (0.05, 1000.0)

KeyBound = tuple[str, ...]


@dataclass(frozen=True)
class Chunk:
    index: int
    lo: KeyBound | None
    hi: KeyBound | None

    @property
    def partition_key(self) -> str:
        return chunk_partition_key(self.index)

    def describe(self) -> str:
        low = "-inf" if self.lo is None else ",".join(self.lo)
        high = "+inf" if self.hi is None else ",".join(self.hi)
        return f"[{low}, {high})"


def chunk_partition_key(index: int) -> str:
    return f"chunk-{index:06d}"


def chunk_index(partition_key: str) -> int:
    prefix = "chunk-"
    if not partition_key.startswith(prefix) or not partition_key[len(prefix) :].isdigit():
        raise ValueError(f"not a chunk partition key: {partition_key!r} (expected 'chunk-NNNNNN')")
    return int(partition_key[len(prefix) :])


@dataclass(frozen=True)
class ChunkPlan:
    """The stored chunking of one table: key columns and contiguous chunks."""

    table: str
    key_columns: tuple[str, ...]
    chunks: tuple[Chunk, ...]

    def chunk(self, partition_key: str) -> Chunk:
        index = chunk_index(partition_key)
        if not 0 <= index < len(self.chunks):
            raise KeyError(f"{self.table}: no chunk {partition_key}; the plan has {len(self.chunks)} chunks")
        return self.chunks[index]

    def to_json(self) -> str:
        return json.dumps(
            {
                "table": self.table,
                "key_columns": list(self.key_columns),
                "chunks": [{"index": c.index, "lo": c.lo, "hi": c.hi} for c in self.chunks],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> ChunkPlan:
        raw = json.loads(text)
        chunks = tuple(
            Chunk(
                c["index"],
                None if c["lo"] is None else tuple(c["lo"]),
                None if c["hi"] is None else tuple(c["hi"]),
            )
            for c in raw["chunks"]
        )
        plan = cls(raw["table"], tuple(raw["key_columns"]), chunks)
        validate_plan(plan)
        return plan


def chunks_from_boundaries(boundaries: Sequence[KeyBound]) -> tuple[Chunk, ...]:
    """Contiguous chunks split at ``boundaries`` (sorted, distinct): first unbounded below, last open-ended."""
    edges: list[KeyBound | None] = [None, *boundaries, None]
    return tuple(Chunk(i, edges[i], edges[i + 1]) for i in range(len(edges) - 1))


def distribution_factor(minimum: int, maximum: int, rows: int) -> float:
    return (maximum - minimum + 1) / max(rows, 1)


def plan_even_integer_chunks(minimum: int, maximum: int, rows: int, chunk_size: int) -> tuple[Chunk, ...] | None:
    """Even split of a single integer key, or ``None`` when the keys are too sparse or too dense for it."""
    if rows <= 0 or maximum < minimum:
        return chunks_from_boundaries([])
    factor = distribution_factor(minimum, maximum, rows)
    low, high = EVEN_SPLIT_FACTOR_RANGE
    if not low <= factor <= high:
        return None
    step = max(1, math.ceil(chunk_size * factor))
    boundaries = [(str(value),) for value in range(minimum + step, maximum + 1, step)]
    return chunks_from_boundaries(boundaries)


def validate_plan(plan: ChunkPlan) -> None:
    """Raise ``ValueError`` unless the chunks are numbered 0..n-1 and contiguous from -inf to +inf."""
    chunks = plan.chunks
    if not chunks or chunks[0].lo is not None or chunks[-1].hi is not None:
        raise ValueError(f"{plan.table}: chunk plan must start unbounded and end open-ended")
    for expected, chunk in enumerate(chunks):
        if chunk.index != expected:
            raise ValueError(f"{plan.table}: chunk {chunk.index} out of order (expected {expected})")
        if expected and chunks[expected - 1].hi != chunk.lo:
            raise ValueError(f"{plan.table}: chunks {expected - 1} and {expected} are not contiguous")
