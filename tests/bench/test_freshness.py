"""The freshness bench's report of Delta's own MERGE clock (``bench/freshness.py``): read from a MERGE commit's
``operationMetrics`` (milliseconds, as strings), set beside the stream's merge and changelog phases."""

from __future__ import annotations

from bench.freshness import delta_merge_line, delta_merge_seconds


def test_a_merge_commits_metrics_become_seconds_and_missing_ones_are_left_out() -> None:
    metrics = {"executionTimeMs": "1821", "scanTimeMs": "566", "rewriteTimeMs": "1002", "numSourceRows": "3488",
               "materializeSourceTimeMs": "0"}  # fmt: skip
    # a source not materialized reports 0 ms: a time like the others; a metric missing from the commit is left out
    assert delta_merge_seconds(metrics) == {"execution": 1.821, "scan": 0.566, "rewrite": 1.002, "source": 0.0}
    assert delta_merge_seconds({}) == {}


def test_the_line_sets_the_statements_clock_beside_the_phases() -> None:
    merges = [{"execution": 1.0, "scan": 0.25, "rewrite": 0.5}, {"execution": 2.0, "scan": 0.25, "rewrite": 1.5},
              {"execution": 3.0, "scan": 0.25, "rewrite": 2.5}]  # fmt: skip
    columns = {"changelog": [0.5, 0.5, 0.5], "merge": [2.0, 3.0, 4.0], "batch": [4.0, 5.0, 6.0]}
    line = delta_merge_line(merges, columns)
    assert "3 MERGE commits" in line
    assert "p50 2.00 s" in line  # the statements' median
    assert "scan p50 0.25 s, rewrite p50 1.50 s" in line
    assert "source p50" not in line  # no commit reported a materialization
    assert "the rest 1.00 s is outside its clock" in line  # merge phase p50 3.0 - statement p50 2.0
    assert "make 2.50 s of a batch's p50 5.00 s" in line  # 2.0 + changelog 0.5


def test_without_a_merge_commit_the_line_says_so() -> None:
    assert "no MERGE commit" in delta_merge_line([], {"batch": [1.0]})
