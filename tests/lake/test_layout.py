"""The lake layout's upkeep markers (no Spark needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cdc_assets.lake.layout import Resnapshot, SourceLake


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


def test_resnapshot_markers_keep_the_newest_position_and_clear_only_their_own(tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "docs")
    assert lake.resnapshot_markers() == {}
    lake.mark_resnapshot("shop.orders", 100, "history lost")
    lake.mark_resnapshot('odd."name"', 100, "history lost")
    lake.mark_resnapshot("shop.orders", 90, "an older loss")  # a marker never moves back
    assert lake.resnapshot_markers() == {
        "shop.orders": Resnapshot(100, "history lost"),
        'odd."name"': Resnapshot(100, "history lost"),
    }
    lake.mark_resnapshot("shop.orders", 200, "lost again")
    lake.clear_resnapshot("shop.orders", 100)  # done with the old one: the newer one stays
    assert lake.resnapshot_markers()["shop.orders"] == Resnapshot(200, "lost again")
    lake.clear_resnapshot("shop.orders", 200)
    assert set(lake.resnapshot_markers()) == {'odd."name"'}


def test_a_lake_found_by_its_control_folder_reads_the_same_files(tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "docs")
    lake.record_acknowledged(42)
    assert SourceLake.of_control(lake.control).acknowledged() == 42
    assert SourceLake.of_control(tmp_path / "elsewhere").acknowledged() is None
