"""Row digests that a source and Spark compute alike: the scheme every consistency check uses.

Contract: a row's digest is the first 64 bits, as a signed integer, of the MD5 of its column texts in order, each
written as ``<UTF-8 byte length>:<text>`` or ``~`` for NULL (self-delimiting, so no text can shift into its
neighbour). ``text_digest`` computes it in Python, ``mirror_digest`` as a Spark column over text columns, and
``mirror_part`` is one column's part (also a key's text when concatenated). A source kind decides only the texts
(PostgreSQL: its output functions, ``sources/postgres/row_digest.py``; MongoDB: canonical extended JSON).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from pyspark.sql import Column
from pyspark.sql import functions as F


def text_part(text: str | None) -> str:
    return "~" if text is None else f"{len(text.encode())}:{text}"


def text_digest(texts: Sequence[str | None]) -> int:
    value = int(hashlib.md5("".join(text_part(t) for t in texts).encode()).hexdigest()[:16], 16)
    return value - (1 << 64) if value >= 1 << 63 else value


def mirror_part(text: Column) -> Column:
    return F.when(text.isNull(), F.lit("~")).otherwise(F.concat(F.octet_length(text).cast("string"), F.lit(":"), text))


def mirror_digest(texts: Sequence[Column]) -> Column:
    return F.conv(F.substring(F.md5(F.concat(*[mirror_part(t) for t in texts])), 1, 16), 16, -10).cast("long")
