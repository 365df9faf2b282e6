"""The streaming sensor of a source: launches one stream run at a time, only when there is work (a run then runs
batches for up to ``stream.run_seconds``, keeping its Spark session).

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
"""

from dagster import (
    AssetCheckEvaluation,
    AssetObservation,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from cdc_assets.assets import ACTIVE_RUN_STATUSES, LAG_CHECK_NAME, lag_evaluation, lag_metadata, stream_asset_key
from resources.cdc import CdcResource


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
        active = RunsFilter(job_name=job_name, statuses=ACTIVE_RUN_STATUSES)
        if source.startup_mode == "snapshot":
            pipeline = cdc.pipeline(source_name)
            if not getattr(pipeline, "streams_only_for_windows", False):
                return SkipReason("startup_mode is 'snapshot': no streaming")
            if in_flight := context.instance.get_run_records(active, limit=1):
                return SkipReason(f"stream run {in_flight[0].dagster_run.run_id} is still in flight")
            reason = pipeline.pending_work()
            if reason is None:
                return SkipReason("startup_mode is 'snapshot': no streaming, and no staged chunk waits for the stream")
            tags = {"cdc/reason": f"startup_mode is 'snapshot': {reason} (the run streams no further)"}
            return SensorResult(run_requests=[RunRequest(tags=tags)])
        pipeline = cdc.pipeline(source_name)
        lag = pipeline.lag()
        key = stream_asset_key(source_name)
        events = [
            AssetObservation(asset_key=key, metadata=lag_metadata(lag)),
            AssetCheckEvaluation(asset_key=key, check_name=LAG_CHECK_NAME, **lag_evaluation(source, lag)),
        ]
        in_flight = context.instance.get_run_records(active, limit=1)
        if in_flight:
            skip = f"stream run {in_flight[0].dagster_run.run_id} is still in flight"
            return SensorResult(skip_reason=skip, asset_events=events)
        reason = pipeline.pending_work(lag)
        if reason is None:
            return SensorResult(skip_reason="nothing new", asset_events=events)
        return SensorResult(run_requests=[RunRequest(tags={"cdc/reason": reason})], asset_events=events)

    return stream_sensor


def _running():
    from dagster import DefaultSensorStatus

    return DefaultSensorStatus.RUNNING
