"""The streaming sensor of a source: launches a stream run when there is work and none is in flight (a run then
runs batches for up to ``stream.run_seconds``, keeping its Spark session), and its successor
``stream.handoff_lead_seconds`` before the run in flight ends (``successor_reason``): the successor starts and warms
its driver outside the lake-write pool, and the run in flight ends after its batch once the successor is warm
(``cdc_assets.assets``), so the next batch does not wait for a driver start and a cold JVM. Never more than two.

Work means: the slot holds a change for the publication, a staged chunk's high watermark is at or below the
server's flush LSN (its window can close), or the slot lags the server by more than ``max_lag_bytes`` (advance it
so the server can recycle WAL while the captured tables are idle and others are busy).

On every tick, whether a run is in flight, has failed or is not needed, it records the slot's lag (bytes and
seconds, ``CdcSource.lag``) as an observation of the stream asset (the UI plots it) and an evaluation of the stream
asset's ``lag_within_bound`` check (failed past ``stream.max_lag_alert_bytes`` / ``_seconds``), so a stalled stream
shows in the UI even while every run fails.

``startup_mode: snapshot``: no streaming. Where the source bounds its batches (``streams_only_for_windows``:
MongoDB) a run is requested only when a staged chunk window can close or a check waits, and that run's batches read
no change past the highest waiting high watermark; otherwise (PostgreSQL) no run is requested at all. No lag is
recorded in this mode.

The source is asked with a deadline (``stream.sensor_timeout_seconds``, below Dagster's 60-second limit of a tick):
a source that has not answered by then (a saturated or hung server; the MongoDB test server reading a long backlog
of events to find its current position) gets a failed lag check saying so, and a run is requested when none is in
flight (the run reads the stream itself, and fails naming the cause if the source is down). The unanswered read goes
on in the sensor's process and is dropped; what it learnt (the MongoDB test server's newest event) stays for the next
tick.

Each run it requests carries Dagster's ``dagster/max_runtime`` tag (``stream_run_tags``): a run whose code server
died with it is ended by the run monitor once it is ``stream.max_overrun_seconds`` past ``run_seconds``, instead of
holding the source's stream for good. And ``dagster/priority`` 1 (``STREAM_PRIORITY``): stream runs share the
instance's run slots (``max_concurrent_runs``) with snapshot and check runs, and a stream run waiting in the queue
takes the next free slot before them (default priority 0; the sweep's -1); it does not stop a running one.
"""

import time

from dagster import (
    AssetCheckEvaluation,
    AssetObservation,
    DagsterRun,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from cdc_assets.assets import (
    ACTIVE_RUN_STATUSES,
    ENDS_AT_TAG,
    LAG_CHECK_NAME,
    MAX_RETRIES_TAG,
    MAX_RUNTIME_TAG,
    lag_evaluation,
    lag_metadata,
    stream_asset_key,
    unanswered_evaluation,
)
from cdc_assets.config import StreamConfig
from cdc_assets.deadline import NoAnswer, within
from cdc_assets.source import SourceLag
from resources.cdc import CdcResource

PRIORITY_TAG = "dagster/priority"  # read by Dagster's queued run coordinator: higher values leave the queue first
# in the demo (2026-12-05) a stream run waited 134 s in the queue behind two check runs launched by hand, and a slot
# freed meanwhile went to a check run queued before it
STREAM_PRIORITY = "1"


def build_stream_sensor(source_name: str, job_name: str, interval_seconds: int) -> SensorDefinition:
    @sensor(
        name=f"{source_name}_stream_sensor",
        job_name=job_name,
        minimum_interval_seconds=interval_seconds,
        default_status=_running(),
        required_resource_keys={"cdc"},
    )
    def stream_sensor(context: SensorEvaluationContext):
        cdc: CdcResource = context.resources.cdc
        source = cdc.config.source(source_name)
        timeout = source.stream.sensor_timeout_seconds
        active = RunsFilter(job_name=job_name, statuses=ACTIVE_RUN_STATUSES)
        if source.startup_mode == "snapshot":
            pipeline = cdc.pipeline(source_name)
            if not getattr(pipeline, "streams_only_for_windows", False):
                return SkipReason("startup_mode is 'snapshot': no streaming")
            if in_flight := context.instance.get_run_records(active, limit=1):
                return SkipReason(f"stream run {in_flight[0].dagster_run.run_id} is still in flight")
            try:
                reason = within(timeout, f"source {source_name!r}", pipeline.pending_work)
            except NoAnswer as silent:
                return SkipReason(f"startup_mode is 'snapshot': {silent} (stream.sensor_timeout_seconds)")
            if reason is None:
                return SkipReason("startup_mode is 'snapshot': no streaming, and no staged chunk waits for the stream")
            tags = stream_run_tags(source.stream, f"startup_mode is 'snapshot': {reason} (the run streams no further)")
            return SensorResult(run_requests=[RunRequest(tags=tags)])
        pipeline = cdc.pipeline(source_name)
        key = stream_asset_key(source_name)

        def lag_and_work() -> tuple[SourceLag, str | None]:
            lag = pipeline.lag()
            return lag, pipeline.pending_work(lag)

        try:
            lag, reason = within(timeout, f"source {source_name!r}", lag_and_work)
        except NoAnswer as silent:
            lag, reason = None, f"{silent} (stream.sensor_timeout_seconds): a stream run reads the stream itself"
            events = [AssetCheckEvaluation(asset_key=key, check_name=LAG_CHECK_NAME, **unanswered_evaluation(source))]
        else:
            events = [
                AssetObservation(asset_key=key, metadata=lag_metadata(lag)),
                AssetCheckEvaluation(asset_key=key, check_name=LAG_CHECK_NAME, **lag_evaluation(source, lag)),
            ]
        in_flight = [record.dagster_run for record in context.instance.get_run_records(active, limit=2)]
        if in_flight:
            handoff = successor_reason(in_flight, source.stream.handoff_lead_seconds, time.time())
            if handoff is None or reason is None:
                skip = f"stream run {in_flight[0].run_id} is still in flight"
                return SensorResult(skip_reason=skip, asset_events=events)
            reason = f"{handoff}; {reason}"
        elif reason is None:
            return SensorResult(skip_reason="nothing new", asset_events=events)
        return SensorResult(run_requests=[RunRequest(tags=stream_run_tags(source.stream, reason))], asset_events=events)

    return stream_sensor


def successor_reason(in_flight: list[DagsterRun], lead_seconds: int, now: float) -> str | None:
    """Why a successor is requested now, or None: one stream run in flight, streaming (it tagged when its batches end,
    ``ENDS_AT_TAG``), and within ``lead_seconds`` before that end. Not past the end: that run is in its last batch and
    ends soon, or it was lost with its code server and holds the pool until the run monitor ends it (up to
    ``max_overrun_seconds``), longer than a successor should wait; the next tick after it ends requests a run as
    before. Never a third run, nor a successor with ``lead_seconds`` 0."""
    if len(in_flight) != 1 or not lead_seconds:
        return None
    (run,) = in_flight
    ends_at = run.tags.get(ENDS_AT_TAG)
    if ends_at is None or not float(ends_at) - lead_seconds <= now <= float(ends_at):
        return None
    return f"successor of stream run {run.run_id}, whose batches end in {round(float(ends_at) - now)} s"


def stream_run_tags(stream: StreamConfig, reason: str) -> dict[str, str]:
    """A stream run's tags: why it was requested (``cdc/reason``), its queue priority (``dagster/priority``,
    ``STREAM_PRIORITY``, above snapshot and check runs), and ``stream_job_tags``."""
    return {"cdc/reason": reason, PRIORITY_TAG: STREAM_PRIORITY, **stream_job_tags(stream)}


def stream_job_tags(stream: StreamConfig) -> dict[str, str]:
    """The tags of every run of a source's stream job (the sensor's, and one launched by hand): its bound in flight
    (``dagster/max_runtime``: ``stream.handoff_lead_seconds`` + ``stream.run_seconds`` +
    ``stream.max_overrun_seconds``; ``0``, no bound, when ``max_overrun_seconds`` is 0), past which Dagster's run
    monitor cancels it and marks it failed, also when no process is left to report it (its code server lost with it),
    so this sensor's "still in flight" ends and the next tick launches a run that goes on from the recorded offset; and
    no automatic retry (``dagster/max_retries`` 0): the sensor requests the next run itself, from the recorded offset,
    and a retry beside it would be one more run waiting for the source's pool. Both are written out, 0 included:
    the instance's defaults (``run_monitoring.max_runtime_seconds``, ``run_retries.max_retries`` in dagster.yaml)
    bound and retry every run that carries no such tag, a backfill's from the UI among them."""
    return {MAX_RUNTIME_TAG: str(stream.max_runtime_seconds or 0), MAX_RETRIES_TAG: "0"}


def _running():
    from dagster import DefaultSensorStatus

    return DefaultSensorStatus.RUNNING
