"""The torture harness's short form as the test suite runs it (``tools/torture.py``, issue #3).

The broken-reconciliation run (seed 903) is started by ``tests/conftest.py`` as soon as collection selected its test,
in the background on its own cluster (port 54341): it is one Spark driver's planning and compiling, about one core
of two, and the integration tests before it use one core too, so it runs beside them instead of after them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["--duration", "20", "--scale", "0.3", "--rate", "8", "--drop-failed"]
TIMEOUT = 2700
BROKEN_SEED = 903


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


def start_broken_run(work_dir: Path) -> BackgroundRun:
    """Start ``--broken-reconciliation`` on seed 903 (no faults) in the background; output in ``work_dir``."""
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)
    output = work_dir / "output.txt"
    command = torture_command(
        work_dir, "--seeds", str(BROKEN_SEED), "--no-faults", "--broken-reconciliation",
        "--pg-port", "54341", "--pg-state", str(ROOT / ".state" / "torture-pg-broken"),
    )  # fmt: skip
    with output.open("wb") as sink:
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    return BackgroundRun(process, work_dir, output)
