"""The torture harness's short form as the test suite runs it (``tools/torture.py``, issue #3).

The PostgreSQL runs, the faulted one (seed 901, port 54340) and the broken-reconciliation one (seed 903, port
54341), and the MongoDB one (seed 905 with faults, ``--source mongodb``, its own test server on a free port) are
started by ``tests/conftest.py`` when their tests were selected, one after the other: the faulted one at the
session's first test, beside the browser tests, which mostly wait for Dagster's daemons (``EARLY_RUN``), the others
at the first test after the browser tests, the big-value stream tests and the consistency checks
(``BEFORE_TORTURE_RUNS``), in the background, each on its own server: the integration tests leave about a quarter of
the two cores idle (72 % busy measured over three integration modules alone: they wait on the database, on batches,
on JVM starts), so the runs go beside them instead of after them (the faulted run alone took 5 to 9 minutes after
the other tests). They run niced (``NICENESS``): at full priority they slowed the tests beside them up to fourfold
(the drift test of ``test_consistency.py``: 115 s alone, 438-501 s beside both runs), so that the suite neared its
30 minutes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# at least 250 committed write transactions: the work a run does no longer depends on how fast its chunks were
# snapshotted (CI's machine was done after 214 transactions and 384 changes, a slower one after 810 and 2,046)
SHORT = ["--duration", "20", "--scale", "0.3", "--rate", "8", "--min-transactions", "250", "--drop-failed"]
TIMEOUT = 2700
# the background runs yield to the suite's tests (CFS weight 335 against 1024); 10 (weight 110) was no faster from a
# fresh clone (pytest 2,029 s against 1,968 s at 5, 2026-11-29)
NICENESS = 5
BROKEN_SEED = 903
FAULTED_SEED = 901
MONGODB_SEED = 905
# the broken-reconciliation run only has to be caught: half the workload of the faulted run (alone on the machine
# on 2026-11-27 it FAILed naming public.big_items in 180 s; with the faulted run's --duration 20 --scale 0.3 it took
# a share of the suite's two cores the 30-minute budget no longer had)
BROKEN_SHORT = ["--duration", "10", "--scale", "0.2", "--min-transactions", "0"]
# the MongoDB short form is smaller still (the suite's time budget): fewer documents, one snapshot worker, a shorter
# workload (it lasts at least until every chunk was read once)
MONGODB_SHORT = [
    "--duration", "10", "--scale", "0.2", "--rate", "8", "--min-transactions", "150", "--chunk-size", "100",
    "--snapshot-workers", "1",
]  # fmt: skip


def torture_command(work_dir: Path, *args: str) -> list[str]:
    """The short form with ``args``; later options win, so ``args`` may override the short form's."""
    return [sys.executable, str(ROOT / "tools" / "torture.py"), *SHORT, "--work-dir", str(work_dir), *args]


def harness_log(work_dir: Path) -> None:
    log = work_dir / "logs" / "harness.log"
    if log.exists():
        print(log.read_text()[-6000:])  # shown by pytest when the test fails


@dataclass
class BackgroundRun:
    process: subprocess.Popen[bytes]
    work_dir: Path
    output: Path

    def wait(self) -> None:
        """Until the run has ended."""
        self.process.wait()

    def result(self) -> tuple[int, str, str]:
        returncode = self.process.wait(timeout=TIMEOUT)
        harness_log(self.work_dir)
        text = self.output.read_text()
        return returncode, text, text[-4000:]

    def stop(self) -> None:
        """Stop a run still going (the session ended before its test): SIGTERM lets the harness stop its workers
        and its cluster."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_run(work_dir: Path, *args: str) -> BackgroundRun:
    """Start the short form with ``args`` in the background; output and lakes in ``work_dir``."""
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    output = work_dir / "output.txt"
    with output.open("wb") as sink:
        # niced: while the suite's own tests want both cores they get most of them; the run takes what is left (and
        # all of it once they are done), within its own timeouts (600 s a task, 900 s to catch up)
        process = subprocess.Popen(torture_command(work_dir, *args), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                   preexec_fn=lambda: os.nice(NICENESS))  # fmt: skip
    return BackgroundRun(process, work_dir, output)


def start_faulted_run(work_dir: Path) -> BackgroundRun:
    """Start seed 901 with faults in the background, on its own cluster (port 54340), not the long form's default
    (port 54339), so a long-form run beside the suite is no clash."""
    return start_run(
        work_dir, "--seeds", str(FAULTED_SEED), "--pg-port", "54340",
        "--pg-state", str(ROOT / ".state" / "torture-pg-short"),
    )  # fmt: skip


def start_broken_run(work_dir: Path) -> BackgroundRun:
    """Start ``--broken-reconciliation`` on seed 903 (no faults) in the background; output in ``work_dir``. One
    snapshot worker (one Spark driver fewer beside the suite): the rule breaks on commits between a window's reads
    and its high watermark, which one worker's windows see as well."""
    return start_run(
        work_dir, "--seeds", str(BROKEN_SEED), "--no-faults", "--broken-reconciliation", "--snapshot-workers", "1",
        *BROKEN_SHORT, "--pg-port", "54341", "--pg-state", str(ROOT / ".state" / "torture-pg-broken"),
    )  # fmt: skip


class ChainedRun:
    """A background run started only once another one (``before``, itself possibly chained) has ended, so that one
    harness run (with its Spark drivers) runs beside the suite's tests at a time. Same interface as
    ``BackgroundRun``."""

    def __init__(self, before: BackgroundRun | ChainedRun, start: Callable[[], BackgroundRun]) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.run: BackgroundRun | None = None
        self.thread = threading.Thread(target=self._chain, args=(before, start), daemon=True)
        self.thread.start()

    def _chain(self, before: BackgroundRun | ChainedRun, start: Callable[[], BackgroundRun]) -> None:
        before.wait()
        with self.lock:
            if not self.cancelled:
                self.run = start()

    def wait(self) -> None:
        """Until the run has ended, or was never started (stopped, or the run before it never ended)."""
        self.thread.join()
        if self.run is not None:
            self.run.wait()

    def result(self) -> tuple[int, str, str]:
        self.thread.join(TIMEOUT)
        if self.run is None:
            raise AssertionError("the chained torture run never started: the run before it did not end")
        return self.run.result()

    def stop(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.run is not None:
                self.run.stop()


Run = BackgroundRun | ChainedRun


def start_mongodb_run(work_dir: Path) -> BackgroundRun:
    """Start seed 905 of ``--source mongodb`` with faults in the background (``MONGODB_SHORT``), on the harness's own
    MongoDB test server (a free port; the server lives in the run and is stopped with it). ``tests/conftest.py``
    starts it once the broken-reconciliation run has ended when that one runs too (``ChainedRun``): three runs at
    once would hold nine JVMs beside the suite's own."""
    return start_run(work_dir, "--source", "mongodb", "--seeds", str(MONGODB_SEED), *MONGODB_SHORT)
