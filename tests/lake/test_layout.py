"""The lake layout's upkeep marker (no Spark needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cdc_assets.lake.layout import SourceLake


def test_upkeep_is_due_first_then_after_the_interval(tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "src")
    assert lake.maintenance_due(3600)  # never maintained
    assert not lake.maintenance_due(0)  # 0 turns it off
    lake.mark_maintained()
    assert not lake.maintenance_due(3600)
    marker = tmp_path / "src" / "_cdc" / "maintained"
    an_hour_ago = time.time() - 3601
    os.utime(marker, (an_hour_ago, an_hour_ago))
    assert lake.maintenance_due(3600)
    assert not lake.maintenance_due(7200)
