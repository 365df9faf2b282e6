"""The PostgreSQL pipeline on a Spark standalone cluster: a master and two workers (one core, 2 GB each) started on
loopback from the pip ``pyspark``'s ``spark-class`` as separate JVMs, the runs' drivers connecting with
``spark.master: spark://...``.

The end-to-end scenario of ``test_pipeline_guarantees`` (a snapshot under a concurrent writer, runs killed and run
again, the stream catching up, the mirror exact) with every run in a process of its own
(``tests.integration.kill_rerun_scenario``). The chunk reads and the stream's Spark work ran on both workers' executors
(the driver's REST API counts their tasks), never in the driver.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.integration.kill_rerun_scenario import kills_and_reruns_end_exact, scenario_config
from tools.spark_standalone import free_port, standalone_cluster

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
"""


def test_snapshot_kills_and_stream_on_a_standalone_cluster_end_exact(
    postgres_server: dict[str, str], spark_cluster: str, spark: SparkSession, tmp_path: Path, monkeypatch
) -> None:
    lake = tmp_path / "lake"
    config = scenario_config(CONFIG.format(lake=lake, master=spark_cluster, ui=free_port()), "cl", DATABASE)
    figures = kills_and_reruns_end_exact(postgres_server, DATABASE, config, tmp_path, spark, monkeypatch)
    assert figures["master"] == spark_cluster
    workers = [e for e in figures["executors"] if e["id"] != "driver"]
    assert len(workers) == 2 and all(e["tasks"] > 0 for e in workers), figures
    assert all(e["tasks"] == 0 for e in figures["executors"] if e["id"] == "driver"), figures
