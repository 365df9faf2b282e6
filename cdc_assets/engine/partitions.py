"""Partitioned tables: when a root's set of partitions changes, rows appear in it or vanish from it without changes.

Contract (pure): ``repartition_reason(before, now)`` says why every chunk of a partitioned table must be read
again, or None. ``ATTACH PARTITION`` brings the attached table's rows into the root and ``DETACH PARTITION`` (or
``DROP`` of a partition) takes them out, and logical decoding emits no change for either; a re-snapshot of every
chunk reconciles the mirror with the root as it is (rows read are upserted, rows the source no longer has deleted).
``before`` None (the table not seen yet) needs nothing: the initial snapshot reads every partition.
"""

from __future__ import annotations

from collections.abc import Sequence


def repartition_reason(before: Sequence[str] | None, now: Sequence[str]) -> str | None:
    if before is None:
        return None
    attached = sorted(set(now) - set(before))
    detached = sorted(set(before) - set(now))
    if not attached and not detached:
        return None
    parts = []
    if attached:
        parts.append(f"partition(s) {', '.join(attached)} attached")
    if detached:
        parts.append(f"partition(s) {', '.join(detached)} detached or dropped")
    return "; ".join(parts) + " (no change in the WAL carries their rows): every chunk is read again"
