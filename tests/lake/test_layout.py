"""The lake layout's upkeep markers (no Spark needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cdc_assets.lake.layout import SourceLake


def age(marker: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(marker, (then, then))


def test_upkeep_clock_starts_on_first_sight_then_the_step_is_due_after_its_interval(tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "src")
    assert not lake.upkeep_due("compact", 0)  # 0 turns it off, and starts no clock
    assert not (tmp_path / "src" / "_cdc" / "upkeep" / "compact").exists()
    assert not lake.upkeep_due("compact", 3600)  # first sight: the clock starts now
    marker = tmp_path / "src" / "_cdc" / "upkeep" / "compact"
    assert marker.exists()
    age(marker, 3601)
    assert lake.upkeep_due("compact", 3600)
    assert not lake.upkeep_due("compact", 7200)
    assert not lake.upkeep_due("vacuum", 3600)  # each step has its own clock
    lake.mark_upkeep_done("compact")
    assert not lake.upkeep_due("compact", 3600)
    age(tmp_path / "src" / "_cdc" / "upkeep" / "vacuum", 86401)
    assert lake.upkeep_due("vacuum", 86400)
    assert not lake.upkeep_due("compact", 3600)
