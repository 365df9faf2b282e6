"""PostgreSQL log sequence numbers.

Contract: an LSN is handled as a plain ``int`` inside the engine (sortable, storable in a Delta ``long``)
and printed in PostgreSQL's ``X/Y`` form at the edges (SQL parameters, metadata, messages).
"""

from __future__ import annotations

import re

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
MAX_LSN = (1 << 64) - 1


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
