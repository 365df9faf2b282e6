"""PostgreSQL log sequence numbers.

Contract: an LSN is handled as a plain ``int`` inside the engine (sortable, storable in a Delta ``long``)
and printed in PostgreSQL's ``X/Y`` form at the edges (SQL parameters, metadata, messages).

``end_of_inserted_wal(insert_lsn, block_size, segment_size)``: ``pg_current_wal_insert_lsn()`` names where the next
record will start; when the WAL inserted so far ends exactly at a page's end, that is past the next page's header
(24 bytes, 40 on a segment's first page), a position no record can end at: the end of the WAL is the page's start.
"""

from __future__ import annotations

import re

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
MAX_LSN = (1 << 64) - 1
SHORT_PAGE_HEADER = 24  # SizeOfXLogShortPHD
LONG_PAGE_HEADER = 40  # SizeOfXLogLongPHD: the first page of a WAL segment


def parse_lsn(text: str) -> int:
    """``'16/B374D848'`` -> int. Raises ``ValueError`` naming the allowed form."""
    match = _LSN_TEXT.match(text.strip()) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"not a PostgreSQL LSN: {text!r} (expected two hex numbers 'XXXXXXXX/XXXXXXXX')")
    return (int(match.group(1), 16) << 32) | int(match.group(2), 16)


def format_lsn(value: int) -> str:
    """int -> ``'16/B374D848'``."""
    if not 0 <= value <= MAX_LSN:
        raise ValueError(f"LSN out of range: {value}")
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


def end_of_inserted_wal(insert_lsn: int, block_size: int, segment_size: int) -> int:
    """The end of the WAL inserted so far, from ``pg_current_wal_insert_lsn()`` (see the module docstring). Nothing
    lies between a page's start and the end of its header, so nothing committed is left out; and a page's start is
    a position the server's flush reaches (its flush LSN stops at the end of the last record, here the page's end),
    which the position past the header is not until more WAL is written."""
    if insert_lsn % segment_size == LONG_PAGE_HEADER:
        return insert_lsn - LONG_PAGE_HEADER
    if insert_lsn % block_size == SHORT_PAGE_HEADER and insert_lsn % segment_size != SHORT_PAGE_HEADER:
        return insert_lsn - SHORT_PAGE_HEADER
    return insert_lsn
