"""Where a source's tables and control data live in the lake.

Contract (``<lake_root>/<source>/``):
- Names: ``<schema>.<table>`` below is ``cdc_assets.engine.names.lake_folder`` (the real names when they are valid
  Dagster name parts, else a stable hashed form: one path segment of ``[A-Za-z0-9_]`` whatever the table is
  called), and ``<qualified>`` in file names is ``file_token`` of the qualified name (percent-encoded, reversible;
  ordinary names unchanged).
- ``<schema>.<table>/mirror``, ``/changelog``: the Delta tables of one captured table; ``/staged``: its staged
  chunk rows, plain Parquet files per attempt (``cdc_assets.lake.staging``). A ``/staging`` folder next to them
  is a Delta staging table of an earlier version: nothing reads it, and it can be removed.
- ``_cdc/plans/<qualified>.json``: the table's chunk plan, written once (first writer wins) and never changed.
- ``_cdc/windows``: the Delta log of chunk window events, written by the source's lake-write pool only;
  ``_cdc/windows-staged/<attempt>.<random>.json``: a snapshot run's staged windows, one file per run, folded into the
  log by the stream (see ``cdc_assets.lake.windows``).
- ``_cdc/waiting/<qualified>@<chunk>.hw``: one small file per staged, not yet reconciled chunk holding its
  high watermark, so the streaming sensor can see that a window may close without starting Spark. Markers are
  hints: the window log is the truth, and the stream batch rewrites the markers from it. A batch removes only the
  markers written before it read the log, of chunks with no window left open: a marker written since may be another
  window of the same chunk, staged after that read (two runs of one chunk), which the next batch reconciles.
- ``_cdc/waiting-checks/<token>.hw``: the high watermark of a consistency check waiting for the stream (written
  and removed by the check; one older than ``CHECK_MARKER_SECONDS``, left by a killed check, is ignored and
  removed), so that a source nobody writes to still gets the batch that passes it.
- ``_cdc/acknowledged``: the position of the last offset the source was told it may forget (written by
  ``CdcPipeline.acknowledge`` after the offset was recorded): every change at or below it is in the lake. A
  consistency check waits for it to pass its high watermark.
- ``_cdc/resnapshot/<qualified>.json``: the table must be read again, every chunk, in windows whose reads start at or
  after ``position`` (the source lost changes the stream needed: MongoDB's history lost with ``on_history_lost:
  resnapshot``; the stream restarted at ``position``), with the ``reason``. Written by the stream batch before its
  offset is recorded, read by the planner sensor (which requests the snapshots) and by the stream (which applies no
  window of the table read before ``position`` and removes the file once every chunk has a reconciled window read
  after it). A newer loss only raises the position.
- ``_cdc/upkeep/<step>``: empty files whose modification times are the ends of the last lake upkeep steps
  (``cdc_assets.lake.maintenance``): ``compact`` (staged attempts dropped, tables compacted) and ``vacuum``. The clock
  of a step starts when it is first asked whether the step is due: a new source's first batches pay for no upkeep.
- ``_cdc/listed.json``: the tables the source listed the last time the definitions were built while it answered
  (captured and skipped, with the reasons), with the table selection they were listed under (``SourceListing``).
  A process that builds the definitions while the source does not answer builds these tables' assets, so a run of one
  of them starts and its step fails with the source's own error (``cdc_assets.build``). Rewritten only when it changed.
- ``_cdc/spill/<batch>/``: a stream batch's decoded changes (Parquet), removed after the batch; the folders a killed
  batch left are removed when the next batch starts (``drop_spills``: the source's pool runs one batch at a time).
Every file here goes through ``cdc_assets.lake.files.LakePath``: the lake root is a local path or an ``s3a://`` URI.
On an object store, ``store_plan``'s "first writer wins" is a check, then a write: the planner sensor stores a table's
plan before it asks for the table's snapshot runs, so a snapshot run finds it stored and never races the sensor.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Literal

from cdc_assets.engine.chunks import ChunkPlan
from cdc_assets.engine.names import file_token, from_file_token, lake_folder, split_qualified
from cdc_assets.lake.files import LakePath

UpkeepStep = Literal["compact", "vacuum"]
CHECK_MARKER_SECONDS = 600  # longer than any check waits for the stream


@dataclass(frozen=True)
class TablePaths:
    mirror: str
    changelog: str
    staging: str


@dataclass(frozen=True)
class Resnapshot:
    """Every chunk of a table must be read again in windows whose reads start at or after ``position``."""

    position: int
    reason: str


@dataclass(frozen=True)
class ListedSkippedTable:
    """A selected table the source did not capture when it was last listed, and why (``SkippedTableLike``)."""

    qualified_name: str
    reason: str
    fix: str
    message: str


@dataclass(frozen=True)
class SourceListing:
    """The tables a source listed (captured, and selected but skipped) under a table selection (``selection``: the
    configuration that chose them, as ``cdc_assets.build.table_selection`` writes it)."""

    selection: str
    tables: tuple[str, ...]
    skipped: tuple[ListedSkippedTable, ...] = ()

    def to_json(self) -> str:
        return json.dumps(
            {
                "selection": self.selection,
                "tables": list(self.tables),
                "skipped": [
                    {"table": t.qualified_name, "reason": t.reason, "fix": t.fix, "message": t.message}
                    for t in self.skipped
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> SourceListing:
        data = json.loads(text)
        return cls(
            selection=str(data["selection"]),
            tables=tuple(str(name) for name in data["tables"]),
            skipped=tuple(
                ListedSkippedTable(str(t["table"]), str(t["reason"]), str(t["fix"]), str(t["message"]))
                for t in data["skipped"]
            ),
        )


class SourceLake:
    def __init__(self, lake_root: str | os.PathLike[str] | LakePath, source_name: str) -> None:
        self.root = LakePath(lake_root) / source_name
        self.control = self.root / "_cdc"

    @classmethod
    def of_control(cls, control: str | os.PathLike[str] | LakePath) -> SourceLake:
        """The lake whose control folder is ``control`` (for a source dialect handed only that folder)."""
        lake = cls.__new__(cls)
        lake.control = LakePath(control)
        lake.root = lake.control.parent
        return lake

    def table(self, qualified_name: str) -> TablePaths:
        base = self.root / lake_folder(*split_qualified(qualified_name))
        return TablePaths(str(base / "mirror"), str(base / "changelog"), str(base / "staged"))

    @property
    def windows(self) -> str:
        return str(self.control / "windows")

    def spill_dir(self, batch_id: str) -> LakePath:
        return self.control / "spill" / batch_id

    def drop_spills(self) -> None:
        """Remove every batch's spill folder: called when a batch starts, so that any there is a dead batch's."""
        (self.control / "spill").rmtree()

    # -- upkeep --------------------------------------------------------------------------------------------
    def upkeep_due(self, step: UpkeepStep, interval_seconds: int, now: float | None = None) -> bool:
        """Whether ``interval_seconds`` have passed since ``step`` last ran; never when 0. Asked for the first
        time, it starts the step's clock (writes the marker) and answers no."""
        if interval_seconds <= 0:
            return False
        marker = self.control / "upkeep" / step
        try:
            last = marker.mtime()
        except FileNotFoundError:
            self.mark_upkeep_done(step)
            return False
        return (time.time() if now is None else now) - last >= interval_seconds

    def mark_upkeep_done(self, step: UpkeepStep) -> None:
        (self.control / "upkeep" / step).touch()

    # -- chunk plans ---------------------------------------------------------------------------------------
    def plan_path(self, qualified_name: str) -> LakePath:
        return self.control / "plans" / f"{file_token(qualified_name)}.json"

    def read_plan(self, qualified_name: str) -> ChunkPlan | None:
        try:
            return ChunkPlan.from_json(self.plan_path(qualified_name).read_text())
        except FileNotFoundError:
            return None

    def store_plan(self, plan: ChunkPlan) -> ChunkPlan:
        """Store ``plan`` unless one is stored already; returns the stored plan (immutable once written)."""
        self.plan_path(plan.table).write_new(plan.to_json())
        stored = self.read_plan(plan.table)
        assert stored is not None
        return stored

    # -- the tables the source listed last ---------------------------------------------------------------------
    @property
    def listing_path(self) -> LakePath:
        return self.control / "listed.json"

    def read_listing(self) -> SourceListing | None:
        """The listing stored last; None when there is none. Raises ``OSError`` when the lake cannot be read and
        ``ValueError`` when the file is not a listing."""
        try:
            text = self.listing_path.read_text()
        except FileNotFoundError:
            return None
        try:
            return SourceListing.from_json(text)
        except (KeyError, TypeError) as error:
            raise ValueError(f"{self.listing_path} is not a table listing: {error!r}") from error

    def store_listing(self, listing: SourceListing) -> bool:
        """Store ``listing`` unless the stored one equals it (a definitions load usually finds it unchanged);
        returns whether it wrote. Raises ``OSError`` when the lake cannot be written."""
        try:
            if self.read_listing() == listing:
                return False
        except ValueError:
            pass  # replaced below
        self.listing_path.write_text(listing.to_json())
        return True

    # -- waiting markers -----------------------------------------------------------------------------------
    def _marker(self, qualified_name: str, chunk: int) -> LakePath:
        return self.control / "waiting" / f"{file_token(qualified_name)}@{chunk:06d}.hw"

    def mark_waiting(self, qualified_name: str, chunk: int, high_watermark: int) -> None:
        _write_marker(self._marker(qualified_name, chunk), high_watermark)

    def waiting_markers(self) -> dict[tuple[str, int], int]:
        markers: dict[tuple[str, int], int] = {}
        for entry in (self.control / "waiting").glob("*.hw"):
            token, _, chunk = entry.path.stem.rpartition("@")
            try:
                markers[(from_file_token(token), int(chunk))] = int(entry.path.read_text())
            except (ValueError, FileNotFoundError):
                continue
        return markers

    def record_acknowledged(self, position: int) -> None:
        _write_marker(self.control / "acknowledged", position)

    def acknowledged(self) -> int | None:
        try:
            return int((self.control / "acknowledged").read_text())
        except (FileNotFoundError, ValueError):
            return None

    # -- tables to read again ------------------------------------------------------------------------------
    def _resnapshot_path(self, qualified_name: str) -> LakePath:
        return self.control / "resnapshot" / f"{file_token(qualified_name)}.json"

    def mark_resnapshot(self, qualified_name: str, position: int, reason: str) -> None:
        """Record that every chunk of the table must be read again after ``position`` (kept when a marker with a
        higher position is there already)."""
        known = self.resnapshot_markers().get(qualified_name)
        if known is not None and known.position >= position:
            return
        self._resnapshot_path(qualified_name).write_text(json.dumps({"position": position, "reason": reason}))

    def resnapshot_markers(self) -> dict[str, Resnapshot]:
        markers: dict[str, Resnapshot] = {}
        for entry in (self.control / "resnapshot").glob("*.json"):
            try:
                data = json.loads(entry.path.read_text())
                markers[from_file_token(entry.path.stem)] = Resnapshot(
                    int(data["position"]), str(data.get("reason", ""))
                )
            except (ValueError, KeyError, TypeError, FileNotFoundError):
                continue
        return markers

    def clear_resnapshot(self, qualified_name: str, position: int) -> None:
        """Remove the table's marker if it still asks for ``position`` (a newer loss keeps its own)."""
        known = self.resnapshot_markers().get(qualified_name)
        if known is not None and known.position == position:
            self._resnapshot_path(qualified_name).unlink()

    def mark_check_waiting(self, token: str, high_watermark: int) -> None:
        _write_marker(self.control / "waiting-checks" / f"{token}.hw", high_watermark)

    def clear_check_waiting(self, token: str) -> None:
        (self.control / "waiting-checks" / f"{token}.hw").unlink()

    def check_markers(self) -> list[int]:
        """High watermarks of the checks waiting for the stream now (markers older than ``CHECK_MARKER_SECONDS``
        are removed)."""
        marks = []
        for entry in (self.control / "waiting-checks").glob("*.hw"):
            try:
                if time.time() - (entry.mtime or 0.0) > CHECK_MARKER_SECONDS:
                    entry.path.unlink()
                else:
                    marks.append(int(entry.path.read_text()))
            except (ValueError, FileNotFoundError):
                continue
        return marks

    def clear_stale_markers(self, open_chunks: set[tuple[str, int]], older_than: float) -> None:
        """Remove markers of chunks that are not open, written before the window log was read (a marker written
        later may belong to a window staged after the read)."""
        for entry in (self.control / "waiting").glob("*.hw"):
            token, _, chunk = entry.path.stem.rpartition("@")
            try:
                if (from_file_token(token), int(chunk)) not in open_chunks and (entry.mtime or 0.0) < older_than:
                    entry.path.unlink()
            except (ValueError, FileNotFoundError):
                continue


def _write_marker(path: LakePath, high_watermark: int) -> None:
    """Write a marker file atomically (a reader never sees it half written)."""
    path.write_text(str(high_watermark))
