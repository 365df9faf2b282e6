"""The torture harness (``tools/torture.py``, issue #3) run as a subprocess, in its short form.

- with faults (SIGKILLs at the fault points, an executor loss, a source restart), a seed passes;
- with ``--broken-reconciliation`` (stream workers treat every transaction as settled), a seed fails: the harness
  can fail. Every window of the short form is read under concurrent writes, and each chunk's staging write takes
  seconds, so commits land between a chunk's read and its high watermark; the broken rule then upserts rows older
  than changes already applied (or resurrects deleted ones, or deletes inserted ones), which the row comparison
  reports.

Seeds 901 and 903 keep these databases apart from manual runs (``torture_<seed>``). The two runs are independent
and each is mostly one Spark driver's planning and compiling (about one core of two), so the broken run starts in
the background on its own cluster (port 54341) when the module starts, and the faulted run goes on meanwhile on the
harness's default cluster (its source restart must not touch the other run). Each run takes three to eight minutes
on a 2-core machine; the long form (``--seeds 1-100``) is a command, its last result is in the README.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--duration", "20", "--scale", "0.3", "--rate", "8", "--drop-failed"]
TIMEOUT = 2700


def torture_command(work_dir: Path, *args: str) -> list[str]:
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

    def result(self) -> tuple[int, str, str]:
        returncode = self.process.wait(timeout=TIMEOUT)
        harness_log(self.work_dir)
        text = self.output.read_text()
        return returncode, text, text[-4000:]


@pytest.fixture(scope="module", autouse=True)
def broken_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundRun]:
    work_dir = tmp_path_factory.mktemp("torture_broken")
    output = work_dir / "output.txt"
    command = torture_command(
        work_dir, "--seeds", "903", "--no-faults", "--broken-reconciliation",
        "--pg-port", "54341", "--pg-state", str(ROOT / ".state" / "torture-pg-broken"),
    )  # fmt: skip
    with output.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    run = BackgroundRun(process, work_dir, output)
    yield run
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.timeout(2800)
def test_short_form_with_faults_passes(tmp_path: Path) -> None:
    result = subprocess.run(torture_command(tmp_path, "--seeds", "901"), cwd=ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT)  # fmt: skip
    harness_log(tmp_path)
    output = result.stdout
    assert result.returncode == 0, f"rc={result.returncode}\n{output}\n{result.stderr[-4000:]}"
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^seed (\d+): PASS .*$", output, re.M)}
    assert sorted(lines) == [901], output
    assert "1 passed, 0 failed" in output
    faults = [int(re.search(r" faults=(\d+)", line).group(1)) for line in lines.values()]  # type: ignore[union-attr]
    assert all(f >= 1 for f in faults), output  # at least the source restart
    assert "pg-restart=1" in lines[901], output
    for line in lines.values():
        changes = int(re.search(r" changes=(\d+)", line).group(1))  # type: ignore[union-attr]
        assert changes > 500, line


@pytest.mark.timeout(2800)
def test_broken_reconciliation_is_caught(broken_run: BackgroundRun) -> None:
    returncode, output, tail = broken_run.result()
    assert returncode == 1, f"rc={returncode}\n{tail}"
    assert re.search(r"^seed 903: FAIL (table|changelog) public\.\w+", output, re.M), tail
    assert "0 passed, 1 failed" in output
