"""The tags of the planner's snapshot runs (``sensors.planner.snapshot_run_tags``): a failed run is retried by
Dagster's daemon, one in flight too long is failed by its run monitor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cdc_assets.config import parse_config
from sensors.planner import _snapshot_requests, snapshot_run_tags

SOURCE = parse_config(
    {
        "lake_root": "lake",
        "sources": [
            {
                "name": "demo", "kind": "postgres", "tables": ["public.orders"], "chunks_per_run": 2,
                "connection": {"host": "127.0.0.1", "dbname": "d", "user": "u", "password": "${PGPW}"},
            }
        ],
    },
    Path("/tmp"), {"PGPW": "x"},
).source("demo")  # fmt: skip


def test_each_snapshot_run_carries_its_retries_and_its_bound_in_flight() -> None:
    requests = _snapshot_requests(SOURCE, "public.orders", [0, 1, 2], "initial", "initial snapshot")
    assert [r.run_key for r in requests] == [
        "initial:public.orders:chunk-000000:chunk-000001", "initial:public.orders:chunk-000002:chunk-000002",
    ]  # fmt: skip
    for request in requests:
        assert request.tags["dagster/max_retries"] == "3"
        assert request.tags["dagster/max_runtime"] == "21600"
        assert request.tags["cdc/reason"] == "initial snapshot"


def test_zero_is_written_out_so_the_instances_defaults_do_not_apply() -> None:
    """0 means never and no bound (the settings' documented values): the instance's defaults, which retry and bound
    every run without these tags (a backfill's from the UI), must not replace them."""
    assert snapshot_run_tags(replace(SOURCE, snapshot_run_retries=0)) == {
        "dagster/max_retries": "0", "dagster/max_runtime": "21600",
    }  # fmt: skip
    assert snapshot_run_tags(replace(SOURCE, snapshot_run_max_runtime_seconds=0)) == {
        "dagster/max_retries": "3", "dagster/max_runtime": "0",
    }  # fmt: skip
