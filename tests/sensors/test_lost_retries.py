"""``sensors.lost_retries`` on a real Dagster instance: a failed run tagged ``dagster/will_retry: true`` whose retry
was never launched is requested again as the retry Dagster would have made, linked to that retry once it exists, or
given up when its backfill ended; a run that was retried, re-executed, still waiting for Dagster's retry consumer or
of another source is left alone. The race that loses a retry is caused at will in the first test (Dagster's own
retry consumer run between the two writes of a run's failure); the others make the lost run the way the demo of
2026-12-06 left one (failed, tagged, no retry) on an instance whose consumer never ran, where the wait
``LOST_RETRY_AFTER_SECONDS`` decides."""

from __future__ import annotations

import time
import uuid

import pytest
from dagster import (
    AssetCheckKey,
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunRequest,
)
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.test_utils import create_test_daemon_workspace_context, instance_for_test
from dagster._core.workspace.load_target import EmptyWorkspaceTarget
from dagster._daemon.auto_run_reexecution.event_log_consumer import EventLogConsumerDaemon, _create_cursor_key

import sensors.lost_retries as lost_retries_module
from sensors.lost_retries import (
    AUTO_RETRY_RUN_ID_TAG,
    BACKFILL_TAG,
    LOST_RETRY_AFTER_SECONDS,
    PARENT_RUN_ID_TAG,
    RETRY_CONSUMER_CURSOR_KEY,
    RETRY_NUMBER_TAG,
    RETRY_OF_LOST_RUN_TAG,
    ROOT_RUN_ID_TAG,
    WILL_RETRY_TAG,
    settle_lost_retries,
)

ORDERS = AssetKey(["demo", "public", "orders"])
TABLES = [ORDERS, AssetKey(["demo", "public", "customers"])]
RANGE = {"dagster/asset_partition_range_start": "chunk-00000", "dagster/asset_partition_range_end": "chunk-00003"}


def failed_run(
    instance: DagsterInstance, asset: AssetKey = ORDERS, checks: frozenset[AssetCheckKey] | None = None, **tags: str
) -> DagsterRun:
    """A run of ``asset`` that failed and that Dagster said it will retry (and never did)."""
    run = DagsterRun(
        job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), asset_selection=frozenset({asset}),
        asset_check_selection=checks, tags={"dagster/max_retries": "3", ".dagster/repository": "x", **tags},
    )  # fmt: skip
    instance.add_run(run)
    instance.report_run_failed(instance.get_run_by_id(run.run_id))
    instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "true", "dagster/failure_reason": "RUN_EXCEPTION"})
    return instance.get_run_by_id(run.run_id)


def add_backfill(instance: DagsterInstance, status: BulkActionStatus) -> str:
    backfill_id = uuid.uuid4().hex[:8]
    instance.add_backfill(
        PartitionBackfill(backfill_id=backfill_id, status=status, from_failure=False, tags={},
                          backfill_timestamp=time.time(), asset_selection=[ORDERS])
    )  # fmt: skip
    return backfill_id


def launch(instance: DagsterInstance, request: RunRequest) -> DagsterRun:
    """The run the sensor daemon makes of ``request`` (its tags, the partition's tag, the run key's tag)."""
    tags = {**request.tags, "dagster/run_key": request.run_key or ""}
    if request.partition_key is not None:
        tags["dagster/partition"] = request.partition_key
    run = DagsterRun(
        job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), asset_selection=frozenset(request.asset_selection or ()),
        tags=tags,
    )  # fmt: skip
    instance.add_run(run)
    return run


def messages(instance: DagsterInstance, run_id: str) -> list[str]:
    return [e.message or "" for e in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT)]


def test_a_retry_lost_in_dagsters_race_is_requested_at_the_next_tick_and_one_still_waiting_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loss, caused: Dagster stores a run's failure event, then marks the run failed, then tags it "will retry".
    Its retry consumer (a thread of the same daemon), run between the first two writes, reads the event, finds the
    run not failed, and moves its cursor past the event for good: the run ends "will retry" with no retry. The
    planner sees the consumer's cursor past the failure and requests the retry at once; a failure the consumer has
    not read yet is its to retry, however long ago the run failed."""
    settings = {"run_retries": {"enabled": True, "max_retries": 3}}
    with (
        instance_for_test(overrides=settings) as instance,
        create_test_daemon_workspace_context(EmptyWorkspaceTarget(), instance) as workspace,
    ):
        consumer = EventLogConsumerDaemon()

        def consume() -> None:
            list(consumer.run_iteration(workspace))

        consume()  # its first pass puts its cursor at the end of the log
        assert RETRY_CONSUMER_CURSOR_KEY == _create_cursor_key(DagsterEventType.RUN_FAILURE)  # the key it keeps it in
        assert instance.daemon_cursor_storage.get_cursor_values({RETRY_CONSUMER_CURSOR_KEY})
        monkeypatch.setattr(lost_retries_module, "PAGE_SIZE", 2)  # the failures the consumer read, over pages
        for _ in range(3):
            failed_run(instance, asset=AssetKey(["shop", "public", "orders"]))
        consume()
        run = DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), asset_selection=frozenset({ORDERS}),
                         status=DagsterRunStatus.STARTED)  # fmt: skip
        instance.add_run(run)
        mark_run = instance.run_storage.handle_run_event

        def consumer_between_the_event_and_the_run(run_id: str, event, *args, **kwargs) -> None:
            if event.event_type == DagsterEventType.RUN_FAILURE:
                consume()
            mark_run(run_id, event, *args, **kwargs)

        with monkeypatch.context() as race:
            race.setattr(instance.run_storage, "handle_run_event", consumer_between_the_event_and_the_run)
            instance.report_run_failed(run)
        consume()  # later passes do not come back to it
        lost = instance.get_run_by_id(run.run_id)
        assert lost.status == DagsterRunStatus.FAILURE and lost.tags[WILL_RETRY_TAG] == "true", lost.tags
        assert AUTO_RETRY_RUN_ID_TAG not in lost.tags and lost.is_complete_and_waiting_to_retry  # Dagster lost it

        waiting = failed_run(instance)  # failed the ordinary way: its event is after the consumer's cursor
        ended = instance.get_run_record_by_id(waiting.run_id).end_time
        settled = settle_lost_retries(instance, "demo", TABLES, ended + LOST_RETRY_AFTER_SECONDS + 5)
        assert [request.tags[RETRY_OF_LOST_RUN_TAG] for request in settled.requests] == [run.run_id]
        assert settle_lost_retries(instance, "demo", TABLES, time.time()).requests == settled.requests


def test_a_lost_retry_is_requested_as_dagsters_would_be_then_linked_to_the_run_launched_for_it() -> None:
    with DagsterInstance.ephemeral() as instance:
        backfill_id = add_backfill(instance, BulkActionStatus.REQUESTED)
        check = AssetCheckKey(ORDERS, "chunk_matches_source")
        in_backfill = failed_run(
            instance, checks=frozenset({check}), **{BACKFILL_TAG: backfill_id, "dagster/partition": "chunk-00002"}
        )
        planned = failed_run(instance, **RANGE, **{"cdc/reason": "initial snapshot"})
        ended = instance.get_run_record_by_id(planned.run_id).end_time
        assert settle_lost_retries(instance, "demo", TABLES, ended + LOST_RETRY_AFTER_SECONDS - 5).requests == []

        later = ended + LOST_RETRY_AFTER_SECONDS + 5
        settled = settle_lost_retries(instance, "demo", TABLES, later)
        assert settled.given_up == [] and settled.linked == {}
        requests = {request.tags[RETRY_OF_LOST_RUN_TAG]: request for request in settled.requests}
        assert set(requests) == {in_backfill.run_id, planned.run_id}

        again = requests[in_backfill.run_id]
        assert again.run_key == f"lost-retry:{in_backfill.run_id}"
        assert again.asset_selection == [ORDERS] and again.asset_check_keys == [check]
        assert again.partition_key == "chunk-00002" and "dagster/partition" not in again.tags
        assert again.tags[BACKFILL_TAG] == backfill_id  # counted in its backfill, as Dagster's own retry is
        assert again.tags[PARENT_RUN_ID_TAG] == in_backfill.run_id == again.tags[ROOT_RUN_ID_TAG]
        assert again.tags[RETRY_NUMBER_TAG] == "1" and again.tags["dagster/max_retries"] == "2"  # of 3
        for outcome in (WILL_RETRY_TAG, "dagster/failure_reason", ".dagster/repository"):
            assert outcome not in again.tags, outcome
        range_again = requests[planned.run_id]
        assert range_again.partition_key is None and BACKFILL_TAG not in range_again.tags
        assert {k: range_again.tags[k] for k in RANGE} == RANGE and range_again.tags["cdc/reason"] == "initial snapshot"

        # nothing is written before the retry exists: a request the daemon did not launch is made again
        assert instance.get_run_by_id(in_backfill.run_id).tags[WILL_RETRY_TAG] == "true"
        repeated = settle_lost_retries(instance, "demo", TABLES, later)
        assert sorted(r.run_key for r in repeated.requests) == sorted(r.run_key for r in settled.requests)

        retry = launch(instance, again)
        linked = settle_lost_retries(instance, "demo", TABLES, later)
        assert linked.linked == {in_backfill.run_id: retry.run_id}
        assert [r.tags[RETRY_OF_LOST_RUN_TAG] for r in linked.requests] == [planned.run_id]
        tagged = instance.get_run_by_id(in_backfill.run_id)
        assert tagged.tags[AUTO_RETRY_RUN_ID_TAG] == retry.run_id
        assert not tagged.is_complete_and_waiting_to_retry  # what its backfill waits on
        assert any(retry.run_id in m and "requested again" in m for m in messages(instance, in_backfill.run_id))

        # the retry fails and is lost too. The sensor's run heads a group of its own for Dagster (a sensor cannot
        # set a run's parent): requested again as that group's first retry, with the one retry of 3 left
        instance.report_run_failed(retry)
        instance.add_run_tags(retry.run_id, {WILL_RETRY_TAG: "true"})
        second = settle_lost_retries(instance, "demo", TABLES, time.time() + LOST_RETRY_AFTER_SECONDS + 5)
        of_retry = next(r for r in second.requests if r.tags[RETRY_OF_LOST_RUN_TAG] == retry.run_id)
        assert of_retry.tags[ROOT_RUN_ID_TAG] == retry.run_id and of_retry.tags[RETRY_NUMBER_TAG] == "1"
        assert of_retry.tags["dagster/max_retries"] == "1" and of_retry.tags[BACKFILL_TAG] == backfill_id


def test_a_lost_retry_that_cannot_be_requested_again_is_given_up_and_says_why() -> None:
    with DagsterInstance.ephemeral() as instance:
        canceled = failed_run(instance, **{BACKFILL_TAG: add_backfill(instance, BulkActionStatus.CANCELED)})
        deleted = failed_run(instance, **{BACKFILL_TAG: "no-such-backfill"})
        not_planned = failed_run(instance, asset=AssetKey(["demo", "public", "dropped"]))
        later = instance.get_run_record_by_id(not_planned.run_id).end_time + LOST_RETRY_AFTER_SECONDS + 5

        settled = settle_lost_retries(instance, "demo", TABLES, later)
        assert settled.requests == [] and settled.linked == {}
        assert sorted(settled.given_up) == sorted([canceled.run_id, deleted.run_id, not_planned.run_id])
        for run_id in settled.given_up:
            assert instance.get_run_by_id(run_id).tags[WILL_RETRY_TAG] == "false"
            assert any("from failure" in m for m in messages(instance, run_id)), run_id
        assert settle_lost_retries(instance, "demo", TABLES, later).given_up == []  # once


def test_retried_reexecuted_recent_and_other_sources_runs_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lost_retries_module, "PAGE_SIZE", 2)  # the lost run is on the last of several pages
    with DagsterInstance.ephemeral() as instance:
        retried = failed_run(instance, **{AUTO_RETRY_RUN_ID_TAG: "some-run"})
        reexecuted = failed_run(instance)
        instance.add_run(
            DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), tags={PARENT_RUN_ID_TAG: reexecuted.run_id})
        )
        others = [failed_run(instance, asset=AssetKey(["shop", "public", "orders"])) for _ in range(4)]
        used_up = failed_run(instance)
        instance.add_run_tags(used_up.run_id, {WILL_RETRY_TAG: "false"})  # its group's retries were all made
        untagged = DagsterRun(
            job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), asset_selection=frozenset({ORDERS}),
            status=DagsterRunStatus.FAILURE,
        )  # fmt: skip
        instance.add_run(untagged)  # failed on an instance that does not retry runs
        lost = failed_run(instance)
        later = instance.get_run_record_by_id(lost.run_id).end_time + LOST_RETRY_AFTER_SECONDS + 0.5
        time.sleep(1)
        recent = failed_run(instance)  # ended less than LOST_RETRY_AFTER_SECONDS before ``later``

        settled = settle_lost_retries(instance, "demo", TABLES, later)
        assert [r.tags[RETRY_OF_LOST_RUN_TAG] for r in settled.requests] == [lost.run_id]
        assert settled.given_up == [] and settled.linked == {}
        for untouched in (retried, reexecuted, recent, *others):
            assert instance.get_run_by_id(untouched.run_id).tags[WILL_RETRY_TAG] == "true", untouched.run_id
            assert messages(instance, untouched.run_id) == [], untouched.run_id
        assert instance.get_run_by_id(used_up.run_id).tags[WILL_RETRY_TAG] == "false"
        assert WILL_RETRY_TAG not in instance.get_run_by_id(untagged.run_id).tags
        assert messages(instance, used_up.run_id) == messages(instance, untagged.run_id) == []
