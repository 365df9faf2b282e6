"""Failed runs whose automatic retry Dagster's daemon lost: each source's planner sensor launches that retry itself.

Dagster's daemon retries a failed run (``run_retries`` in the instance's ``dagster.yaml``) when its retry consumer
reads the run's failure event; the run is tagged ``dagster/will_retry: true`` when it fails, and
``dagster/auto_retry_run_id`` once its retry is launched. The consumer can pass the event without launching one
(dagster-io/dagster#33741; seen in the demo of 2026-12-06): Dagster 1.13 stores the failure event first,
then marks the run failed, then tags it. A consumer pass between the first two writes finds the run not failed, does
not retry it, and moves its cursor past the event for good. Such a run stays "will retry" for good, its chunks stay
unread, and a backfill it belongs to stays in progress for good, logging "retries have not been launched" every 30 s.

Contract: ``settle_lost_retries(instance, source_name, table_keys, now)`` looks at the failed runs of the source's
assets (a selected asset or check key whose first part is the source's name) tagged ``dagster/will_retry: true``
that carry no ``dagster/auto_retry_run_id`` (runs that failed more than ``LOOK_BACK_SECONDS`` ago are not looked
at; all pages of them are read). Such a run's retry is lost once the consumer has passed its failure event: its
cursor, read before the runs are, is at or past the event (the consumer writes a retry's tag before it moves its
cursor, so a run read afterwards without one was not retried). On an instance whose consumer never ran (no cursor;
when it starts, it skips every earlier failure) a run's retry is lost once it ended ``LOST_RETRY_AFTER_SECONDS``
before ``now``. Of the runs whose retry is lost:

- a run with a run naming it as ``dagster/parent_run_id`` is not lost (a re-execution by hand, or Dagster's retry
  launched late), unless that run is the retry this module requested (tagged ``RETRY_OF_LOST_RUN_TAG``): then the
  failed run is tagged ``dagster/auto_retry_run_id`` with it, as Dagster tags a run it retried, and gets an engine
  event naming it. From then on a backfill counts the retry as the run's, as it counts Dagster's own;
- a lost run that selected only assets of the sensor's ``table_keys`` (checks of them too), whose backfill, if any,
  is still in progress, is requested again (``relaunch_request``): the same selection, partition and tags as the
  retry Dagster would have made (its backfill's tags, ``dagster/parent_run_id``, ``dagster/root_run_id``,
  ``dagster/retry_number``; its ``dagster/max_retries`` is what the run's group has left, so Dagster retries it in
  turn within the same budget), with run key ``lost-retry:<run id>``, so it is launched once whatever the number of
  evaluations;
- any other lost run (one whose backfill was canceled or deleted, one of another job) is given up: tagged
  ``dagster/will_retry: false`` with an engine event saying why and to re-execute it from failure; a backfill then
  ends with its chunks failed instead of waiting.

Nothing is written for a run requested again until its retry exists: a request the daemon did not launch is made
again at the next evaluation (the run key keeps it to one run).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunRecord,
    RunRequest,
    RunsFilter,
    RunStatusChangeRecordsFilter,
)
from dagster._core.execution.backfill import BulkActionStatus

from cdc_assets.assets import MAX_RETRIES_TAG

WILL_RETRY_TAG = "dagster/will_retry"
AUTO_RETRY_RUN_ID_TAG = "dagster/auto_retry_run_id"
PARENT_RUN_ID_TAG = "dagster/parent_run_id"
ROOT_RUN_ID_TAG = "dagster/root_run_id"
RETRY_NUMBER_TAG = "dagster/retry_number"
PARTITION_TAG = "dagster/partition"
BACKFILL_TAG = "dagster/backfill"
RETRY_OF_LOST_RUN_TAG = "cdc/retry_of_lost_run"
# tags of the failed run that describe it rather than its work (Dagster leaves the same out of a retry), or that the
# sensor daemon writes for the run it launches
NOT_CARRIED_TAGS = frozenset({
    WILL_RETRY_TAG, AUTO_RETRY_RUN_ID_TAG, PARENT_RUN_ID_TAG, ROOT_RUN_ID_TAG, RETRY_NUMBER_TAG, PARTITION_TAG,
    "dagster/failure_reason", "dagster/is_resume_retry", "dagster/is_asset_resume_retry", "dagster/run_metrics",
    "dagster/sensor_name", "dagster/run_key", "dagster/tick", "dagster/schedule_name",
})  # fmt: skip
# the key under which Dagster's retry consumer keeps its cursor over failure events, as Dagster 1.13 names it
# (written out, not imported from Dagster's private module: a rename there must not stop the definitions loading;
# tests/sensors/test_lost_retries.py checks it against Dagster's own)
RETRY_CONSUMER_CURSOR_KEY = f"EVENT_LOG_CONSUMER_CURSOR-{DagsterEventType.RUN_FAILURE.value}"
# on an instance whose retry consumer never ran: it looks every 5 s, so a failed run still without its retry after
# 10 minutes has lost it
LOST_RETRY_AFTER_SECONDS = 600
# a run's failure event is stamped by the process that reported it, its record's times by the storage: the events
# looked at begin this long before the earliest run was created, whatever the two clocks' difference
CLOCK_MARGIN_SECONDS = 3600
LOOK_BACK_SECONDS = 7 * 24 * 3600
PAGE_SIZE = 100
LOST_RETRY_MESSAGE = (
    "Dagster's daemon passed this run's failure without launching its automatic retry (a race in its retry "
    "consumer; docs/known-limits.md)"
)
GIVEN_UP_MESSAGE = (
    "Dagster's daemon passed this run's failure without launching its automatic retry, and the planner sensor cannot "
    "request it again (its backfill ended, or it ran assets the planner does not own): marked as not to be retried, "
    "so a backfill it belongs to ends instead of waiting for good. Re-execute it (or its backfill) from failure."
)
RELAUNCH_REASON = f"{LOST_RETRY_MESSAGE}: requested again by the planner sensor"


@dataclass
class LostRetries:
    """What one evaluation does about the source's lost retries (module Contract)."""

    requests: list[RunRequest] = field(default_factory=list)  # retries to launch
    linked: dict[str, str] = field(default_factory=dict)  # failed run id -> the retry launched for it
    given_up: list[str] = field(default_factory=list)  # failed run ids


def of_source(run: DagsterRun, source_name: str) -> bool:
    """Whether the run selected one of the source's assets or asset checks (their keys begin with its name)."""
    keys = [*(run.asset_selection or ()), *(check.asset_key for check in run.asset_check_selection or ())]
    return any(key.path[0] == source_name for key in keys)


def failed_runs_waiting_to_retry(instance: DagsterInstance, now: float) -> Iterator[RunRecord]:
    """The records of the failed runs of the last ``LOOK_BACK_SECONDS`` tagged ``dagster/will_retry: true`` that
    carry no launched retry, every page of them. The tags are read here, not filtered by the run storage: on
    Dagster's SQLite storage a tag filter made the query grow with the square of the runs it matched (7.2 s a tick
    for 5,000 failed runs Dagster had retried, against a linear listing by status; docs/known-limits.md)."""
    cursor = None
    while True:
        page = instance.get_run_records(
            RunsFilter(
                statuses=[DagsterRunStatus.FAILURE],
                updated_after=datetime.fromtimestamp(now - LOOK_BACK_SECONDS, UTC),
            ),
            limit=PAGE_SIZE,
            cursor=cursor,
        )
        yield from (
            record
            for record in page
            if record.dagster_run.tags.get(WILL_RETRY_TAG) == "true"
            and AUTO_RETRY_RUN_ID_TAG not in record.dagster_run.tags
        )
        if len(page) < PAGE_SIZE:
            return
        cursor = page[-1].dagster_run.run_id


def retry_consumer_cursor(instance: DagsterInstance) -> int | None:
    """The storage id up to which Dagster's retry consumer has read failure events (None: it never ran here)."""
    raw = instance.daemon_cursor_storage.get_cursor_values({RETRY_CONSUMER_CURSOR_KEY}).get(RETRY_CONSUMER_CURSOR_KEY)
    return None if raw is None else int(raw)


def failures_read_by_retry_consumer(instance: DagsterInstance, consumer_cursor: int, since: float) -> set[str]:
    """The ids of the runs whose failure event, stored after ``since``, is at or before ``consumer_cursor``: the
    failures Dagster's retry consumer has passed, every page of them."""
    passed: set[str] = set()
    cursor = None
    while True:
        result = instance.fetch_run_status_changes(
            RunStatusChangeRecordsFilter(
                DagsterEventType.RUN_FAILURE, after_timestamp=since, before_storage_id=consumer_cursor + 1
            ),
            limit=PAGE_SIZE,
            cursor=cursor,
            ascending=True,
        )
        passed.update(record.run_id for record in result.records)
        if not result.has_more:
            return passed
        cursor = result.cursor


def lost_retries(instance: DagsterInstance, source_name: str, now: float) -> list[tuple[DagsterRun, DagsterRun | None]]:
    """The source's failed runs whose automatic retry Dagster will never launch, each with the retry this module
    requested for it when one exists (module Contract)."""
    consumer_cursor = retry_consumer_cursor(instance)  # before the runs: a retry's tag is written before it moves
    waiting = [
        record for record in failed_runs_waiting_to_retry(instance, now) if of_source(record.dagster_run, source_name)
    ]
    if not waiting:
        return []
    if consumer_cursor is None:
        passed = {
            record.dagster_run.run_id
            for record in waiting
            if record.end_time is not None and now - record.end_time >= LOST_RETRY_AFTER_SECONDS
        }
    else:
        since = min(record.create_timestamp.timestamp() for record in waiting) - CLOCK_MARGIN_SECONDS
        passed = failures_read_by_retry_consumer(instance, consumer_cursor, since)
    lost = []
    for record in waiting:
        run = record.dagster_run
        if run.run_id not in passed:
            continue
        children = instance.get_runs(RunsFilter(tags={PARENT_RUN_ID_TAG: run.run_id}), limit=10)
        ours = next((child for child in children if child.tags.get(RETRY_OF_LOST_RUN_TAG) == run.run_id), None)
        if children and ours is None:
            continue  # a retry (or a re-execution by hand) exists: nothing was lost
        lost.append((run, ours))
    return lost


def relaunchable(instance: DagsterInstance, run: DagsterRun, table_keys: Collection[AssetKey]) -> bool:
    """Whether the planner sensor (whose assets are ``table_keys``) can request ``run``'s work again: it selected
    only those assets (and checks of them), and its backfill, if any, is still in progress."""
    assets = set(run.asset_selection or ())
    checks = {check.asset_key for check in run.asset_check_selection or ()}
    if not assets or not (assets | checks) <= set(table_keys):
        return False
    backfill_id = run.tags.get(BACKFILL_TAG)
    if backfill_id is None:
        return True
    backfill = instance.get_backfill(backfill_id)
    return backfill is not None and backfill.status == BulkActionStatus.REQUESTED


def relaunch_request(run: DagsterRun, retry_number: int, retries_left: int) -> RunRequest:
    """The retry Dagster would have launched for ``run``, as a sensor's request: its selection, partition (key or
    range tags) and tags (its backfill's included), tagged as the ``retry_number``-th run of ``run``'s group. A
    sensor cannot make a run a member of another's group (Dagster counts retries by group), so it carries
    ``dagster/max_retries: retries_left`` (the group's budget less the retries made) and lineage tags only."""
    tags = {key: value for key, value in run.tags.items() if key not in NOT_CARRIED_TAGS and not key.startswith(".")}
    tags |= {
        PARENT_RUN_ID_TAG: run.run_id,
        ROOT_RUN_ID_TAG: run.root_run_id or run.run_id,
        RETRY_NUMBER_TAG: str(retry_number),
        MAX_RETRIES_TAG: str(retries_left),
        RETRY_OF_LOST_RUN_TAG: run.run_id,
    }
    return RunRequest(
        run_key=f"lost-retry:{run.run_id}",
        asset_selection=sorted(run.asset_selection or (), key=lambda key: key.to_user_string()),
        asset_check_keys=sorted(run.asset_check_selection or (), key=lambda check: check.to_user_string()),
        partition_key=run.tags.get(PARTITION_TAG),
        tags=tags,
    )


def settle_lost_retries(
    instance: DagsterInstance, source_name: str, table_keys: Collection[AssetKey], now: float
) -> LostRetries:
    """Request, link or give up the source's lost retries (module Contract); tags and engine events are written
    here, the requests are the caller's to return."""
    settled = LostRetries()
    for run, retry in lost_retries(instance, source_name, now):
        if retry is not None:
            instance.add_run_tags(run.run_id, {AUTO_RETRY_RUN_ID_TAG: retry.run_id})
            instance.report_engine_event(f"{RELAUNCH_REASON} as run {retry.run_id}", run)
            settled.linked[run.run_id] = retry.run_id
        elif relaunchable(instance, run, table_keys):
            group = instance.get_run_group(run.run_id)  # the run, and its group's runs (Dagster's retry count)
            made = len(group[1]) if group else 1
            budget = int(run.tags.get(MAX_RETRIES_TAG, instance.run_retries_max_retries))
            settled.requests.append(relaunch_request(run, made, max(budget - made, 0)))
        else:
            instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "false"})
            instance.report_engine_event(GIVEN_UP_MESSAGE, run)
            settled.given_up.append(run.run_id)
    return settled
