"""One run of the pipeline in a process of its own (a process holds one Spark context; the test's own is ``local[2]``),
as a Dagster run on a Spark cluster would: snapshot every chunk of every captured table (unless ``--stream-only``),
then stream batches until nothing waits, recording each batch's offset in ``OFFSET_FILE`` before acknowledging it
(as the stream asset records it in its materialization). Prints one JSON line: the master, the batches, and per
executor (the driver UI's REST API) the tasks it ran.

    python -m tests.integration.cluster_run CONFIG OFFSET_FILE RUN_ID [--stream-only]

``CDC_FAULTS`` kills it at a named fault point (``cdc_assets.engine.faults``).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

from cdc_assets.config import load_config
from cdc_assets.lake.spark import spark_session
from cdc_assets.sources import open_source


def main(config_path: str, offset_file: str, run_id: str, stream_only: bool) -> None:
    config = load_config(config_path)
    pipeline = open_source(config, config.sources[0])
    spark = spark_session(config.spark, config.lake_root)
    for table in pipeline.prepare().values():
        if not stream_only:
            pipeline.snapshot(spark, table, [c.index for c in pipeline.plan(table).chunks], run_id)
    offsets = Path(offset_file)
    batches = 0
    for batches in range(1, 21):
        recorded = json.loads(offsets.read_text()) if offsets.exists() else None
        report = pipeline.stream_batch(spark, recorded, f"{run_id}-b{batches}")
        offsets.write_text(json.dumps(report.offset, default=str))
        pipeline.acknowledge(report.offset)
        if report.changes == 0 and report.waiting_windows == 0 and report.lag_bytes == 0:
            break
    context = spark.sparkContext
    url = f"{context.uiWebUrl}/api/v1/applications/{context.applicationId}/executors"
    executors = [
        {"id": e["id"], "host_port": e["hostPort"], "tasks": e["totalTasks"]}
        for e in json.load(urllib.request.urlopen(url))
    ]
    print(json.dumps({"master": context.master, "batches": batches, "executors": executors}))
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:4], stream_only="--stream-only" in sys.argv[4:])
