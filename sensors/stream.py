"""The streaming sensor of a source: launches one stream run at a time, only when there is work (a run then runs
batches for up to ``stream.run_seconds``, keeping its Spark session).

Work means: the slot holds a change for the publication, a staged chunk's high watermark is at or below the
server's flush LSN (its window can close), or the slot lags the server by more than ``max_lag_bytes`` (advance it
so the server can recycle WAL while the captured tables are idle and others are busy).
"""

from dagster import (
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from cdc_assets.assets import ACTIVE_RUN_STATUSES
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
        if source.startup_mode == "snapshot":
            return SkipReason("startup_mode is 'snapshot': no streaming")
        active = RunsFilter(job_name=job_name, statuses=ACTIVE_RUN_STATUSES)
        in_flight = context.instance.get_run_records(active, limit=1)
        if in_flight:
            return SkipReason(f"stream run {in_flight[0].dagster_run.run_id} is still in flight")
        reason = cdc.pipeline(source_name).pending_work()
        if reason is None:
            return SkipReason("nothing new")
        return RunRequest(tags={"cdc/reason": reason})

    return stream_sensor


def _running():
    from dagster import DefaultSensorStatus

    return DefaultSensorStatus.RUNNING
