"""The Dagster glue's pure helpers (``cdc_assets/assets.py``), without Spark or a database (one in-process Dagster
run of a test asset)."""

from __future__ import annotations

from dagster import (
    DagsterEventType,
    DagsterExecutionInterruptedError,
    RetryPolicy,
    asset,
    materialize,
)

from cdc_assets.assets import RETRY, batch_log_line, failure_naming_its_cause, not_retried_when_interrupted
from cdc_assets.source import SourceError, StreamReport


def report_with_bounds(failures: int) -> StreamReport:
    return StreamReport(
        offset={}, changes=3, transactions=1, seconds=1.0, lag_bytes=0, lag_seconds=0.0,
        bounds={"max_changes": 8, "max_bytes": 1024, "shrunk": True, "failures": failures,
                "reason": "OutOfMemoryError: Java heap space", "next_max_changes": 16, "next_max_bytes": 2048},
    )  # fmt: skip


def test_a_shrunk_batch_after_failures_names_how_many_and_why() -> None:
    line = batch_log_line(report_with_bounds(failures=2))
    assert "a SMALLER batch than configured (at most 8 changes, 1024 bytes) after 2 failed batch(es): " in line
    assert "OutOfMemoryError: Java heap space; next batch at most 16 changes, 2048 bytes" in line


def test_a_shrunk_batch_growing_back_does_not_claim_zero_failures() -> None:
    """After a success the failures are counted from 0 while the bounds grow back by doubling: the line said "after
    0 failed batch(es): <the old error>", as if that error had just happened."""
    line = batch_log_line(report_with_bounds(failures=0))
    assert "failed batch(es)" not in line
    assert "growing back after earlier failed batches (the last: OutOfMemoryError: Java heap space)" in line


def test_a_batch_at_the_configured_bounds_says_nothing_of_them() -> None:
    report = report_with_bounds(failures=0)
    report.bounds["shrunk"] = False
    assert "SMALLER" not in batch_log_line(report)


def test_an_interrupted_step_fails_once_instead_of_being_retried() -> None:
    """Dagster's RetryPolicy retries a step that was interrupted; a stream step so restarted while ``dagster dev``
    shut down kept it from ending, and its runs stayed STARTED for good once it was killed."""
    attempts: list[int] = []

    @asset(retry_policy=RETRY)
    def interrupted_step() -> None:
        attempts.append(1)
        with not_retried_when_interrupted("the test's step"):
            raise DagsterExecutionInterruptedError()

    result = materialize([interrupted_step], raise_on_error=False)
    assert not result.success
    assert attempts == [1]
    assert not [e for e in result.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]
    failure = next(e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE)
    assert "the test's step was interrupted (its run was terminated or its process asked to stop); not retried" in (
        failure.step_failure_data.user_failure_data.description
    )


def test_a_step_out_of_retries_fails_naming_the_error_it_failed_with() -> None:
    """Dagster's own step failure once a RetryPolicy's retries are used up says "Exceeded max_retries of N" only;
    the step's last attempt fails with the error's type and message instead, and earlier attempts are retried."""
    attempts: list[int] = []

    @asset(retry_policy=RetryPolicy(max_retries=2))
    def failing_step(context) -> None:  # not annotated: Dagster reads it, and this module's annotations are strings
        attempts.append(context.retry_number)
        with failure_naming_its_cause("the test's step", context.retry_number, max_retries=2):
            raise SourceError("source 'x': cannot connect to postgresql://u@h:1/d: password authentication failed")

    result = materialize([failing_step], raise_on_error=False)
    assert not result.success
    assert attempts == [0, 1, 2]
    assert len([e for e in result.all_events if e.event_type == DagsterEventType.STEP_UP_FOR_RETRY]) == 2
    failure = next(e for e in result.all_events if e.event_type == DagsterEventType.STEP_FAILURE)
    shown = failure.step_failure_data.error.message
    assert "Exceeded max_retries" not in shown
    assert (
        "the test's step failed on attempt 3 of 3: SourceError: source 'x': cannot connect to postgresql://u@h:1/d: "
        "password authentication failed" in shown
    )

    recovered: list[int] = []

    @asset(retry_policy=RetryPolicy(max_retries=2))
    def recovering_step(context) -> None:
        recovered.append(context.retry_number)
        with failure_naming_its_cause("the test's step", context.retry_number, max_retries=2):
            if context.retry_number == 0:
                raise SourceError("refused once")

    assert materialize([recovering_step]).success
    assert recovered == [0, 1]
