"""``run_window`` (``cdc_assets.lake.watermark_window``), the window sequence written once, driven by a source that
is a list in memory: low watermark, then the read, then the high watermark, then the record in the window log and
the waiting markers. No database: the sequence is the engine's, the watermarks the source's."""

from __future__ import annotations

from pathlib import Path

from cdc_assets.engine.windows import WindowStart, open_windows
from cdc_assets.lake import windows as window_log
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.watermark_window import run_window


class ListSource:
    """A change log as a list: a position is its length; the low watermark's text names the position."""

    def __init__(self) -> None:
        self.log: list[str] = ["insert 1", "insert 2"]
        self.steps: list[str] = []

    def low_watermark(self) -> tuple[int, str]:
        self.steps.append("low")
        return len(self.log), f"settled-through:{len(self.log)}"

    def high_watermark(self) -> int:
        self.steps.append("high")
        return len(self.log)


def test_the_read_runs_between_the_watermarks_and_the_windows_are_recorded_after(spark, tmp_path: Path) -> None:
    lake = SourceLake(tmp_path, "fake")
    source = ListSource()

    def read(start: WindowStart) -> dict[int, int]:
        source.steps.append("read")
        assert start.position == 2  # the position taken with the low watermark
        assert window_log.read_events(spark, lake.windows) == []  # nothing recorded before the high watermark
        source.log += ["update 1", "insert 3"]  # concurrent changes during the read
        return {4: 120, 5: 0}

    windows = run_window(spark, lake, "app.items", [4, 5], "attempt-1", source, read)
    assert source.steps == ["low", "read", "high"]
    assert [(w.chunk, w.rows, w.lw_lsn, w.low_watermark, w.hw) for w in windows] == [
        (4, 120, 2, "settled-through:2", 4),
        (5, 0, 2, "settled-through:2", 4),
    ]
    recorded = open_windows(window_log.read_events(spark, lake.windows))
    assert [(w.table, w.chunk, w.attempt, w.low_watermark, w.hw) for w in recorded] == [
        ("app.items", 4, "attempt-1", "settled-through:2", 4),
        ("app.items", 5, "attempt-1", "settled-through:2", 4),
    ]
    assert lake.waiting_markers() == {("app.items", 4): 4, ("app.items", 5): 4}
