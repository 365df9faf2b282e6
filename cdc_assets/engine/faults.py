"""Named fault-injection points, for crash tests and the torture harness.

Contract: ``fault_point(name)`` does nothing unless the environment variable ``CDC_FAULTS`` lists ``name``
(comma-separated). When it does, the process is killed with ``SIGKILL`` at that point: no cleanup, no ``finally``,
exactly like a lost machine. ``CDC_FAULT_PROBABILITY`` (default 1) makes a listed point fire only with that
probability, drawn from ``random.Random(CDC_FAULT_SEED)``. Production never sets these variables.

Points: ``snapshot.before_window_record`` (rows staged, window not recorded), ``snapshot.before_waiting_markers``
(window recorded, its chunks not marked waiting for the stream), ``stream.after_changelog`` (changelogs
appended, mirrors not merged), ``stream.after_merge`` (a table's mirror merged, its fill window of unknown values
not opened, later tables not merged), ``stream.between_mirror_merges`` (a table's MERGE of the keys its mirror
holds committed, the insert of the keys it lacks not: ``cdc_assets.lake.mirror.merge_net_changes``),
``stream.between_append_and_merge`` (a table's append of keys above every key its mirror's files may hold
committed, the MERGE of the batch's other keys not: ``cdc_assets.lake.mirror.apply_changes``),
``stream.after_lake_commit`` (lake written, offset not recorded),
``stream.after_offset_record`` (offset recorded, slot not advanced), ``stream.after_adopted_files`` (a
reconciliation placed staged chunk files in a mirror's folder, its commit adding them not written:
``cdc_assets.lake.adopt``), ``stream.during_maintenance`` (lake upkeep between batches: a table's finished staged
attempts dropped, its tables not yet compacted or vacuumed).

Driver faults kill the Spark driver's JVM instead of this process, as the kernel's OOM killer does when the JVM is the
largest process: ``driver_fault_point(name, driver)`` sends it (``driver()``: its process) ``SIGKILL`` when
``CDC_FAULTS`` lists ``name``, once per process (a retried step in the same process then goes on). Points:
``stream.driver_killed_after_changelog`` (changelogs appended, mirrors not merged),
``snapshot.driver_killed_before_read`` (a snapshot's low watermark taken, its chunks not read).

Size faults raise instead of killing: ``size_fault(name, size)`` raises ``InjectedFault`` when ``CDC_FAULTS`` lists
``name=N`` and ``size`` exceeds ``N`` (always, no probability). Point: ``stream.batch_over`` (a stream batch holding
more than N changes fails before it writes the lake; the retried batch is smaller, ``cdc_assets.engine.batch_bounds``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
from collections.abc import Callable

POINTS = (
    "snapshot.before_window_record",
    "snapshot.before_waiting_markers",
    "stream.after_changelog",
    "stream.after_merge",
    "stream.between_mirror_merges",
    "stream.between_append_and_merge",
    "stream.after_lake_commit",
    "stream.after_offset_record",
    "stream.during_maintenance",
    "stream.after_adopted_files",
)
SIZE_POINTS = ("stream.batch_over",)
DRIVER_POINTS = ("stream.driver_killed_after_changelog", "snapshot.driver_killed_before_read")
_driver_faults_fired: set[str] = set()
_draw = random.Random(os.environ.get("CDC_FAULT_SEED", "0"))


def fault_point(name: str) -> None:
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(POINTS)}")
    listed = os.environ.get("CDC_FAULTS", "")
    if not listed or name not in listed.split(","):
        return
    if _draw.random() < float(os.environ.get("CDC_FAULT_PROBABILITY", "1")):
        os.kill(os.getpid(), signal.SIGKILL)


def driver_fault_point(name: str, driver: Callable[[], subprocess.Popen | None]) -> None:
    if name not in DRIVER_POINTS:
        raise ValueError(f"unknown driver fault point {name!r}; known: {', '.join(DRIVER_POINTS)}")
    if name in _driver_faults_fired or name not in os.environ.get("CDC_FAULTS", "").split(","):
        return
    process = driver()  # a local driver's JVM (cdc_assets.lake.spark.driver_process)
    if process is None:
        return
    _driver_faults_fired.add(name)
    process.kill()
    process.wait()


class InjectedFault(RuntimeError):
    """A failure raised by a size fault point."""


def size_fault(name: str, size: int) -> None:
    if name not in SIZE_POINTS:
        raise ValueError(f"unknown size fault point {name!r}; known: {', '.join(SIZE_POINTS)}")
    for item in os.environ.get("CDC_FAULTS", "").split(","):
        point, _, limit = item.partition("=")
        if point == name and limit.isdigit() and size > int(limit):
            raise InjectedFault(f"fault point {name}: the batch holds {size} changes, more than {limit} (CDC_FAULTS)")
