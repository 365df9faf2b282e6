"""The ``change_offset`` job (Debezium's change-offset signal, DDD-4) for a PostgreSQL source.

Contract: the job validates the requested offset for the connector (``lsn`` required, PostgreSQL ``X/Y`` form, not
behind the slot's ``confirmed_flush_lsn``, not ahead of the server's flush LSN), runs in the source's lake-write
pool (so no batch runs at the same time), and records the new offset as a materialization of the stream asset
with who and why. The next batch advances the slot to it. Invalid input fails with a message naming the field and
the allowed range; nothing moves.
"""

from dagster import AssetMaterialization, Config, JobDefinition, OpExecutionContext, job, op

from cdc_assets.assets import change_offset_job_name, lake_pool, stream_asset_key
from cdc_assets.engine.lsn import format_lsn, parse_lsn
from cdc_assets.sources.postgres import stream
from cdc_assets.sources.postgres.connection import connect


class ChangeOffsetConfig(Config):
    lsn: str
    changed_by: str
    reason: str


class OffsetError(ValueError):
    """A requested offset that the connector cannot take."""


def validate_postgres_offset(requested: str, confirmed_flush: int, server_flush: int) -> int:
    try:
        lsn = parse_lsn(requested)
    except ValueError as error:
        raise OffsetError(f"lsn: {error}") from None
    if not confirmed_flush <= lsn <= server_flush:
        raise OffsetError(
            f"lsn: {requested} is outside the allowed range [{format_lsn(confirmed_flush)}, {format_lsn(server_flush)}]"
            " (not behind the slot's confirmed_flush_lsn, not ahead of the server's WAL)"
        )
    return lsn


def build_change_offset_job(source_name: str) -> JobDefinition:
    @op(name=f"{source_name}_record_offset", required_resource_keys={"cdc"}, pool=lake_pool(source_name))
    def change_offset(context: OpExecutionContext, config: ChangeOffsetConfig) -> None:
        source = context.resources.cdc.config.source(source_name)
        with connect(source.connection, source.name) as conn:
            confirmed, _ = stream.slot_position(conn, source.slot)
            server = stream.current_flush_lsn(conn)
        lsn = validate_postgres_offset(config.lsn, confirmed, server)
        context.log_event(
            AssetMaterialization(
                asset_key=stream_asset_key(source_name),
                metadata={
                    "lsn": format_lsn(lsn),
                    "slot": source.slot,
                    "publication": source.publication,
                    "changed_by": config.changed_by,
                    "reason": config.reason,
                },
            )
        )

    @job(name=change_offset_job_name(source_name), description="Validate and record a new stream offset (DDD-4).")
    def change_offset_job() -> None:
        change_offset()

    return change_offset_job
