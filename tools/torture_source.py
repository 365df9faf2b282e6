"""What a source database brings to the torture harness (``tools/torture.py``), and what the two sides share.

Contract
--------
The runner (``tools/torture.py``: worker processes, fault points, executor losses, re-runs, offset recording,
catch-up, the summary) drives the pipeline only through ``cdc_assets.source.CdcSource``. Everything that touches
the source database itself comes from a ``TortureSource`` of the source's kind (``tools/torture_postgres.py`` for
PostgreSQL; ``tools/torture_mongodb.py`` for MongoDB: its own test server, the workload through pymongo, the changelog
compared with the oplog):

- in the harness process, ``TortureSource`` is the server (``start``, ``stop``, ``running``, and ``restart``: the
  source-restart fault, scheduled only when ``restart_fault`` is not None), and ``create(seed, r, scale, lake,
  chunk_size)`` makes one seed's database and returns its ``SeedSource``: the JSON ``spec`` the workers build the
  pipeline's configuration from, the workload threads, the schema events (changes of a table's shape, or for MongoDB
  bulk commands, at fractions of the workload's duration, in the order ``r`` drew them), the arguments of its
  verification, and ``drop``;
- in a worker process (a Spark driver), the kind's static methods: ``build_config(spec)``, ``offset_position`` (the
  ordered integer that ``CdcSource.acknowledge`` takes, from a stream batch's offset), ``verify(spark, spec, args)``
  (every mirror against its source row by row, the changelog against duplicates and against the source's own log;
  returns ``VerifyResult``), and ``break_settled_rule()`` for ``--broken-reconciliation``.

Shared here: ``Tally`` (changes per table that the workload committed, and those whose commit outcome is unknown),
``WorkloadContext`` (the tally, the stop event, fatal workload errors), ``log`` (the harness log), and
``compare_rows`` (the first differing row of a mirror and its source, with both values).
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from cdc_assets.config import CdcConfig

WORKER_MASTER = "local[2,4]"  # a worker's Spark: 2 cores, a failed task is retried up to 4 times (as on a cluster)


class Tally:
    """Changes per table of committed transactions (acknowledged) and of commits whose outcome is unknown."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.committed: Counter[str] = Counter()
        self.in_doubt: Counter[str] = Counter()
        self.transactions = 0

    def add(self, counts: Counter[str], certain: bool) -> None:
        with self.lock:
            (self.committed if certain else self.in_doubt).update(counts)
            self.transactions += certain


@dataclass
class WorkloadContext:
    tally: Tally
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)

    def fatal(self, message: str) -> None:
        self.errors.append(message)


class VerifyResult(TypedDict):
    failures: list[str]  # the first one fails the seed
    changes: int  # changelog rows checked
    decoded: dict[str, int]  # per table: the changes the source's own log reports (checked against the ``Tally``)
    largest_value: int  # bytes of the largest value the source held at the end (the mirror equals it)


class SeedSource(Protocol):
    """One seed's source database (``TortureSource.create``)."""

    spec: dict[str, Any]

    @property
    def name(self) -> str: ...  # what a failing seed keeps for inspection, e.g. "database torture_3"

    def workload(
        self, ctx: WorkloadContext, seed: int, duration: float, rate: float, writers: int
    ) -> list[threading.Thread]: ...

    def schema_events(self, r: random.Random) -> list[tuple[float, str]]: ...

    def run_event(self, event: str, ctx: WorkloadContext, r: random.Random) -> None: ...

    def verify_args(self) -> dict[str, Any]: ...

    def drop(self) -> None: ...


class TortureSource(Protocol):
    """One source server under torture, and its kind's worker-side operations."""

    kind: str
    # the source-restart fault's name in a seed's summary line; None: the server cannot restart without losing its
    # data (the MongoDB test server is in memory), so the runner schedules no restart
    restart_fault: str | None

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        """The kind's own command-line options (its server's port, state folder, ...)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TortureSource:
        """The server under torture, as the options of ``add_arguments`` describe it."""
        ...

    def running(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def restart(self) -> None: ...

    def create(self, seed: int, r: random.Random, scale: float, lake: Path, chunk_size: int) -> SeedSource: ...

    @staticmethod
    def build_config(spec: Mapping[str, Any]) -> CdcConfig: ...

    @staticmethod
    def offset_position(offset: Mapping[str, object]) -> int: ...

    @staticmethod
    def verify(spark: Any, spec: Mapping[str, Any], args: Mapping[str, Any]) -> VerifyResult: ...

    @staticmethod
    def break_settled_rule() -> None: ...


# ----------------------------------------------------------------------------------------------------------------
# The harness log

_LOG: list[IO[str]] = []
_LOG_LOCK = threading.Lock()


def log(message: str) -> None:
    """A progress line in ``<work-dir>/logs/harness.log`` (and on stderr with ``--verbose``)."""
    line = f"{time.strftime('%H:%M:%S')} {message}\n"
    with _LOG_LOCK:
        for stream in _LOG:
            stream.write(line)
            stream.flush()


def log_to(stream: IO[str]) -> None:
    _LOG.append(stream)


# ----------------------------------------------------------------------------------------------------------------
# Row comparison


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def show(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def show_key(values: tuple) -> str:
    return "(" + ", ".join(repr(v) for v in values) + ")"


def compare_rows(name: str, columns: list[str], mirror: dict[tuple, tuple], source: dict[tuple, tuple]) -> str | None:
    """The first (in key order) row that differs, with both values (only the differing ``columns`` when both
    exist); rows are tuples in the order of ``columns``, keyed by their key values."""
    for key in sorted(set(mirror) | set(source), key=repr):
        got, want = mirror.get(key), source.get(key)
        if got is not None and want is not None and _same(got, want):
            continue
        if got is None or want is None:
            return f"table {name} key {show_key(key)}: mirror={show(got, 300)} source={show(want, 300)}"
        differ = [i for i in range(len(columns)) if not _same(got[i], want[i])]
        shown_got = ", ".join(f"{columns[i]}: {show(got[i])}" for i in differ)
        shown_want = ", ".join(f"{columns[i]}: {show(want[i])}" for i in differ)
        return f"table {name} key {show_key(key)}: mirror={{{shown_got}}} source={{{shown_want}}}"
    return None


def lake_failures(
    spark: SparkSession, name: str, mirror: DataFrame, changelog_path: str, change_id: str,
    show_position: Callable[[int], str],
) -> tuple[list[str], DataFrame | None]:  # fmt: skip
    """What every source's verification checks of one table's lake the same way: no mirror row holds unknown
    values, and no change is twice in the changelog (``(change_id, _cdc_seq)`` unique: PostgreSQL's
    ``_cdc_commit_lsn``, MongoDB's ``_cdc_position``). Returns the failures and the changelog (None: none yet)."""
    from pyspark.sql import functions as F  # the runner itself imports no Spark

    failures = []
    unknown = mirror.where(F.col("_cdc_unknown").isNotNull()).count()
    if unknown:
        failures.append(f"table {name}: {unknown} mirror rows with _cdc_unknown values")
    if not Path(changelog_path).exists():
        return failures, None
    changelog = spark.read.format("delta").load(changelog_path)
    duplicates = changelog.groupBy(change_id, "_cdc_seq").count().where("count > 1")
    first = duplicates.first()
    if first is not None:
        failures.append(
            f"changelog {name}: {duplicates.count()} duplicate ({change_id}, _cdc_seq), e.g. "
            f"({show_position(first[change_id])}, {first['_cdc_seq']}) x{first['count']}"
        )
    return failures, changelog
