"""A Spark standalone cluster on loopback for the tests and the benchmarks: a master and workers, each a JVM of its
own started from the pip ``pyspark``'s ``bin/spark-class`` (the pip package has no ``sbin`` start scripts).

Contract: ``standalone_cluster`` yields once every worker is registered ``ALIVE`` with the master (read from the
master's JSON status page), or raises naming the master's log; on leaving the block every process group it started
(each JVM and the executors its worker started) is killed, whatever happened inside. Nothing outside ``work`` is
written (logs, the workers' work directories).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A loopback port free when asked (for a server about to be started)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spark_class() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent / "bin" / "spark-class"


@dataclass(frozen=True)
class StandaloneCluster:
    master: str  # spark://127.0.0.1:<port>
    web_port: int  # the master's status page (``/json/``)
    master_pid: int
    worker_pids: tuple[int, ...]  # each worker's JVM; its executors are its children
    work: Path

    def status(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/json/", timeout=5) as answer:
            return json.load(answer)


@contextmanager
def standalone_cluster(
    work: Path, workers: int = 2, cores: int = 1, memory: str = "2g", timeout_seconds: float = 120
) -> Iterator[StandaloneCluster]:
    """A master and ``workers`` workers of ``cores`` cores and ``memory`` each, on 127.0.0.1 (see the module)."""
    work.mkdir(parents=True, exist_ok=True)
    port, web_port = free_port(), free_port()
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1"}

    def start(name: str, arguments: list[str]) -> subprocess.Popen[bytes]:
        with (work / f"{name}.log").open("w") as log:
            return subprocess.Popen(
                [str(spark_class()), *arguments], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    processes = [start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                                  "--webui-port", str(web_port)])]  # fmt: skip
    master = f"spark://127.0.0.1:{port}"
    try:
        for n in range(1, workers + 1):
            processes.append(start(f"worker-{n}", [
                "org.apache.spark.deploy.worker.Worker", master, "--host", "127.0.0.1", "--cores", str(cores),
                "--memory", memory, "--webui-port", str(free_port()), "--work-dir", str(work / f"worker-{n}"),
            ]))  # fmt: skip
        cluster = StandaloneCluster(master, web_port, processes[0].pid, tuple(p.pid for p in processes[1:]), work)
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                if [w["state"] for w in cluster.status()["workers"]] == ["ALIVE"] * workers:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Spark standalone cluster in {work} had not {workers} ALIVE workers after {timeout_seconds} s;"
                    f" the master's log ends:\n{(work / 'master.log').read_text()[-3000:]}"
                )
            time.sleep(1)
        yield cluster
    finally:
        for process in processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
