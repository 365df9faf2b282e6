"""The Spark session: the defaults that need no session (the driver heap that fits the machine), and a driver JVM
that died replaced by the next session asked for (in a process of its own: the suite's driver stays)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cdc_assets.lake.spark import default_driver_memory, machine_memory_bytes, memory_megabytes

GB = 2**30


def test_default_driver_memory_is_a_quarter_of_the_machine_with_a_floor_and_a_cap() -> None:
    assert default_driver_memory(24 * GB) == "6144m"
    assert default_driver_memory(2 * GB) == "1024m"  # the floor
    assert default_driver_memory(256 * GB) == "16384m"  # the cap
    assert machine_memory_bytes() > 0


def test_memory_sizes_read_as_the_jvm_writes_them() -> None:
    assert memory_megabytes("6026m") == 6026 and memory_megabytes("2g") == 2048 and memory_megabytes("1048576") == 1


ROOT = Path(__file__).resolve().parents[2]
KILLED_DRIVER = """
import os, signal
from pyspark import SparkContext
from cdc_assets.config import SparkConfig
from cdc_assets.lake.spark import forget_exited_driver, spark_session

config = SparkConfig(master="local[1]")
first = spark_session(config)
print("first", first.range(5).count(), forget_exited_driver())
old = SparkContext._gateway.proc
os.kill(old.pid, signal.SIGKILL)  # what the kernel's OOM killer sends
old.wait()
try:
    first.range(5).count()
except Exception as error:
    print("dead driver:", type(error).__name__)
second = spark_session(config)
print("second", second.range(7).count(), SparkContext._gateway.proc.pid != old.pid, second is not first)
second.stop()
"""


def test_a_driver_jvm_that_died_is_replaced_by_the_next_session() -> None:
    result = subprocess.run(
        [sys.executable, "-c", KILLED_DRIVER], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "first 5 None" in lines  # a running driver is kept
    assert any(line.startswith("dead driver:") for line in lines)  # the old session fails (py4j)
    assert "second 7 True True" in lines, result.stdout  # a new JVM, a new session
