"""Column-wise decoding of the row images of many pgoutput row changes at once.

Contract: ``decode_row_images(messages, column_count)`` takes Insert, Update and Delete messages of one relation
(pgoutput protocol version 1, text values, as ``PgOutputDecoder.decode`` accepts them), all sent under one Relation
message with ``column_count`` columns, and returns their ``RowImages``: per message the operation (``c``, ``u``,
``d``) and whether its old image is the key only; per image (new, old) and column, the text the server sent as an
Arrow string array, NULL where the message has no such image, the value is NULL, or it is an unchanged TOAST value,
and a mask of the unchanged TOAST values. Every value is exactly what ``PgOutputDecoder`` returns for it; a message
that it rejects raises the same ``PgOutputError``, and text that is not UTF-8 raises ``PgOutputError`` too.

The work is done with numpy over all messages together, column by column: a value's offset depends on the lengths
before it in its message, so the decoder walks the columns, not the messages. Python touches each message once, to
join them into one buffer. Memory: a few times the messages' size, so callers pass bounded groups (the stream spills
every ``spill_rows`` changes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cdc_assets.sources.postgres.pgoutput import PgOutputError

_INSERT, _UPDATE, _DELETE = 0x49, 0x55, 0x44  # I U D
_NEW, _KEY, _OLD = 0x4E, 0x4B, 0x4F  # N K O
_TEXT, _NULL, _UNCHANGED = 0x74, 0x6E, 0x75  # t n u


@dataclass(frozen=True)
class Image:
    """One image (new or old row) of every message: ``values[i]`` is column ``i``'s text; ``unchanged[:, i]`` marks
    its unchanged TOAST values; ``present`` marks the messages that carry this image."""

    values: list[pa.Array]
    unchanged: np.ndarray
    present: np.ndarray


@dataclass(frozen=True)
class RowImages:
    ops: np.ndarray  # 'c', 'u' or 'd' per message (numpy unicode)
    old_is_key_only: np.ndarray
    new: Image
    old: Image


def decode_row_images(messages: Sequence[bytes], column_count: int) -> RowImages:
    """See the module docstring."""
    count = len(messages)
    lengths = np.fromiter((len(m) for m in messages), np.int64, count)
    starts = np.zeros(count, np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    ends = starts + lengths
    buffer = np.frombuffer(b"".join(messages), np.uint8)
    if count and lengths.min() < 6:
        raise PgOutputError("row change message shorter than its header")
    kinds = buffer[starts]
    inserts, updates, deletes = kinds == _INSERT, kinds == _UPDATE, kinds == _DELETE
    if not (inserts | updates | deletes).all():
        kind = int(kinds[~(inserts | updates | deletes)][0])
        raise PgOutputError(f"not a row change message: type {chr(kind)!r} (0x{kind:02x})")
    markers = buffer[starts + 5]
    if (inserts & (markers != _NEW)).any():
        raise PgOutputError("insert: expected new tuple marker 'N'")
    has_old = (updates | deletes) & ((markers == _KEY) | (markers == _OLD))
    if (deletes & ~has_old).any():
        raise PgOutputError("delete: expected old tuple marker 'K' or 'O'")
    old, old_ends = _image(buffer, starts + 6, has_old, column_count, ends)
    new_starts = starts + 6
    old_then_new = updates & has_old
    if old_then_new.any():
        after_old = old_ends[old_then_new]
        if (after_old >= ends[old_then_new]).any() or (buffer[after_old] != _NEW).any():
            raise PgOutputError("update: expected new tuple marker 'N'")
        new_starts[old_then_new] = after_old + 1
    if (updates & ~has_old & (markers != _NEW)).any():
        raise PgOutputError("update: expected new tuple marker 'N'")
    new, _ = _image(buffer, new_starts, inserts | updates, column_count, ends)
    ops = np.where(inserts, "c", np.where(updates, "u", "d"))
    return RowImages(ops=ops, old_is_key_only=has_old & (markers == _KEY), new=new, old=old)


def _image(
    buffer: np.ndarray, tuple_starts: np.ndarray, present: np.ndarray, column_count: int, message_ends: np.ndarray
) -> tuple[Image, np.ndarray]:
    """Decode the tuples at ``tuple_starts`` of the ``present`` messages; returns the image (for every message) and
    the offset just after each present message's tuple."""
    count = len(present)
    rows = np.flatnonzero(present)
    ends = np.zeros(count, np.int64)
    if len(rows) == 0:
        empty = [pa.nulls(count, pa.string()) for _ in range(column_count)]
        return Image(empty, np.zeros((count, column_count), bool), present), ends
    offsets = tuple_starts[rows]
    limits = message_ends[rows]
    _check_inside(offsets + 2, limits)
    declared = (buffer[offsets].astype(np.int64) << 8) | buffer[offsets + 1]
    if (declared != column_count).any():
        raise PgOutputError(
            f"tuple with {int(declared[declared != column_count][0])} columns, the relation has {column_count}"
        )
    offsets = offsets + 2
    value_starts = np.zeros((len(rows), column_count), np.int64)
    value_lengths = np.zeros((len(rows), column_count), np.int64)
    texts = np.zeros((len(rows), column_count), bool)
    unchanged = np.zeros((len(rows), column_count), bool)
    words = np.lib.stride_tricks.sliding_window_view(buffer, 4)  # words[i]: the 4 bytes at i, not copied
    for column in range(column_count):
        _check_inside(offsets + 1, limits)  # also checks where the column before it ended
        kind = buffer[offsets]
        text = kind == _TEXT
        if text.all():  # the usual case: every message sent this column's value
            _check_inside(offsets + 5, limits)
            length = _big_endian_uint32(words, offsets + 1)
            value_starts[:, column] = offsets + 5
            value_lengths[:, column] = length
            texts[:, column] = True
            offsets = offsets + 5 + length
            continue
        null, toast = kind == _NULL, kind == _UNCHANGED
        if not (text | null | toast).all():
            bad = int(kind[~(text | null | toast)][0])
            raise PgOutputError(f"unknown tuple value kind {chr(bad)!r}: only text format is requested")
        at = offsets[text]
        _check_inside(at + 5, limits[text])
        length = _big_endian_uint32(words, at + 1)
        value_starts[text, column] = at + 5
        value_lengths[text, column] = length
        texts[:, column] = text
        unchanged[:, column] = toast
        offsets = offsets + 1
        offsets[text] += 4 + length
    _check_inside(offsets, limits)
    ends[rows] = offsets
    values = _columns(buffer, value_starts, value_lengths, texts)
    scatter = np.full(count, -1, np.int64)
    scatter[rows] = np.arange(len(rows))
    take = pa.array(scatter, mask=~present)
    full_unchanged = np.zeros((count, column_count), bool)
    full_unchanged[rows] = unchanged
    return Image([v.take(take) for v in values], full_unchanged, present), ends


def _big_endian_uint32(words: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The unsigned 32-bit big-endian numbers at byte offsets ``at`` (checked inside the buffer), as int64."""
    return words[at].view(">u4").ravel().astype(np.int64)


def _check_inside(offsets: np.ndarray, limits: np.ndarray) -> None:
    if (offsets > limits).any():
        raise PgOutputError("tuple runs past the end of its message")


def _columns(buffer: np.ndarray, starts: np.ndarray, lengths: np.ndarray, texts: np.ndarray) -> list[pa.Array]:
    """One string array per column from the value ranges (row-major: every range lies after the one before it)."""
    rows, columns = starts.shape
    flat_starts, flat_lengths = starts.ravel(), lengths.ravel()
    offsets = np.zeros(rows * columns + 1, np.int64)
    np.cumsum(flat_lengths, out=offsets[1:])
    if offsets[-1] * 8 < len(buffer):  # few bytes of the buffer (an old image of keys only): gather them
        data = buffer[np.repeat(flat_starts - offsets[:-1], flat_lengths) + np.arange(offsets[-1])]
    else:  # most of it: mark the ranges and keep the marked bytes, no index per byte
        nonempty = flat_lengths > 0
        edges = np.zeros(len(buffer) + 1, np.int8)
        edges[flat_starts[nonempty]] = 1
        edges[flat_starts[nonempty] + flat_lengths[nonempty]] -= 1
        data = buffer[np.cumsum(edges[:-1], dtype=np.int8).astype(bool)]
    validity = np.packbits(texts.ravel(), bitorder="little")
    everything = pa.LargeStringArray.from_buffers(
        rows * columns, pa.py_buffer(offsets), pa.py_buffer(data), pa.py_buffer(validity)
    )
    try:
        everything.validate(full=True)
    except pa.ArrowInvalid as error:
        raise PgOutputError(f"row change value is not valid UTF-8 text: {error}") from None
    return [everything.take(pa.array(np.arange(c, rows * columns, columns))).cast(pa.string()) for c in range(columns)]
