"""``cdc_assets.lake.tasks``: work items spread over one task per core, in order, without a shuffle; the same runs
and outputs from the classic (RDD) path and the Spark Connect one (``rows_in_tasks`` + ``mapInArrow``)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from cdc_assets.lake import tasks
from cdc_assets.lake.tasks import TaskFailed, map_in_tasks, rows_in_tasks, task_slots, worker_error

COLUMNS = (("chunk", "int"), ("part", "int"), ("lo", "string"), ("hi", "string"))


def test_rows_keep_their_values_and_order_in_contiguous_runs_one_task_per_core(spark: SparkSession) -> None:
    rows = [
        (index, index % 3, None if index == 0 else f'["k\\u00e9y {index}", "a,b"]', None if index == 6 else str(index))
        for index in range(7)
    ]
    frame = rows_in_tasks(spark, rows, COLUMNS)
    assert [(f.name, f.dataType.simpleString()) for f in frame.schema.fields] == list(COLUMNS)
    slots = task_slots(spark)
    assert slots is not None and frame.rdd.getNumPartitions() == min(len(rows), slots)
    runs = frame.rdd.glom().map(lambda part: [tuple(r) for r in part]).collect()
    assert [row for run in runs for row in run] == rows  # contiguous runs, in order, every value as given
    sizes = [len(run) for run in runs]
    assert max(sizes) - min(sizes) <= 1
    assert "Exchange" not in frame._jdf.queryExecution().executedPlan().toString()  # no shuffle


def test_no_rows_is_an_empty_frame_of_the_columns_and_a_value_that_does_not_fit_raises(spark: SparkSession) -> None:
    empty = rows_in_tasks(spark, [], COLUMNS)
    assert empty.count() == 0 and [f.name for f in empty.schema.fields] == [n for n, _ in COLUMNS]
    with pytest.raises(Exception, match=r"(?i)malformed|parse|FAILFAST"):
        rows_in_tasks(spark, [("not a number", 0, None, None)], COLUMNS).collect()


def test_map_in_tasks_gives_the_same_runs_and_outputs_on_both_paths(spark: SparkSession, monkeypatch) -> None:
    """Functions shipped to the workers are defined in the test (pickled by value: workers cannot import tests)."""

    def runs_seen(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """One output row per input batch (as a task sees its run): first chunk, row count, every item's text."""
        for batch in batches:
            items = batch.to_pylist()
            text = "|".join(f"{i['chunk']}:{i['part']}:{i['lo']}:{i['hi']}" for i in items)
            yield pa.RecordBatch.from_pylist(
                [{"first": items[0]["chunk"], "rows": len(items), "items": text}],
                schema=pa.schema([("first", pa.int32()), ("rows", pa.int64()), ("items", pa.string())]),
            )

    rows = [(index, index % 2, "ké,y" if index % 3 else None, str(index * 10)) for index in range(5)]
    output = "first int, rows long, items string"
    classic = sorted(map_in_tasks(spark, rows, COLUMNS, runs_seen, output), key=lambda r: r["first"])
    monkeypatch.setattr(tasks, "task_slots", lambda _spark: None)  # what Spark Connect answers: a task per row
    connect_like = sorted(map_in_tasks(spark, rows, COLUMNS, runs_seen, output), key=lambda r: r["first"])
    monkeypatch.undo()
    expected = [f"{c}:{p}:{lo}:{hi}" for c, p, lo, hi in rows]  # in order, values intact
    slots = task_slots(spark)
    assert slots is not None and len(classic) == min(len(rows), slots)  # one task (one batch) per slot
    assert max(r["rows"] for r in classic) - min(r["rows"] for r in classic) <= 1
    assert [item for run in classic for item in run["items"].split("|")] == expected  # contiguous runs
    assert [run["items"] for run in connect_like] == expected
    assert map_in_tasks(spark, [], COLUMNS, runs_seen, "first int, rows long, items string") == []
    with pytest.raises(ValueError, match=r"double.*allowed bigint, int, string"):
        map_in_tasks(spark, [(1.5,)], (("x", "double"),), runs_seen, "first int")


def test_the_error_line_of_a_workers_traceback() -> None:
    text = (
        "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
        ": org.apache.spark.SparkException: Job aborted ... org.apache.spark.api.python.PythonException: "
        'Traceback (most recent call last):\n  File "worker.py", line 1, in main\n    read()\n'
        "psycopg.errors.InsufficientPrivilege: permission denied for table orders\n\n"
        "\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:1)\n"
    )
    assert worker_error(text) == "psycopg.errors.InsufficientPrivilege: permission denied for table orders"
    assert worker_error("Job aborted: executor lost") is None


def test_a_task_error_raises_from_the_call_naming_the_workers_error_first(spark: SparkSession) -> None:
    def failing(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for _ in batches:
            raise RuntimeError("read of sub-range failed: connection refused")
        yield from ()

    with pytest.raises(TaskFailed, match=r"^RuntimeError: read of sub-range failed: connection refused \(raised in"):
        map_in_tasks(spark, [(1, 0, None, None)], COLUMNS, failing, "chunk int, rows long")
