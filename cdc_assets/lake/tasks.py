"""Work items spread over Spark tasks: as many tasks as the cluster runs at once, each with its share of the items.

Contract: ``map_in_tasks(spark, rows, columns, function, output)`` runs ``function`` (an Arrow batch mapper, as
``DataFrame.mapInArrow`` takes one: record batches of ``columns`` in, record batches of the ``output`` DDL schema
out) over ``rows`` (tuples of ``columns``: (name, SQL type) pairs; types ``int``, ``bigint``, ``string``) in
``min(len(rows), task_slots(spark))`` tasks, each given a contiguous run of the rows, in order, the runs differing by
at most one row, all in one stage without a shuffle; it returns the output rows (dicts) once every task has finished.
No rows: no job, no output. A task's error raises ``TaskFailed`` from the call, its message starting with the
line of the Python error the task raised (``psycopg.OperationalError: ...``: what the UI shows first), the Spark
error as its cause. On classic Spark the tasks are those of
``SparkContext.parallelize(rows, tasks).mapPartitions`` (each run handed to ``function`` as one record batch); on
Spark Connect, which has no RDD, ``rows_in_tasks(...).mapInArrow(function, output)``.

``rows_in_tasks(spark, rows, columns)`` is ``rows`` as a frame of ``min(len(rows), task_slots(spark))`` partitions
split the same way, made without a shuffle (``spark.range`` over the rows' indexes, each picking its row from one
literal array of the rows as JSON objects, parsed with ``FAILFAST``: a value that does not fit its type raises). No
rows: an empty frame of ``columns``. The values are those ``json.dumps`` writes (numbers, text, None).
``task_slots(spark)``: the session's default parallelism (the cores of a local master or of the cluster's
executors); on Spark Connect, which does not say, no limit (a task per row).

Why an RDD on classic Spark: the first ``mapInArrow`` job of a process took 3.1 s on this machine's 2 cores for two
rows (the JVM's Arrow exchange starting), a ``mapPartitions`` job 1.2 s; every snapshot run is such a first job, and
its items and output are a few rows, nothing for Arrow to carry.

Why one literal: a literal per value (and a struct per row) cost a py4j round trip each, 1.8 s of the driver's time
in the ten snapshot calls of a 10M-row table (cores idle meanwhile); the one literal of each call, 0.5 s in all.

Why not a task per row: each task of a Python function costs its worker a fixed ~0.15 CPU s (PySpark re-reads the
directory of ``pyspark.zip`` on the worker's path when a task starts: ``importlib.invalidate_caches``), 12 of the 31
CPU s of a 10M-row snapshot's reads in 80 tasks on 2 cores; and ``createDataFrame(rows).repartition(n)`` put two rows
in some partitions and none in others, behind a shuffle stage.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

ArrowMapper = Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]
ARROW_TYPES = {"int": pa.int32(), "bigint": pa.int64(), "string": pa.string()}


class TaskFailed(RuntimeError):
    """A task of ``map_in_tasks`` raised; the message starts with its Python error's line."""


def worker_error(text: str) -> str | None:
    """The line naming the error of the last Python traceback in ``text`` (a Spark error's text holds the worker's
    traceback), or ``None`` when it holds none."""
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    for line in text[start:].splitlines()[1:]:
        if line.strip() and not line.startswith((" ", "\t")):
            return line.strip()
    return None


def task_slots(spark: SparkSession) -> int | None:
    try:
        return max(1, int(spark.sparkContext.defaultParallelism))
    except Exception:  # Spark Connect: no SparkContext
        return None


def _arrow_schema(columns: Sequence[tuple[str, str]]) -> pa.Schema:
    unknown = sorted({kind for _, kind in columns if kind not in ARROW_TYPES})
    if unknown:
        raise ValueError(f"task item columns of type {', '.join(unknown)}: allowed {', '.join(sorted(ARROW_TYPES))}")
    return pa.schema([(name, ARROW_TYPES[kind]) for name, kind in columns])


def _partition_runner(function: ArrowMapper, schema: pa.Schema) -> Callable[[Iterable[tuple]], Iterator[dict]]:
    def run(items: Iterable[tuple]) -> Iterator[dict[str, Any]]:
        run_rows = list(items)
        if not run_rows:
            return
        columns = [pa.array([row[i] for row in run_rows], field.type) for i, field in enumerate(schema)]
        for batch in function(iter([pa.RecordBatch.from_arrays(columns, schema=schema)])):
            yield from batch.to_pylist()

    return run


def map_in_tasks(
    spark: SparkSession, rows: Sequence[tuple], columns: Sequence[tuple[str, str]], function: ArrowMapper, output: str
) -> list[dict[str, Any]]:
    schema = _arrow_schema(columns)
    if not rows:
        return []
    slots = task_slots(spark)
    try:
        if slots is None:
            frame = rows_in_tasks(spark, rows, columns).mapInArrow(function, output)
            return [row.asDict() for row in frame.collect()]
        runs = spark.sparkContext.parallelize(list(rows), min(len(rows), slots))
        return runs.mapPartitions(_partition_runner(function, schema)).collect()
    except Exception as error:
        cause = worker_error(str(error))
        if cause is None:
            raise
        raise TaskFailed(f"{cause} (raised in a Spark task; the task's traceback is in the cause below)") from error


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
