"""The lake layout's control files: upkeep markers, resnapshot markers, the source's last listing (no Spark needed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cdc_assets.lake.layout import ListedSkippedTable, Resnapshot, SourceLake, SourceListing


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


def test_a_listing_is_written_only_when_it_changed_and_read_back_equal(tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "src")
    assert lake.read_listing() is None
    skipped = ListedSkippedTable("public.no key", "it has no primary key", "add one", "public.no key: it has ...")
    listing = SourceListing('{"include": ["public.*"]}', ("public.a", 'odd.T\u00e4ble "x"'), (skipped,))
    assert lake.store_listing(listing)
    assert lake.read_listing() == listing
    written = lake.listing_path.mtime()
    assert not lake.store_listing(listing)  # unchanged: not written again
    assert lake.listing_path.mtime() == written
    changed = SourceListing(listing.selection, ("public.a",))
    assert lake.store_listing(changed)
    assert lake.read_listing() == changed


def test_a_file_that_is_not_a_listing_is_refused_naming_it_and_replaced_by_the_next_store(tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "src")
    lake.listing_path.write_text('{"tables": []}')
    with pytest.raises(ValueError, match=r"listed\.json is not a table listing"):
        lake.read_listing()
    lake.listing_path.write_text("{not json")
    with pytest.raises(ValueError):
        lake.read_listing()
    listing = SourceListing("s", ("public.a",))
    assert lake.store_listing(listing)
    assert lake.read_listing() == listing
