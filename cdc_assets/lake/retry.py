"""Retry of Delta commits that lost an optimistic-concurrency race.

Contract: ``commit_with_retry(action, what)`` runs ``action`` and returns its result; when it fails because another
writer committed first (Delta's concurrent-modification errors, including two writers creating one table), it runs
``action`` again after a short randomized pause, up to ``attempts`` times. Any other error is raised unchanged. The
action must be idempotent or re-read its inputs: a failed Delta commit made nothing visible.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

CONFLICT_MARKERS = (
    "ConcurrentAppendException",
    "ConcurrentDeleteReadException",
    "ConcurrentDeleteDeleteException",
    "ConcurrentWriteException",
    "ConcurrentTransactionException",
    "MetadataChangedException",
    "ProtocolChangedException",
    "DELTA_CONCURRENT",
    "DELTA_METADATA_CHANGED",
    "DELTA_PROTOCOL_CHANGED",
    "already exists",
    "FileAlreadyExistsException",
)


def is_commit_conflict(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}"
    return any(marker in text for marker in CONFLICT_MARKERS)


def commit_with_retry(action: Callable[[], T], what: str, attempts: int = 8) -> T:
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except Exception as error:
            if attempt == attempts or not is_commit_conflict(error):
                raise
            pause = min(5.0, 0.2 * 2**attempt) * (0.5 + random.random())
            log.info("%s: concurrent Delta commit (%s); retrying in %.1f s", what, type(error).__name__, pause)
            time.sleep(pause)
    raise AssertionError("unreachable")
