"""Chunk bounds over ``_id`` keys of mixed types (pure): every id falls in exactly one chunk, chunks follow BSON
order, and Spark's string order of the hex keys is the byte order of the keys."""

import datetime as dt

from bson.binary import Binary
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId

from cdc_assets.engine.chunks import chunks_from_boundaries
from cdc_assets.sources.mongodb.bson_order import sort_key
from cdc_assets.sources.mongodb.catalog import id_key
from cdc_assets.sources.mongodb.snapshot import in_range

IDS = [
    MinKey(), None, -5, Int64(-1), 0, 0.5, 1, Int64(2), 2.5, Decimal128("3.25"), 10**12, "", "a", "a\x00", "ab", "b",
    {"a": 1}, {"a": 1, "b": 2}, {"b": 0}, Binary(b"", 0), Binary(b"\x00", 0), Binary(b"\x00\x01", 0),
    ObjectId("000000000000000000000001"), ObjectId("ffffffffffffffffffffffff"), False, True,
    dt.datetime(1960, 1, 1), dt.datetime(2030, 1, 1), MaxKey(),
]  # fmt: skip


def test_hex_keys_order_as_their_bytes() -> None:
    keys = [sort_key(i) for i in IDS]
    assert keys == sorted(keys)  # IDS is written in BSON order
    assert [id_key(i) for i in IDS] == sorted(id_key(i) for i in IDS)  # and so are the hex texts


def test_every_id_is_in_exactly_one_chunk() -> None:
    keys = sorted(id_key(i) for i in IDS)
    for boundaries in ([], keys[5::5], [keys[1]], keys[1:]):
        chunks = chunks_from_boundaries([(k,) for k in boundaries])
        for value in IDS:
            key = id_key(value)
            inside = [c.index for c in chunks if in_range(key, c.lo and c.lo[0], c.hi and c.hi[0])]
            assert len(inside) == 1, (value, inside)
