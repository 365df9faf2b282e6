"""What the generic pipeline's tests share, whatever the source kind (``tests/test_pipeline.py`` with the in-memory
reference dialect, ``tests/integration/test_mongodb_pipeline.py`` with MongoDB):

- ``faults`` (the fixture in ``tests/conftest.py``, made by ``arm_faults``): the pipeline's fault points made to
  "kill" the run in the test's own process: an armed point raises ``Killed`` (a ``BaseException``, so no ``except
  Exception`` of the pipeline catches it and nothing after the point runs) the next time it is reached. The clean-up
  a real SIGKILL would skip (``finally`` blocks) does run here; the PostgreSQL suite kills real processes
  (``tests/integration/test_pipeline_guarantees.py``).
- ``Stream``: the stream asset's loop (batch, record the offset, acknowledge), a killed batch leaving the recorded
  offset where it was.
"""

from __future__ import annotations

import pytest

import cdc_assets.lake.adopt as adopt_module
import cdc_assets.lake.mirror as mirror_module
import cdc_assets.lake.watermark_window as watermark_window_module
import cdc_assets.pipeline as pipeline_module
from cdc_assets.dialect import Offset
from cdc_assets.pipeline import CdcPipeline
from cdc_assets.source import StreamReport

KILLS = ("snapshot.before_window_record", "stream.after_changelog", "stream.after_merge", "stream.after_lake_commit")


class Killed(BaseException):
    """The process died at a fault point."""


class FaultPoints:
    """Fault points that "kill" (raise ``Killed``) the next time each armed one is reached."""

    def __init__(self) -> None:
        self.armed: set[str] = set()
        self.fired: list[str] = []

    def __call__(self, name: str) -> None:
        if name in self.armed:
            self.armed.discard(name)
            self.fired.append(name)
            raise Killed(name)


def arm_faults(monkeypatch: pytest.MonkeyPatch) -> FaultPoints:
    """The pipeline's fault points replaced by a ``FaultPoints`` for this test (the ``faults`` fixture)."""
    points = FaultPoints()
    monkeypatch.setattr(pipeline_module, "fault_point", points)
    monkeypatch.setattr(watermark_window_module, "fault_point", points)
    monkeypatch.setattr(adopt_module, "fault_point", points)
    monkeypatch.setattr(mirror_module, "fault_point", points)
    return points


class Stream:
    """The stream asset's loop: batch, record the offset, acknowledge."""

    def __init__(self, pipeline: CdcPipeline, spark) -> None:
        self.pipeline, self.spark = pipeline, spark
        self.recorded: Offset | None = None
        self.batches = 0

    def batch(self, acknowledge: bool = True) -> StreamReport | None:
        self.batches += 1
        try:
            report = self.pipeline.stream_batch(self.spark, self.recorded, f"b{self.batches}")
        except Killed:
            return None  # the offset was not recorded: the next batch starts from the same one
        self.recorded = report.offset
        if acknowledge:
            self.pipeline.acknowledge(report.offset)
        return report

    def catch_up(self, rounds: int = 40) -> None:
        for _ in range(rounds):
            report = self.batch()
            if report is not None and report.changes == 0 and report.waiting_windows == 0 and report.lag_bytes == 0:
                return
        raise AssertionError(f"no catch-up in {rounds} batches")
