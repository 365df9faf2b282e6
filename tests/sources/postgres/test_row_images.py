"""The column-wise decoder of row images gives, for every value, what the message-by-message decoder gives."""

from __future__ import annotations

import random
import struct

import pytest

from cdc_assets.sources.postgres.pgoutput import UNCHANGED_TOAST, PgOutputDecoder, PgOutputError, RowChange
from cdc_assets.sources.postgres.row_images import decode_row_images

RELATION_ID = 16384
COLUMNS = 5


def relation_message(columns: int = COLUMNS) -> bytes:
    body = struct.pack("!I", RELATION_ID) + b"public\0t\0" + b"d" + struct.pack("!h", columns)
    for index in range(columns):
        body += bytes([1 if index == 0 else 0]) + f"c{index}".encode() + b"\0" + struct.pack("!Ii", 25, -1)
    return b"R" + body


BEGIN = b"B" + struct.pack("!QqI", 0x100, 0, 700)


def tuple_bytes(values: list[object]) -> bytes:
    out = struct.pack("!h", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value is UNCHANGED_TOAST:
            out += b"u"
        else:
            encoded = str(value).encode()
            out += b"t" + struct.pack("!i", len(encoded)) + encoded
    return out


def insert(new: list[object]) -> bytes:
    return b"I" + struct.pack("!I", RELATION_ID) + b"N" + tuple_bytes(new)


def update(new: list[object], old: list[object] | None = None, marker: bytes = b"O") -> bytes:
    head = b"U" + struct.pack("!I", RELATION_ID)
    if old is not None:
        head += marker + tuple_bytes(old)
    return head + b"N" + tuple_bytes(new)


def delete(old: list[object], marker: bytes = b"K") -> bytes:
    return b"D" + struct.pack("!I", RELATION_ID) + marker + tuple_bytes(old)


TEXTS = ["", "0", "plain", 'quote " and \\ backslash', "line\nbreak\ttab", "é ü 日本 🦆", "x" * 3000, "NULL"]


def random_value(rng: random.Random, unchanged: bool = True) -> object:
    roll = rng.random()
    if roll < 0.15:
        return None
    if unchanged and roll < 0.25:
        return UNCHANGED_TOAST
    return rng.choice(TEXTS) if rng.random() < 0.5 else str(rng.randint(-(10**12), 10**12))


def random_message(rng: random.Random) -> bytes:
    new = [random_value(rng) for _ in range(COLUMNS)]
    old = [random_value(rng) for _ in range(COLUMNS)]
    key_only = [old[0], *[None] * (COLUMNS - 1)]
    return rng.choice(
        [
            lambda: insert([random_value(rng, unchanged=False) for _ in range(COLUMNS)]),
            lambda: update(new),
            lambda: update(new, key_only, b"K"),
            lambda: update(new, old, b"O"),
            lambda: delete(key_only, b"K"),
            lambda: delete(old, b"O"),
        ]
    )()


def expected(messages: list[bytes]) -> list[RowChange]:
    decoder = PgOutputDecoder()
    decoder.decode(relation_message())
    decoder.decode(BEGIN)
    changes = [decoder.decode(m) for m in messages]
    assert all(isinstance(c, RowChange) for c in changes)
    return changes  # type: ignore[return-value]


def as_text(value: object) -> object:
    return None if value is UNCHANGED_TOAST else value


@pytest.mark.parametrize("seed", range(12))
def test_every_value_equals_the_message_decoder(seed: int) -> None:
    rng = random.Random(seed)
    messages = [random_message(rng) for _ in range(rng.choice([1, 7, 300]))]
    images = decode_row_images(messages, COLUMNS)
    for row, change in enumerate(expected(messages)):
        assert images.ops[row] == change.op
        assert bool(images.old_is_key_only[row]) == change.old_is_key_only
        for image, values in ((images.new, change.new), (images.old, change.old)):
            assert bool(image.present[row]) == (values is not None)
            for column in range(COLUMNS):
                value = None if values is None else values[column]
                assert image.values[column][row].as_py() == as_text(value), (row, column)
                assert bool(image.unchanged[row, column]) == (value is UNCHANGED_TOAST), (row, column)


def test_no_messages_give_empty_images() -> None:
    images = decode_row_images([], COLUMNS)
    assert len(images.ops) == 0
    assert [len(v) for v in images.new.values] == [0] * COLUMNS


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (insert(["1"] * COLUMNS)[:-2], "past the end"),
        (insert(["1"] * (COLUMNS - 1)), "tuple with 4 columns"),
        (insert(["1"] * COLUMNS).replace(b"t\0\0\0\x011", b"b\0\0\0\x011", 1), "unknown tuple value kind 'b'"),
        (b"I" + struct.pack("!I", RELATION_ID) + b"X" + tuple_bytes(["1"] * COLUMNS), "expected new tuple marker"),
        (update(["1"] * COLUMNS, ["1"] * COLUMNS, b"K")[: -len(tuple_bytes(["1"] * COLUMNS)) - 1], "marker 'N'"),
        (b"D" + struct.pack("!I", RELATION_ID) + b"N" + tuple_bytes(["1"] * COLUMNS), "marker 'K' or 'O'"),
        (b"B" + struct.pack("!QqI", 1, 2, 3), "not a row change"),
        (insert(["1", "2", "3", "4", "5"]).replace(b"\x015", b"\x01\xff", 1), "not valid UTF-8"),
    ],
)
def test_malformed_messages_raise(message: bytes, error: str) -> None:
    good = insert(["a"] * COLUMNS)
    with pytest.raises(PgOutputError, match=error):
        decode_row_images([good, message, good], COLUMNS)
