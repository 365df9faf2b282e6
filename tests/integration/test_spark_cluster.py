"""The PostgreSQL pipeline on a Spark standalone cluster: a master and two workers (one core, 2 GB each) started on
loopback from the pip ``pyspark``'s ``spark-class`` as separate JVMs, the runs' drivers connecting with
``spark.master: spark://...``.

The end-to-end scenario of ``test_pipeline_guarantees`` (a snapshot under a concurrent writer, runs killed and run
again, the stream catching up, the mirror exact) with every run in a process of its own (``cluster_run``): one
killed while staging (``snapshot.before_window_record``), one after a stream batch's lake commit
(``stream.after_lake_commit``, after it staged every chunk again), then a stream run to the end. The chunk reads
and the stream's Spark work ran on both workers' executors (the driver's REST API counts their tasks), never in the
driver.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from pyspark.sql import SparkSession

from cdc_assets.config import load_config
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from tests.integration.support import (
    PG_PORT,
    READER_PASSWORD,
    mirror_rows,
    seeded_source,
    source_rows,
)
from tools.spark_standalone import free_port, standalone_cluster

ROOT = Path(__file__).resolve().parents[2]
DATABASE = "pipe_cluster"


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone master and two workers (one core, 2 GB) on loopback; yields the master's URL."""
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=1, memory="2g") as cluster:
        yield cluster.master


CONFIG = """
lake_root: {lake}
spark:
  master: "{master}"
  conf:
    spark.executor.memory: 1g
    spark.executor.cores: "1"
    spark.driver.memory: 1g
    spark.driver.host: 127.0.0.1
    spark.driver.bindAddress: 127.0.0.1
    spark.ui.enabled: "true"
    spark.ui.port: "{ui}"
sources:
  - name: cl
    kind: postgres
    connection: {{host: 127.0.0.1, port: {port}, dbname: {database}, user: {database}_reader,
                 password: "${{CL_PW}}"}}
    slot: {database}
    publication: {database}
    chunk_size: 1000
    include: ["public.*"]
"""


class Writer(threading.Thread):
    """Inserts, updates and deletes on ``pairs`` and ``items`` until stopped, one transaction at a time."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn, self.stopped, self.commits, self.error = dsn, threading.Event(), 0, None

    def run(self) -> None:
        rng = random.Random(7)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute("set synchronous_commit = on")
                while not self.stopped.is_set():
                    n = rng.randint(1, 400)
                    with conn.transaction():
                        conn.execute("update pairs set amount = amount + 1, label = label || '.' where region = %s",
                                     [n % 20])  # fmt: skip
                        conn.execute("insert into pairs values (%s, %s, 1, 'new') on conflict do nothing",
                                     [1000 + n, f"w{self.commits}"])  # fmt: skip
                        conn.execute("delete from items where id = %s", [n])
                        conn.execute("update items set qty = qty + 1 where id = %s", [n + 1])
                    self.commits += 1
                    time.sleep(0.2)
        except Exception as error:  # reported by the test
            self.error = error


def cluster_run(config: Path, offsets: Path, run_id: str, faults: str = "", *options: str) -> tuple[int, str]:
    """One run in a session of its own; when its Python process has ended (or was killed at a fault point) the
    session is killed too, as a lost machine loses the driver's JVM with it (an orphaned JVM would keep the run's
    application, and the pipes, open)."""
    env = {**os.environ, "CL_PW": READER_PASSWORD, "CDC_FAULTS": faults, "PYTHONPATH": str(ROOT)}
    log = config.with_name(f"{run_id}.log")
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.cluster_run", str(config), str(offsets), run_id, *options],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            status = process.wait(timeout=600)
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return status, log.read_text()


def test_snapshot_kills_and_stream_on_a_standalone_cluster_end_exact(
    postgres_server: dict[str, str], spark_cluster: str, spark: SparkSession, tmp_path: Path, monkeypatch
) -> None:
    with seeded_source(postgres_server, DATABASE) as (_, admin_dsn):
        config = tmp_path / "cdc.yaml"
        config.write_text(CONFIG.format(
            lake=tmp_path / "lake", master=spark_cluster, ui=free_port(), port=PG_PORT, database=DATABASE
        ))  # fmt: skip
        offsets = tmp_path / "offset.json"
        writer = Writer(f"{admin_dsn} dbname={DATABASE}")
        writer.start()
        try:
            status, output = cluster_run(config, offsets, "run1", faults="snapshot.before_window_record")
            assert status == -signal.SIGKILL, output[-4000:]  # killed while its chunk's rows were staged
            status, output = cluster_run(config, offsets, "run2", faults="stream.after_lake_commit")
            assert status == -signal.SIGKILL, output[-4000:]  # killed after a batch's lake commit, offset not recorded
            assert not offsets.exists()
        finally:
            writer.stopped.set()
            writer.join()
        assert writer.error is None and writer.commits > 10, (writer.error, writer.commits)
        status, output = cluster_run(config, offsets, "run3", "", "--stream-only")  # run 2 staged every chunk
        assert status == 0, output[-4000:]
        figures = json.loads(next(line for line in output.splitlines() if line.startswith('{"master"')))
        assert figures["master"] == spark_cluster
        workers = [e for e in figures["executors"] if e["id"] != "driver"]
        assert len(workers) == 2 and all(e["tasks"] > 0 for e in workers), figures
        assert all(e["tasks"] == 0 for e in figures["executors"] if e["id"] == "driver"), figures

        monkeypatch.setenv("CL_PW", READER_PASSWORD)
        loaded = load_config(config)
        pipeline = PostgresPipeline(loaded, loaded.sources[0])
        for name, table in sorted(pipeline.prepare().items()):
            expected = source_rows(loaded.sources[0], table)
            assert mirror_rows(spark, pipeline.lake.table(name).mirror, table) == expected, name
