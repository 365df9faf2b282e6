"""The MongoDB half of the per-chunk consistency check (the check itself: ``cdc_assets.consistency``).

Contract: ``MongoCheckSession`` (a ``cdc_assets.dialect.CheckSession``): the low and high watermarks are the current
position (the dialect's ``current_position``). Each checked chunk's documents are read once, after the low watermark
(on a real server in a causally consistent session that starts at it, so every change settled at the low watermark
is seen; the same read as a snapshot chunk, ``snapshot.read_chunk``), and kept for the session: count, digests, the
left-out keys and the first difference all come from that one read. It is not a point-in-time view: a document that
changed while it was read changed after the low watermark, so its key is among those the check leaves out on both
sides. A document's digest is ``cdc_assets.lake.digest``'s over its lake columns' texts (``_id_key``, ``_id`` and
``document``, canonical extended JSON, then one text per declared field); the mirror side computes the same on Spark.
A declared field's text is the canonical extended JSON of a value that does not fit (``_cdc_unrepresentable``), else
its typed value spelled alike on both sides (``typed_text`` / ``mirror_typed_text``): strings as they are, integers
and decimals in decimal (a decimal with its scale's digits), booleans ``true``/``false``, doubles as their IEEE bits
in hex (``NaN`` for any NaN), timestamps as microseconds since the epoch, dates as days since it, binary as hex; NULL
stays NULL. So typed columns are checked too: a mirror row written before a field was declared (NULL there, the
document holding a value) is reported until a change or a snapshot of its chunk fills it. A key's text is its
``_id_key``. Nothing is written to the source.
"""

from __future__ import annotations

import datetime as dt
import math
import struct
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.engine.chunks import Chunk
from cdc_assets.lake.digest import mirror_digest, text_digest
from cdc_assets.lake.schema import UNREPRESENTABLE_COLUMN, spark_type
from cdc_assets.sources.mongodb.catalog import COLUMNS, KEY_COLUMN, CapturedCollection
from cdc_assets.sources.mongodb.typed_fields import arrow_type

# (collection, lo, hi, low watermark) -> the chunk's documents as lake rows
ChunkReader = Callable[[CapturedCollection, str | None, str | None, int], list[dict[str, Any]]]


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def typed_text(value: Any) -> str | None:
    """A typed value (as a staged row holds it) spelled as ``mirror_typed_text`` spells the mirror's."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else struct.pack(">d", value).hex()
    if isinstance(value, dt.datetime):
        return str((value - _EPOCH) // dt.timedelta(microseconds=1))
    if isinstance(value, dt.date):
        return str((value - _EPOCH.date()).days)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Decimal):
        return format(value, "f")
    return str(value)


def mirror_typed_text(value: Column, data_type: T.DataType) -> Column:
    if isinstance(data_type, T.DoubleType):
        bits = F.java_method(F.lit("java.lang.Double"), F.lit("doubleToRawLongBits"), value).cast("long")
        digits = F.lpad(F.lower(F.hex(bits)), 16, "0")
        return F.when(value.isNull(), F.lit(None)).when(F.isnan(value), F.lit("NaN")).otherwise(digits)
    if isinstance(data_type, T.TimestampType):
        return F.unix_micros(value).cast("string")
    if isinstance(data_type, T.DateType):
        return F.unix_date(value).cast("string")
    if isinstance(data_type, T.BinaryType):
        return F.lower(F.hex(value))
    return value.cast("string")  # strings, integers, decimals (with the scale's digits), booleans (true/false)


def source_texts(table: CapturedCollection, row: dict[str, Any]) -> dict[str, str | None]:
    """A staged row's texts by column: the fixed columns', then each declared field's."""
    texts: dict[str, str | None] = {c: row[c] for c in COLUMNS}
    unrepresentable = dict(row.get(UNREPRESENTABLE_COLUMN) or [])
    for declared in table.fields:
        text = unrepresentable.get(declared.name)
        texts[declared.name] = text if text is not None else typed_text(row.get(declared.name))
    return texts


def mirror_texts(table: CapturedCollection) -> list[Column]:
    texts = [F.col(c).alias(c) for c in COLUMNS]
    for declared in table.fields:
        column = F.col("`" + declared.name.replace("`", "``") + "`")
        typed = mirror_typed_text(column, spark_type(arrow_type(declared.type)))
        texts.append(F.coalesce(F.col(UNREPRESENTABLE_COLUMN)[declared.name], typed).alias(declared.name))
    return texts


def row_digest(row: dict[str, Any], table: CapturedCollection | None = None) -> int:
    if table is None or not table.fields:
        return text_digest([row[c] for c in COLUMNS])
    return text_digest(list(source_texts(table, row).values()))


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
            results.append((len(rows), sum(row_digest(r, table) for r in rows)))
        return results

    def high_watermark(self) -> int:
        return self.current_position()

    def summary_of_keys(self, table: CapturedCollection, chunk: Chunk, key_texts: list[str]) -> tuple[int, int]:
        wanted = set(key_texts)
        rows = [r for r in self._rows(table, chunk) if r[KEY_COLUMN] in wanted]
        return len(rows), sum(row_digest(r, table) for r in rows)

    def key_digests(self, table: CapturedCollection, chunk: Chunk) -> list[tuple[str, int]]:
        return [(r[KEY_COLUMN], row_digest(r, table)) for r in self._rows(table, chunk)]

    def row_texts(self, table: CapturedCollection, chunk: Chunk, key_text: str) -> dict[str, str | None] | None:
        for row in self._rows(table, chunk):
            if row[KEY_COLUMN] == key_text:
                return source_texts(table, row)
        return None

    def mirror_row_digest(self, table: CapturedCollection) -> Column:
        return mirror_digest(mirror_texts(table))

    def mirror_key_text(self, table: CapturedCollection, with_unrepresentable: bool) -> Column:
        return F.col(KEY_COLUMN)

    def mirror_column_texts(self, table: CapturedCollection) -> list[Column]:
        return mirror_texts(table)
