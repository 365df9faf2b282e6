"""The PostgreSQL low-watermark rule of DESIGN.md ("Watermark window: PostgreSQL").

Contract:
- ``LowWatermark`` is ``pg_current_snapshot()`` taken before a chunk read: ``xmin``, ``xmax`` and the in-progress
  list ``xip``, all 64-bit (``xid8``).
- ``settled_at_low_watermark(xid, lw)`` is true when the transaction had finished (committed or aborted) when the
  low watermark was taken: ``xid < xmin``, or ``xid < xmax`` and ``xid`` not in ``xip``. Every committed settled
  transaction is visible to every chunk read that started after the low watermark.
- ``widen_xid(xid32, reference_xid8)`` turns the 32-bit xid that logical decoding reports into the 64-bit xid of
  the same server, by signed modular difference against a recent ``xid8`` of that server. Only widened xids are
  stored and compared.
- ``PostgresSettledRule`` is the same rule as Spark conditions over the changelog's ``_cdc_xid`` (the
  ``cdc_assets.lake.settled.SettledRule`` reconciliation asks for); ``unsettled_condition`` is its core. The
  changelog is narrowed by transaction id, never by WAL position: a transaction can be in ``xip`` while its commit
  record already precedes the low watermark (its commit waits for a WAL flush or a synchronous standby; the stream
  may even have applied it), and the read does not see it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import Column
    from pyspark.sql import types as T

_XID_MODULUS = 1 << 32
_HALF = 1 << 31


@dataclass(frozen=True)
class LowWatermark:
    """A ``pg_current_snapshot()`` taken before a chunk read (64-bit xids)."""

    xmin: int
    xmax: int
    xip: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, snapshot_text: str) -> LowWatermark:
        """Parse PostgreSQL's ``pg_snapshot`` text form ``'xmin:xmax:xip1,xip2'``."""
        try:
            xmin_text, xmax_text, xip_text = snapshot_text.split(":")
            xip = frozenset(int(x) for x in xip_text.split(",") if x)
            watermark = cls(int(xmin_text), int(xmax_text), xip)
        except ValueError as error:
            raise ValueError(f"not a pg_snapshot: {snapshot_text!r} (expected 'xmin:xmax:xip,...')") from error
        if not watermark.xmin <= watermark.xmax or any(not watermark.xmin <= x < watermark.xmax for x in xip):
            raise ValueError(f"inconsistent pg_snapshot: {snapshot_text!r}")
        return watermark

    def text(self) -> str:
        return f"{self.xmin}:{self.xmax}:{','.join(str(x) for x in sorted(self.xip))}"


def settled_at_low_watermark(xid: int, low_watermark: LowWatermark) -> bool:
    """True when transaction ``xid`` (widened) had finished when ``low_watermark`` was taken."""
    if xid < low_watermark.xmin:
        return True
    return xid < low_watermark.xmax and xid not in low_watermark.xip


def widen_xid(xid32: int, reference_xid8: int) -> int:
    """The 64-bit xid whose low 32 bits are ``xid32`` and that lies within 2^31 of ``reference_xid8``."""
    if not 0 <= xid32 < _XID_MODULUS:
        raise ValueError(f"not a 32-bit xid: {xid32}")
    difference = (xid32 - reference_xid8) % _XID_MODULUS
    if difference >= _HALF:
        difference -= _XID_MODULUS
    widened = reference_xid8 + difference
    if widened < 0:
        raise ValueError(f"xid {xid32} cannot be widened against {reference_xid8}")
    return widened


def unsettled_condition(lw_xmin: Column, lw_xmax: Column, lw_xip: Column) -> Column:
    """Over a changelog row: its transaction (``_cdc_xid``) had not finished when the low watermark was taken."""
    from pyspark.sql import functions as F

    xid = F.col("_cdc_xid")
    settled = (xid < lw_xmin) | ((xid < lw_xmax) & ~F.array_contains(lw_xip, xid))
    return ~settled


class PostgresSettledRule:
    """``SettledRule`` of PostgreSQL: a window's low watermark is its ``pg_current_snapshot()`` text."""

    @property
    def window_fields(self) -> list[T.StructField]:
        from pyspark.sql import types as T

        return [
            T.StructField("_w_xmin", T.LongType()),
            T.StructField("_w_xmax", T.LongType()),
            T.StructField("_w_xip", T.ArrayType(T.LongType())),
        ]

    def window_values(self, low_watermark: str) -> tuple[object, ...]:
        lw = LowWatermark.parse(low_watermark)
        return lw.xmin, lw.xmax, sorted(lw.xip)

    def since(self, low_watermarks: Sequence[str]) -> Column:
        from pyspark.sql import functions as F

        return F.col("_cdc_xid") >= min(LowWatermark.parse(text).xmin for text in low_watermarks)

    def since_window(self) -> Column:
        from pyspark.sql import functions as F

        return F.col("_cdc_xid") >= F.col("_w_xmin")

    def unsettled(self) -> Column:
        from pyspark.sql import functions as F

        return unsettled_condition(F.col("_w_xmin"), F.col("_w_xmax"), F.col("_w_xip"))
