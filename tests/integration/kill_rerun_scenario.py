"""The end-to-end scenario run where the pipeline's deployment changes (a Spark standalone cluster, a lake on an object
store): a snapshot under a concurrent writer, runs killed and run again, the stream catching up, the mirror exact.

Contract: ``kills_and_reruns_end_exact(postgres_server, database, config_text, work, spark)`` seeds ``database``
(``tests.integration.support.seeded_source``), writes ``config_text`` (a ``cdc.yaml`` whose one PostgreSQL source
reads it as ``<database>_reader`` with the password from ``$CL_PW``) into ``work``, and runs the pipeline in processes
of its own (``tests.integration.cluster_run``) while ``Writer`` changes both tables: run 1 is killed while its chunks'
rows are staged (``snapshot.before_window_record``), run 2 after a stream batch's lake commit
(``stream.after_lake_commit``, its offset not recorded), then run 3 streams to the end. It asserts each outcome and
that every captured table's mirror (read with ``spark``, a session that reaches the lake) equals its source, and
returns run 3's figures (the JSON line ``cluster_run`` prints: master, batches, tasks per executor).
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
from pathlib import Path
from typing import Any

import psycopg
from pyspark.sql import SparkSession

from cdc_assets.config import load_config
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from tests.integration.support import PG_PORT, READER_PASSWORD, mirror_rows, seeded_source, source_rows

ROOT = Path(__file__).resolve().parents[2]
SOURCE = """
sources:
  - name: {name}
    kind: postgres
    connection: {{host: 127.0.0.1, port: {port}, dbname: {database}, user: {database}_reader,
                 password: "${{CL_PW}}"}}
    slot: {database}
    publication: {database}
    chunk_size: 1000
    include: ["public.*"]
"""


def scenario_config(lake_and_spark: str, name: str, database: str) -> str:
    """A ``cdc.yaml`` of ``lake_and_spark`` (its ``lake_root`` and ``spark`` keys) and one PostgreSQL source ``name``
    reading ``database`` (``chunk_size`` 1000, every table of ``public``)."""
    return lake_and_spark + SOURCE.format(name=name, port=PG_PORT, database=database)


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


def kills_and_reruns_end_exact(
    postgres_server: dict[str, str], database: str, config_text: str, work: Path, spark: SparkSession,
    monkeypatch: Any,
) -> dict[str, Any]:  # fmt: skip
    with seeded_source(postgres_server, database) as (_, admin_dsn):
        config = work / "cdc.yaml"
        config.write_text(config_text)
        offsets = work / "offset.json"
        writer = Writer(f"{admin_dsn} dbname={database}")
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

        monkeypatch.setenv("CL_PW", READER_PASSWORD)
        loaded = load_config(config)
        pipeline = PostgresPipeline(loaded, loaded.sources[0])
        tables = sorted(pipeline.prepare().items())
        assert [name for name, _ in tables] == ["public.docs", "public.items", "public.pairs"]
        for name, table in tables:
            expected = source_rows(loaded.sources[0], table)
            assert mirror_rows(spark, pipeline.lake.table(name).mirror, table) == expected, name
        return figures
