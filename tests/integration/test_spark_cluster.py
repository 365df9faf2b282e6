"""The PostgreSQL pipeline as it is deployed beyond one machine: on a Spark standalone cluster (a master and two workers
of one core and 2 GB, started on loopback from the pip ``pyspark``'s ``spark-class`` as separate JVMs, the runs'
drivers connecting with ``spark.master: spark://...``) with the lake on an object store (``lake_root: s3a://...`` on
moto's S3 server, the ``s3_lake`` fixture, started before the workers so that their executors inherit its endpoint
and credentials as a cluster's nodes would have their own).

The end-to-end scenario of ``test_pipeline_guarantees`` (a snapshot under a concurrent writer, runs killed and run
again, the stream catching up, the mirror exact) with every run in a process of its own
(``tests.integration.kill_rerun_scenario``). The chunk reads (the executors' Python workers writing staged files to
S3) and the stream's Spark work ran on both workers' executors (the driver's REST API counts their tasks), never in
the driver; afterwards the bucket holds the tables' Delta logs and the control files, and no local folder was made for
the lake.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.integration.kill_rerun_scenario import kills_and_reruns_end_exact, scenario_config
from tests.integration.s3_support import bucket_keys
from tools.spark_standalone import free_port, standalone_cluster

DATABASE = "pipe_cluster"


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory, s3_lake: str) -> Iterator[str]:
    """A standalone master and two workers (one core, 2 GB) on loopback, started while ``s3_lake``'s environment is
    set (a worker's executors inherit it); yields the master's URL."""
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


def test_snapshot_kills_and_stream_on_a_standalone_cluster_with_the_lake_on_s3_end_exact(
    postgres_server: dict[str, str], spark_cluster: str, spark: SparkSession, s3_lake: str, tmp_path: Path, monkeypatch
) -> None:
    lake = f"{s3_lake}/cluster"
    config = scenario_config(CONFIG.format(lake=lake, master=spark_cluster, ui=free_port()), "cl", DATABASE)
    figures = kills_and_reruns_end_exact(postgres_server, DATABASE, config, tmp_path, spark, monkeypatch)
    assert figures["master"] == spark_cluster
    workers = [e for e in figures["executors"] if e["id"] != "driver"]
    assert len(workers) == 2 and all(e["tasks"] > 0 for e in workers), figures
    assert all(e["tasks"] == 0 for e in figures["executors"] if e["id"] == "driver"), figures
    keys = bucket_keys(lake)
    for table in ("public.items", "public.pairs"):
        assert f"cl/{table}/mirror/_delta_log/00000000000000000000.json" in keys, keys[:50]
        assert any(k.startswith(f"cl/{table}/changelog/_delta_log/") for k in keys)
        assert f"cl/_cdc/plans/{table}.json" in keys
    assert "cl/_cdc/acknowledged" in keys and any(k.startswith("cl/_cdc/windows/_delta_log/") for k in keys)
    assert not [k for k in keys if "/_cdc/spill/" in k and not k.endswith("/")]  # every batch's spill was removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cdc.yaml", "offset.json", "run1.log", "run2.log", "run3.log"]
