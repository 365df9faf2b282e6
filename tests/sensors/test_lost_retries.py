"""``sensors.lost_retries`` on a real (ephemeral) Dagster instance: a failed run tagged ``dagster/will_retry: true``
whose retry was never launched is given up after ``LOST_RETRY_AFTER_SECONDS``; a run that was retried, re-executed,
failed too recently or belongs to another source is left alone. The race that loses a retry cannot be caused at
will, so the lost run is made the way the demo of 2026-12-06 left one: failed, tagged, and no retry launched."""

from __future__ import annotations

import uuid

from dagster import AssetKey, DagsterEventType, DagsterInstance, DagsterRun

from sensors.lost_retries import (
    AUTO_RETRY_RUN_ID_TAG,
    LOST_RETRY_AFTER_SECONDS,
    PARENT_RUN_ID_TAG,
    WILL_RETRY_TAG,
    give_up_lost_retries,
    lost_retries,
)


def failed_run(instance: DagsterInstance, source: str, **tags: str) -> DagsterRun:
    """A backfill's run of ``source``'s ``public.orders`` that failed and that Dagster said it will retry."""
    run = DagsterRun(
        job_name="__ASSET_JOB", run_id=str(uuid.uuid4()),
        asset_selection=frozenset({AssetKey([source, "public", "orders"])}), tags={"dagster/backfill": "b1", **tags},
    )  # fmt: skip
    instance.add_run(run)
    instance.report_run_failed(instance.get_run_by_id(run.run_id))
    instance.add_run_tags(run.run_id, {WILL_RETRY_TAG: "true"})
    return instance.get_run_by_id(run.run_id)


def test_a_failed_run_whose_retry_never_came_is_given_up_and_says_why() -> None:
    with DagsterInstance.ephemeral() as instance:
        lost = failed_run(instance, "demo")
        retried = failed_run(instance, "demo", **{AUTO_RETRY_RUN_ID_TAG: "some-run"})
        reexecuted = failed_run(instance, "demo")
        instance.add_run(
            DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), tags={PARENT_RUN_ID_TAG: reexecuted.run_id})
        )
        other_source = failed_run(instance, "shop")
        ended = instance.get_run_record_by_id(lost.run_id).end_time

        assert lost_retries(instance, "demo", ended + LOST_RETRY_AFTER_SECONDS - 5) == []  # still in Dagster's hands
        later = ended + LOST_RETRY_AFTER_SECONDS + 5
        assert give_up_lost_retries(instance, "demo", later) == [lost.run_id]

        assert instance.get_run_by_id(lost.run_id).tags[WILL_RETRY_TAG] == "false"
        events = instance.all_logs(lost.run_id, of_type=DagsterEventType.ENGINE_EVENT)
        assert any("did not launch this run's automatic retry" in (e.message or "") for e in events), events
        assert any("from failure" in (e.message or "") for e in events)
        for untouched in (retried, reexecuted, other_source):
            assert instance.get_run_by_id(untouched.run_id).tags[WILL_RETRY_TAG] == "true", untouched.run_id
        assert give_up_lost_retries(instance, "demo", later) == []  # once
        assert give_up_lost_retries(instance, "shop", later) == [other_source.run_id]
