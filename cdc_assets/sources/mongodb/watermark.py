"""Positions of the MongoDB source: cluster times as ordered integers, resume tokens, and the settled rule.

Contract:
- ``position_of(ts)`` is ``(ts.time << 32) | ts.inc`` of a BSON ``Timestamp`` (a cluster time); ``timestamp_of`` is
  its inverse. Integer order is cluster-time order. The events of one transaction share a cluster time, so one
  position can carry several events; ``_cdc_seq`` orders them inside it.
- ``token_position(token)`` reads the cluster time inside a resume token (``{"_data": hex}``, the hex text alone,
  or its JSON): MongoDB's KeyString form (``82`` then the 8-byte timestamp, as Debezium reads it) and the test
  server's (exactly 16 hex digits: seconds, increment). Anything else raises ``ValueError`` naming both forms.
- ``parse_timestamp(text)``: ``SEC`` or ``SEC:ORD`` (decimal), the position of ``(SEC, ORD)`` (``SEC`` alone is
  ``SEC:0``, before every event of that second). ``ValueError`` names the allowed forms.
- ``MongoSettledRule``: an event is settled at a low watermark when its position is at or below it (the low
  watermark's text is the decimal position). Sound because every event at or before the low watermark is visible
  to the window's reads (``cdc_assets.sources.mongodb.dialect``, docs/mongodb.md), and an event after it is
  unsettled, so its key is dropped from the staged rows and the stream's change stands.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from bson.timestamp import Timestamp

MAX_INC = (1 << 32) - 1
_HEX = re.compile(r"^[0-9A-Fa-f]+$")
TOKEN_FORMS = (
    'a resume token as {"_data": "<hex>"} or its hex text: MongoDB\'s form (82 then the cluster time) or the '
    "test server's (16 hex digits)"
)
TIMESTAMP_FORMS = "SEC or SEC:ORD (the cluster time's seconds and increment, decimal)"


def position_of(ts: Timestamp) -> int:
    return (int(ts.time) << 32) | int(ts.inc)


def timestamp_of(position: int) -> Timestamp:
    if position < 0:
        raise ValueError(f"a position is not negative: {position}")
    return Timestamp(position >> 32, position & MAX_INC)


def format_position(position: int) -> str:
    ts = timestamp_of(position)
    return f"{ts.time}:{ts.inc}"


def token_text(token: Any) -> str:
    """The ``_data`` hex of a resume token given as a mapping, a JSON text of one, or the hex itself."""
    if isinstance(token, Mapping):
        data = token.get("_data")
    elif isinstance(token, str) and token.strip().startswith("{"):
        try:
            parsed = json.loads(token)
        except ValueError:
            raise ValueError(f"not {TOKEN_FORMS}: {token[:80]!r}") from None
        data = parsed.get("_data") if isinstance(parsed, dict) else None
    else:
        data = token
    if not isinstance(data, str) or not data or not _HEX.match(data):
        raise ValueError(f"not {TOKEN_FORMS}: {str(token)[:80]!r}")
    return data


def token_position(token: Any) -> int:
    data = token_text(token)
    if len(data) == 16:  # the test server: seconds and increment, 8 hex digits each
        return int(data, 16)
    if len(data) >= 18 and data[:2].lower() == "82":  # KeyString: CType timestamp (130), then 8 bytes
        return int(data[2:18], 16)
    raise ValueError(f"not {TOKEN_FORMS}: {data[:80]!r}")


def parse_timestamp(text: str) -> int:
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{text!r} is not {TIMESTAMP_FORMS}")
    seconds = int(parts[0])
    increment = int(parts[1]) if len(parts) == 2 else 0
    if seconds > MAX_INC or increment > MAX_INC:
        raise ValueError(f"{text!r}: seconds and increment are unsigned 32-bit integers ({TIMESTAMP_FORMS})")
    return (seconds << 32) | increment


class MongoSettledRule:
    """Settled at a low watermark: the event's position (changelog ``_cdc_position``) is at or below it."""

    @property
    def window_fields(self) -> list[Any]:
        from pyspark.sql import types as T

        return [T.StructField("_w_low", T.LongType())]

    def window_values(self, low_watermark: str) -> tuple[object, ...]:
        return (int(low_watermark),)

    def since(self, low_watermarks: Sequence[str]) -> Any:
        from pyspark.sql import functions as F

        return F.col("_cdc_position") > min(int(text) for text in low_watermarks)

    def since_window(self) -> Any:
        from pyspark.sql import functions as F

        return F.col("_cdc_position") > F.col("_w_low")

    def unsettled(self) -> Any:
        from pyspark.sql import functions as F

        return F.col("_cdc_position") > F.col("_w_low")
