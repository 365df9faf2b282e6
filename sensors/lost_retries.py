"""Failed runs whose automatic retry Dagster's daemon lost: each source's planner sensor gives them up.

Dagster's daemon retries a failed run (``run_retries`` in the instance's ``dagster.yaml``) when its retry consumer
reads the run's failure event; the run is tagged ``dagster/will_retry: true`` when it fails, and
``dagster/auto_retry_run_id`` once its retry is launched. The consumer can pass the event without launching one (a
race inside Dagster 1.13, dagster-io/dagster#33741; seen in the demo of 2026-12-06 on one of two backfill runs
killed by SIGKILL). Such a run stays "will retry" for good, and a backfill it belongs to stays in progress for good,
logging "retries have not been launched" every 30 s.

Contract: ``give_up_lost_retries(instance, source_name, now)`` finds the failed runs of the source's assets (a
selected asset or check key whose first part is the source's name) tagged ``dagster/will_retry: true`` that carry
no ``dagster/auto_retry_run_id``, have no run naming them as ``dagster/parent_run_id``, and ended at least
``LOST_RETRY_AFTER_SECONDS`` before ``now``; it tags each ``dagster/will_retry: false`` and writes an engine event
on the run saying why and what to do (re-execute it from failure), and returns their ids. A backfill then ends
instead of waiting (its failed chunks show as failed, to re-execute from failure); nothing is launched here, and a
run whose retry Dagster launched late (past the bound) is not touched once it has its child. Runs that failed more
than ``LOOK_BACK_SECONDS`` ago are not looked at.
"""

from __future__ import annotations

from datetime import UTC, datetime

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus, RunsFilter

WILL_RETRY_TAG = "dagster/will_retry"
AUTO_RETRY_RUN_ID_TAG = "dagster/auto_retry_run_id"
PARENT_RUN_ID_TAG = "dagster/parent_run_id"
# the daemon's retry consumer looks every 5 s: a failed run still without its retry after 10 minutes has lost it
LOST_RETRY_AFTER_SECONDS = 600
LOOK_BACK_SECONDS = 7 * 24 * 3600
LOST_RETRY_MESSAGE = (
    f"Dagster's daemon did not launch this run's automatic retry within {LOST_RETRY_AFTER_SECONDS} s of its failure "
    "(a race in its retry consumer; docs/known-limits.md): marked as not to be retried, so a backfill it belongs to "
    "ends instead of waiting for good. Re-execute it (or its backfill) from failure."
)


def of_source(run: DagsterRun, source_name: str) -> bool:
    """Whether the run selected one of the source's assets or asset checks (their keys begin with its name)."""
    keys = [*(run.asset_selection or ()), *(check.asset_key for check in run.asset_check_selection or ())]
    return any(key.path[0] == source_name for key in keys)


def lost_retries(instance: DagsterInstance, source_name: str, now: float) -> list[DagsterRun]:
    """The source's failed runs whose automatic retry was never launched (module Contract)."""
    failed = instance.get_run_records(
        RunsFilter(
            statuses=[DagsterRunStatus.FAILURE],
            tags={WILL_RETRY_TAG: "true"},
            updated_after=datetime.fromtimestamp(now - LOOK_BACK_SECONDS, UTC),
        ),
        limit=200,
    )
    lost = []
    for record in failed:
        run = record.dagster_run
        if AUTO_RETRY_RUN_ID_TAG in run.tags or not of_source(run, source_name):
            continue
        if record.end_time is None or now - record.end_time < LOST_RETRY_AFTER_SECONDS:
            continue
        if instance.get_run_records(RunsFilter(tags={PARENT_RUN_ID_TAG: run.run_id}), limit=1):
            continue  # a retry (or a re-execution by hand) exists: nothing was lost
        lost.append(run)
    return lost


def give_up_lost_retries(instance: DagsterInstance, source_name: str, now: float) -> list[str]:
    """Tag each of ``lost_retries`` ``dagster/will_retry: false`` with an engine event saying why; their ids."""
    given_up = []
    for run in lost_retries(instance, source_name, now):
        instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "false"})
        instance.report_engine_event(LOST_RETRY_MESSAGE, run)
        given_up.append(run.run_id)
    return given_up
