"""The streaming sensor of a source: launches one micro-batch run at a time, only when there is work.

Work means: the slot holds a change for the publication, a staged chunk's high watermark is at or below the
server's flush LSN (its window can close), or the slot lags the server by more than ``max_lag_bytes`` (advance it
so the server can recycle WAL while the captured tables are idle and others are busy).
"""


from dagster import (
    DagsterRunStatus,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from cdc_assets.lake.layout import SourceLake
from cdc_assets.postgres import stream
from cdc_assets.postgres.connection import connect
from resources.cdc import CdcResource

ACTIVE = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]


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
        in_flight = context.instance.get_run_records(RunsFilter(job_name=job_name, statuses=ACTIVE), limit=1)
        if in_flight:
            return SkipReason(f"batch run {in_flight[0].dagster_run.run_id} is still in flight")
        with connect(source.connection, source.name) as conn:
            flush = stream.current_flush_lsn(conn)
            confirmed, _ = stream.slot_position(conn, source.slot)
            pending = stream.has_pending_changes(conn, source.slot, source.publication)
        reason = None
        if pending:
            reason = "changes waiting in the slot"
        elif flush - confirmed > source.stream.max_lag_bytes:
            reason = f"slot lags the server by {flush - confirmed} bytes"
        else:
            waiting = _waiting_windows(cdc, source_name)
            if any(hw <= flush for hw in waiting):
                reason = "a chunk window can close"
        if reason is None:
            return SkipReason("nothing new")
        return RunRequest(tags={"cdc/reason": reason})

    return stream_sensor


def _waiting_windows(cdc: CdcResource, source_name: str) -> list[int]:
    """High watermarks of staged chunks (a Spark session is too heavy for a sensor tick: see ``waiting_markers``)."""
    return list(SourceLake(cdc.config.lake_root, source_name).waiting_markers().values())


def _running():
    from dagster import DefaultSensorStatus

    return DefaultSensorStatus.RUNNING
