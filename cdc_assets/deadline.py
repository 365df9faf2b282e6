"""Asking a source something with a deadline: a hung or saturated server must not hold the caller past its own limit
(the ``offsets`` command's ``--timeout``; a sensor tick, which Dagster stops after 60 s).

Contract:
- ``Asked(what, action)`` starts ``action()`` at once in a daemon thread; ``answer(deadline)`` (a ``time.monotonic``
  instant) returns its value or re-raises its exception, and raises ``NoAnswer`` naming ``what`` and the seconds
  waited when it has not ended by then. Several ``Asked`` started together share one deadline.
- An action that has not answered goes on in its thread and its answer is dropped; being a daemon, it never holds
  the process at exit. Nothing is cancelled: an action must leave nothing half done when it is abandoned (the
  readers given here only read).
- ``within(seconds, what, action)``: one ``Asked`` answered by ``seconds`` from now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class NoAnswer(TimeoutError):
    """``what`` did not answer within ``seconds``."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(f"{what} did not answer within {seconds:g} s")
        self.what, self.seconds = what, seconds


class Asked(Generic[T]):
    def __init__(self, what: str, action: Callable[[], T]) -> None:
        self.what = what
        self.started = time.monotonic()
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(action,), name=f"asking {what}", daemon=True)
        self._thread.start()

    def _run(self, action: Callable[[], T]) -> None:
        try:
            self._value = action()
        except BaseException as error:  # handed to the caller of ``answer``
            self._error = error

    def answer(self, deadline: float) -> T:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            raise NoAnswer(self.what, round(deadline - self.started, 1))
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def within(seconds: float, what: str, action: Callable[[], T]) -> T:
    return Asked(what, action).answer(time.monotonic() + seconds)
