"""``cdc_assets.lake.tasks``: work items spread over one task per core, in order, without a shuffle."""

from __future__ import annotations

import pytest
from pyspark.sql import SparkSession

from cdc_assets.lake.tasks import rows_in_tasks, task_slots

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
