"""When the streaming sensor requests a successor for the stream run in flight (``sensors.stream.successor_reason``):
a pure decision over the runs in flight and their tags."""

from __future__ import annotations

from dagster import DagsterRun

from cdc_assets.assets import ENDS_AT_TAG
from sensors.stream import successor_reason

NOW = 1_000_000.0


def run(run_id: str, ends_at: float | None) -> DagsterRun:
    tags = {} if ends_at is None else {ENDS_AT_TAG: str(round(ends_at))}
    return DagsterRun(job_name="demo_stream", run_id=run_id, tags=tags)


def test_a_successor_is_requested_within_the_lead_before_the_run_in_flight_ends() -> None:
    assert successor_reason([run("a", NOW + 61)], 60, NOW) is None  # not yet
    assert successor_reason([run("a", NOW + 60)], 60, NOW) == "successor of stream run a, whose batches end in 60 s"
    assert successor_reason([run("a", NOW)], 60, NOW) is not None
    # past its end: in its last batch, or lost with its code server (ended by the run monitor, then a run as before)
    assert successor_reason([run("a", NOW - 1)], 60, NOW) is None


def test_no_successor_without_a_lead_before_the_run_streams_or_beside_a_successor() -> None:
    assert successor_reason([run("a", NOW + 10)], 0, NOW) is None  # handoff off, or one batch per run
    assert successor_reason([run("a", None)], 60, NOW) is None  # still starting or warming: its end is not known
    assert successor_reason([run("b", None), run("a", NOW + 10)], 60, NOW) is None  # its successor is requested
    assert successor_reason([], 60, NOW) is None
