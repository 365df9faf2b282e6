"""What "settled at the low watermark" means, asked of the source (DESIGN.md: reconciliation).

Contract: reconciliation (``cdc_assets.lake.mirror.reconcile``) is written once; a source kind supplies only a
``SettledRule``, Spark conditions over its changelog's rows (the changelog columns of every kind, plus the source's
own, e.g. PostgreSQL's ``_cdc_xid``):
- ``window_fields`` / ``window_values(low_watermark)``: the columns (names starting with ``_w_``) that one window's
  low watermark (the source's text of it, ``ChunkWindow.low_watermark``) becomes in a frame of windows;
- ``since(low_watermarks)``: the changelog rows that any of these low watermarks may not have settled, without
  window columns (it narrows the changelog read before the join with the windows; a superset is fine);
- ``since_window()``: over a changelog row joined with one window's columns, the rows from the window's low
  watermark on (a superset of the unsettled ones: every change that may have replaced a row the read saw);
- ``unsettled()``: over the same join, the rows of transactions not settled at the window's low watermark: their
  keys are dropped from the window's staged rows.
Soundness needs: a row ``unsettled()`` is also ``since_window()`` and ``since(...)``; a transaction settled at the
low watermark is visible to every read that started after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pyspark.sql import Column
from pyspark.sql import types as T


class SettledRule(Protocol):
    @property
    def window_fields(self) -> Sequence[T.StructField]: ...

    def window_values(self, low_watermark: str) -> tuple[object, ...]: ...

    def since(self, low_watermarks: Sequence[str]) -> Column: ...

    def since_window(self) -> Column: ...

    def unsettled(self) -> Column: ...
