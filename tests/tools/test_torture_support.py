"""How the suite starts its background torture runs (``tests/tools/torture_support.py``): a ``ChainedRun`` starts
only once the run before it has ended, returns its own result, and once stopped starts nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.tools.torture_support import BackgroundRun, ChainedRun


def _run(tmp_path: Path, name: str, code: str) -> BackgroundRun:
    output = tmp_path / f"{name}.txt"
    with output.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=sink, stderr=subprocess.STDOUT)
    return BackgroundRun(process, tmp_path / name, output)


def test_a_chained_run_starts_after_the_run_before_it(tmp_path: Path) -> None:
    before = _run(tmp_path, "before", "import time; time.sleep(1.0); print('before done')")
    started: list[float] = []

    def start() -> BackgroundRun:
        started.append(time.monotonic())
        return _run(tmp_path, "after", "print('seed 905: PASS')")

    chained = ChainedRun(before, start)
    time.sleep(0.3)
    assert not started  # the run before it is still going
    returncode, output, _ = chained.result()
    assert (returncode, output.strip()) == (0, "seed 905: PASS")
    assert before.process.poll() == 0 and len(started) == 1


def test_a_stopped_chained_run_never_starts(tmp_path: Path) -> None:
    before = _run(tmp_path, "before", "import time; time.sleep(0.5)")
    started: list[BackgroundRun] = []
    chained = ChainedRun(before, lambda: started.append(_run(tmp_path, "after", "")) or started[-1])
    chained.stop()
    before.process.wait()
    chained.thread.join(5)
    assert not started


def test_a_run_chained_after_a_chained_run_starts_after_both(tmp_path: Path) -> None:
    first = _run(tmp_path, "first", "import time; time.sleep(0.6)")
    order: list[str] = []

    def second_start() -> BackgroundRun:
        order.append("second")
        return _run(tmp_path, "second", "import time; time.sleep(0.6)")

    def third_start() -> BackgroundRun:
        order.append("third")
        assert second.run is not None and second.run.process.poll() is not None  # the second has ended
        return _run(tmp_path, "third", "print('seed 905: PASS')")

    second = ChainedRun(first, second_start)
    third = ChainedRun(second, third_start)
    assert third.result()[:2] == (0, "seed 905: PASS\n")
    assert order == ["second", "third"]
