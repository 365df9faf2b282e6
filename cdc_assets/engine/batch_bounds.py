"""The bounds of the next stream batch: the configured ones, shrunk after a failed batch, grown back after successes.

Contract (pure: no Spark, no database; ``cdc_assets.pipeline`` stores the state as JSON in the lake):
- ``BatchBounds`` holds the bounds the next batch reads with (``max_changes``: rows of the slot, ``max_bytes``:
  bytes of change messages; both stop only at a transaction boundary, so a bound of 1 reads one transaction),
  the number of failed batches since the last success (``failures``) and why the last one failed (``reason``).
- ``after_failure(bounds, changes, bytes_, reason)``: a batch that held ``changes`` changes and ``bytes_`` bytes
  (None: not known, e.g. the process died before it said) failed: the next batch reads at most half of what the
  failed one held and at most half of its bounds, never less than 1 (one transaction). So repeated failures of
  one oversized batch end, after at most log2(bound) attempts, at one transaction per batch: the stream never
  stops on a batch that a smaller one would have carried. A batch that held no change keeps its bounds (its failure
  came from elsewhere, e.g. a window's reconciliation: halving to one change would only slow the stream down).
- ``after_success(bounds, configured, cut)``: a batch succeeded. When a bound cut it (``cut``: more was waiting),
  the bounds double, up to the configured ones (``failures`` back to 0): growing back by doubling, not at once, so
  a backlog that fails at the configured size does not fail every other batch. When no bound cut it (it read all
  there was), the configured bounds apply again at once.
- ``in_flight`` records a batch being written (what it held) so that a process killed during it (no ``except``
  runs: SIGKILL, the kernel's OOM killer) is known to the next batch (``recover_in_flight``). A death says nothing
  of its cause (an operator's kill, a lost node, a deploy), so each bound gets one death free: the first death at a
  bound is retried at the same bound (``retried`` set), a second death at it halves, as an exception does, and the
  halved bound again gets its free death. So the kernel's OOM killer costs twice the attempts of a heap error
  (2 * log2(bound) at most), and kills at random moments do not shrink a healthy stream: halving on each of them took
  a torture run's byte bound from 256 MB to 3.5 KB; halving on each death after the first of a streak left another
  at 18 changes per batch after five deaths in a row (its batches passed about ten fault points each, so a third of
  them died), which then took ten successful batches to grow back by doubling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class BatchBounds:
    max_changes: int
    max_bytes: int
    failures: int = 0
    reason: str | None = None
    in_flight: dict[str, int] | None = None  # {"changes": n, "bytes": n} of a batch being written
    retried: bool = False  # a batch at these bounds died already and was retried at them

    def shrunk(self, configured: BatchBounds) -> bool:
        return self.max_changes < configured.max_changes or self.max_bytes < configured.max_bytes

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object], configured: BatchBounds) -> BatchBounds:
        """The stored bounds, never above the configured ones (a lowered configuration applies at once); a stored
        value that is not a positive integer is taken from ``configured``."""

        def bound(name: str, limit: int) -> int:
            value = data.get(name)
            return min(value, limit) if isinstance(value, int) and value >= 1 else limit

        in_flight = data.get("in_flight")
        retried = data.get("retried")
        failures = data.get("failures")
        reason = data.get("reason")
        return cls(
            max_changes=bound("max_changes", configured.max_changes),
            max_bytes=bound("max_bytes", configured.max_bytes),
            failures=failures if isinstance(failures, int) and failures >= 0 else 0,
            reason=reason if isinstance(reason, str) else None,
            in_flight=in_flight if isinstance(in_flight, dict) else None,
            retried=retried is True,
        )


def after_failure(bounds: BatchBounds, changes: int | None, bytes_: int | None, reason: str) -> BatchBounds:
    if changes == 0:  # it held no change (it failed reconciling or reading): a smaller batch would change nothing
        return BatchBounds(bounds.max_changes, bounds.max_bytes, bounds.failures + 1, reason)
    held_changes = bounds.max_changes if changes is None else min(bounds.max_changes, max(changes, 1))
    held_bytes = bounds.max_bytes if bytes_ is None else min(bounds.max_bytes, max(bytes_, 1))
    return BatchBounds(
        max_changes=max(1, held_changes // 2),
        max_bytes=max(1, held_bytes // 2),
        failures=bounds.failures + 1,
        reason=reason,
    )


def after_success(bounds: BatchBounds, configured: BatchBounds, cut: bool) -> BatchBounds:
    if not cut or not bounds.shrunk(configured):
        return configured
    return BatchBounds(
        max_changes=min(configured.max_changes, bounds.max_changes * 2),
        max_bytes=min(configured.max_bytes, bounds.max_bytes * 2),
        reason=bounds.reason,
    )


def recover_in_flight(bounds: BatchBounds) -> BatchBounds:
    """A batch recorded as in flight never finished (its process died): retried at the same bounds the first time
    a batch at them died, counted as failed (halved) the second time."""
    if bounds.in_flight is None:
        return bounds
    reason = "the previous batch's process died while it wrote the lake (killed, or out of memory)"
    if not bounds.retried:
        return BatchBounds(bounds.max_changes, bounds.max_bytes, bounds.failures + 1,
                           f"{reason}; retried at the same bounds once", retried=True)  # fmt: skip
    held = bounds.in_flight
    changes, bytes_ = held.get("changes"), held.get("bytes")
    return after_failure(
        bounds,
        changes if isinstance(changes, int) else None,
        bytes_ if isinstance(bytes_, int) else None,
        reason,
    )


def with_in_flight(bounds: BatchBounds, changes: int, bytes_: int) -> BatchBounds:
    return BatchBounds(bounds.max_changes, bounds.max_bytes, bounds.failures, bounds.reason,
                       {"changes": changes, "bytes": bytes_}, bounds.retried)  # fmt: skip
