"""Work items spread over Spark tasks: as many tasks as the cluster runs at once, each with its share of the items.

Contract: ``rows_in_tasks(spark, rows, columns)`` is ``rows`` (tuples of ``columns``: (name, SQL type) pairs) as a
frame of ``min(len(rows), task_slots(spark))`` partitions, each holding a contiguous run of the rows, in order, the
runs differing by at most one row; made without a shuffle (``spark.range`` over the rows' indexes, each picking its
row from one literal array of the rows as JSON objects, parsed with ``FAILFAST``: a value that does not fit its type
raises), so a ``mapInArrow`` over it is one stage of tasks that all run at once. Works on Spark Connect (no RDD). No
rows: an empty frame of ``columns``. The values are those ``json.dumps`` writes (numbers, text, None).
``task_slots(spark)``: the session's default parallelism (the cores of a local master or of the cluster's
executors); on Spark Connect, which does not say, no limit (a task per row).

Why one literal: a literal per value (and a struct per row) cost a py4j round trip each, 1.8 s of the driver's time
in the ten snapshot calls of a 10M-row table (cores idle meanwhile); the one literal of each call, 0.5 s in all.

Why not a task per row: each task of a Python function costs its worker a fixed ~0.15 CPU s (PySpark re-reads the
directory of ``pyspark.zip`` on the worker's path when a task starts: ``importlib.invalidate_caches``), 12 of the 31
CPU s of a 10M-row snapshot's reads in 80 tasks on 2 cores; and ``createDataFrame(rows).repartition(n)`` put two rows
in some partitions and none in others, behind a shuffle stage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F


def task_slots(spark: SparkSession) -> int | None:
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:  # Spark Connect: no SparkContext
        return None


def rows_in_tasks(spark: SparkSession, rows: Sequence[tuple], columns: Sequence[tuple[str, str]]) -> DataFrame:
    schema = ", ".join(f"`{name}` {kind}" for name, kind in columns)
    if not rows:
        return spark.createDataFrame([], schema)
    names = [name for name, _ in columns]
    items = F.lit([json.dumps(dict(zip(names, row, strict=True))) for row in rows])
    tasks = min(len(rows), task_slots(spark) or len(rows))
    frame = spark.range(0, len(rows), 1, tasks)
    item = F.from_json(F.element_at(items, F.col("id").cast("int") + 1), schema, {"mode": "FAILFAST"})
    return frame.select(item.alias("_item")).select("_item.*")
