"""The MongoDB half of the per-chunk consistency check (the check itself: ``cdc_assets.consistency``).

Contract: ``MongoCheckSession`` (a ``cdc_assets.dialect.CheckSession``): the low and high watermarks are the current
position (the dialect's ``current_position``). Each checked chunk's documents are read once, after the low watermark
(on a real server in a causally consistent session that starts at it, so every change settled at the low watermark
is seen; the same read as a snapshot chunk, ``snapshot.read_chunk``), and kept for the session: count, digests, the
left-out keys and the first difference all come from that one read. It is not a point-in-time view: a document that
changed while it was read changed after the low watermark, so its key is among those the check leaves out on both
sides. A document's digest is ``cdc_assets.lake.digest``'s over its lake columns' texts (``_id_key``, ``_id`` and
``document``, canonical extended JSON); the mirror side computes the same on Spark. A key's text is its
``_id_key``. Nothing is written to the source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pyspark.sql import Column
from pyspark.sql import functions as F

from cdc_assets.engine.chunks import Chunk
from cdc_assets.lake.digest import mirror_digest, text_digest
from cdc_assets.sources.mongodb.catalog import COLUMNS, KEY_COLUMN, CapturedCollection

# (collection, lo, hi, low watermark) -> the chunk's documents as lake rows
ChunkReader = Callable[[CapturedCollection, str | None, str | None, int], list[dict[str, Any]]]


def row_digest(row: dict[str, Any]) -> int:
    return text_digest([row[c] for c in COLUMNS])


class MongoCheckSession:
    def __init__(self, current_position: Callable[[], int], read_chunk: ChunkReader) -> None:
        self.current_position = current_position
        self.read_chunk = read_chunk
        self.low = 0
        self.read: dict[tuple[str, int], list[dict[str, Any]]] = {}

    def low_watermark(self) -> str:
        self.low = self.current_position()
        return str(self.low)

    def current_table(self, table: CapturedCollection) -> CapturedCollection:
        return table

    def _rows(self, table: CapturedCollection, chunk: Chunk) -> list[dict[str, Any]]:
        key = (table.qualified_name, chunk.index)
        if key not in self.read:
            lo = None if chunk.lo is None else chunk.lo[0]
            hi = None if chunk.hi is None else chunk.hi[0]
            self.read[key] = self.read_chunk(table, lo, hi, self.low)
        return self.read[key]

    def summaries(self, table: CapturedCollection, chunks: Sequence[Chunk]) -> list[tuple[int, int]]:
        results = []
        for chunk in chunks:
            rows = self._rows(table, chunk)
            results.append((len(rows), sum(row_digest(r) for r in rows)))
        return results

    def high_watermark(self) -> int:
        return self.current_position()

    def summary_of_keys(self, table: CapturedCollection, chunk: Chunk, key_texts: list[str]) -> tuple[int, int]:
        wanted = set(key_texts)
        rows = [r for r in self._rows(table, chunk) if r[KEY_COLUMN] in wanted]
        return len(rows), sum(row_digest(r) for r in rows)

    def key_digests(self, table: CapturedCollection, chunk: Chunk) -> list[tuple[str, int]]:
        return [(r[KEY_COLUMN], row_digest(r)) for r in self._rows(table, chunk)]

    def row_texts(self, table: CapturedCollection, chunk: Chunk, key_text: str) -> dict[str, str | None] | None:
        for row in self._rows(table, chunk):
            if row[KEY_COLUMN] == key_text:
                return {c: row[c] for c in COLUMNS}
        return None

    def mirror_row_digest(self, table: CapturedCollection) -> Column:
        return mirror_digest([F.col(c) for c in COLUMNS])

    def mirror_key_text(self, table: CapturedCollection, with_unrepresentable: bool) -> Column:
        return F.col(KEY_COLUMN)

    def mirror_column_texts(self, table: CapturedCollection) -> list[Column]:
        return [F.col(c).alias(c) for c in COLUMNS]
