"""The ``change_offset`` job (Debezium's change-offset signal, DDD-4), the same for every source kind.

Contract: the job hands the requested fields to the source's dialect, which validates them
(``cdc_assets.dialect.SourceDialect.validate_offset``; PostgreSQL: ``lsn`` in ``X/Y`` form, not behind the slot's
``confirmed_flush_lsn``, not ahead of the server's flush LSN) and returns the offset to record; the job runs in the
source's lake-write pool (so no batch runs at the same time) and records that offset as a materialization of the
stream asset with who and why. The next batch starts from it. Once recorded, the offset is acknowledged
(``CdcSource.acknowledge``, as the stream asset does after a batch): the source may forget what it covers
(PostgreSQL: the slot follows it now rather than at the next batch) and the lake's acknowledged position follows it,
backwards too (MongoDB may move back inside the oplog window; its ``pending`` then sees the events after it). Invalid
input fails with a message naming the field and the allowed values; nothing moves.
"""

from dagster import AssetMaterialization, Config, JobDefinition, OpExecutionContext, job, op

from cdc_assets.assets import MAX_RETRIES_TAG, change_offset_job_name, lake_pool, stream_asset_key
from cdc_assets.dialect import OffsetError

__all__ = ["ChangeOffsetConfig", "OffsetError", "build_change_offset_job"]


class ChangeOffsetConfig(Config):
    """The offset fields a source kind takes (give those of the source's kind only): PostgreSQL ``lsn``;
    MongoDB ``resume_token`` or ``timestamp``."""

    lsn: str | None = None
    resume_token: str | None = None
    timestamp: str | None = None
    changed_by: str
    reason: str


def requested_fields(config: ChangeOffsetConfig) -> dict[str, str]:
    fields = {"lsn": config.lsn, "resume_token": config.resume_token, "timestamp": config.timestamp}
    return {name: value for name, value in fields.items() if value is not None}


def build_change_offset_job(source_name: str) -> JobDefinition:
    @op(name=f"{source_name}_record_offset", required_resource_keys={"cdc"}, pool=lake_pool(source_name))
    def change_offset(context: OpExecutionContext, config: ChangeOffsetConfig) -> None:
        pipeline = context.resources.cdc.pipeline(source_name)
        offset = pipeline.validate_offset(requested_fields(config))
        context.log_event(
            AssetMaterialization(
                asset_key=stream_asset_key(source_name),
                metadata={**offset, "changed_by": config.changed_by, "reason": config.reason},
            )
        )
        pipeline.acknowledge(offset)  # recorded (the event is stored when logged): the source may forget up to it

    # never retried by Dagster's daemon (the instance's run_retries retry every run without this tag): an offset is
    # the operator's decision, and a refused one (OffsetError: the reason, the allowed values) is refused again
    @job(
        name=change_offset_job_name(source_name),
        description="Validate and record a new stream offset (DDD-4).",
        tags={MAX_RETRIES_TAG: "0"},
    )
    def change_offset_job() -> None:
        change_offset()

    return change_offset_job
