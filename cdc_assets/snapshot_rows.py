"""The ``<source>_snapshot_rows`` job: an ad-hoc snapshot of chosen rows (Debezium's ``execute-snapshot`` signal with
``additional-conditions``), the same for every source kind.

Contract: the run config names one or more captured tables, each with an optional structured filter (``where``: a
list of terms ``{column, op, value}``, all ANDed; ``cdc_assets.engine.row_filter``), and who asks and why. The job
runs in the source's lake-write pool (no stream batch runs at the same time; a long-lived stream run steps aside).
Every table and filter is validated first (``CdcSource.rows_requests``: captured, named once, each term's column,
operator and value, the source's own check, no earlier ad-hoc snapshot of the table still waiting for the stream):
bad config fails the run with a message naming the table, the field and the allowed values, before anything is
read, staged or recorded. Then each table's matching rows are read in a watermark window of their own and staged
(``CdcSource.snapshot_rows``); the run logs and records as an observation of the table's asset what it staged
(the filter, rows, attempt, watermarks). Nothing is written to the mirror by the job: the stream reconciles the
window once it has passed its high watermark (settled rows upserted, none deleted; rows the filter does not match
are not touched) and logs it.
"""

from typing import Any

from dagster import AssetObservation, Config, JobDefinition, MetadataValue, OpExecutionContext, job, op
from pydantic import Field

from cdc_assets.assets import lake_pool, snapshot_rows_job_name, table_asset_key, table_metadata_key
from cdc_assets.config import SourceConfig
from cdc_assets.engine.row_filter import RowFilterError, SnapshotRowsRefused

__all__ = ["FilterTermConfig", "RowFilterError", "SnapshotRowsConfig", "SnapshotRowsRefused",
           "TableRowsConfig", "build_snapshot_rows_job", "snapshot_rows_op_name"]  # fmt: skip


class FilterTermConfig(Config):
    """One term: ``column`` (a column of the table; MongoDB: a field path such as ``address.city``), ``op`` (=, !=,
    <, <=, >, >=, in, not in, between, is null, is not null) and ``value`` (a scalar; a list for in / not in /
    between; none for is null / is not null; MongoDB typed values as extended JSON, e.g. {"$oid": "..."})."""

    column: str
    op: str = "="
    value: Any = None


class TableRowsConfig(Config):
    """A captured table (``schema.table``; MongoDB ``database.collection``) and its filter's terms (ANDed; none: every
    row of the table)."""

    table: str
    where: list[FilterTermConfig] | None = None


class SnapshotRowsConfig(Config):
    tables: list[TableRowsConfig] = Field(description="the tables to read rows of, each with its filter")
    requested_by: str
    reason: str


def snapshot_rows_op_name(source_name: str) -> str:
    return f"{source_name}_stage_rows"


def requested_filters(config: SnapshotRowsConfig) -> list[tuple[str, object | None]]:
    """(table, raw filter or None) per requested table, as ``CdcSource.rows_requests`` takes them."""
    return [
        (item.table, None if item.where is None else [term.model_dump() for term in item.where])
        for item in config.tables
    ]


def build_snapshot_rows_job(source: SourceConfig) -> JobDefinition:
    source_name = source.name

    @op(name=snapshot_rows_op_name(source_name), required_resource_keys={"cdc"}, pool=lake_pool(source_name))
    def stage_rows(context: OpExecutionContext, config: SnapshotRowsConfig) -> None:
        cdc = context.resources.cdc
        pipeline = cdc.pipeline(source_name)
        requests = pipeline.rows_requests(requested_filters(config))  # raises before anything is read (no Spark)
        spark = cdc.spark()
        pipeline.refuse_waiting_rows(spark, [table.qualified_name for table, _ in requests])
        for table, row_filter in requests:
            name = table.qualified_name
            described = "every row" if row_filter is None else row_filter.describe()
            report = pipeline.snapshot_rows(spark, table, row_filter, context.run.run_id)
            high = pipeline.format_position(report.hw)
            context.log.info(
                f"table {name}: staged {report.rows} rows matching {described} (attempt {report.attempt}, high "
                f"watermark {high}); the stream reconciles them once it has passed the high watermark (upserts only, "
                f"nothing deleted); requested by {config.requested_by}: {config.reason}"
            )
            context.log_event(
                AssetObservation(
                    asset_key=table_asset_key(source_name, name),
                    metadata={
                        "status": "rows staged",
                        "filter": MetadataValue.text(described),
                        "filter_terms": MetadataValue.json([] if row_filter is None else row_filter.to_json()),
                        "rows": report.rows,
                        "attempt": report.attempt,
                        "low_watermark": report.low_watermark,
                        "high_watermark": MetadataValue.text(high),
                        "seconds": round(report.seconds, 3),
                        "requested_by": config.requested_by,
                        "reason": config.reason,
                        table_metadata_key(source): name,
                    },
                )
            )

    @job(
        name=snapshot_rows_job_name(source_name),
        description="Ad-hoc snapshot of chosen rows: read the rows matching a per-table filter in a watermark window; "
        "the stream reconciles them (upserts only, nothing deleted).",
    )
    def snapshot_rows_job() -> None:
        stage_rows()

    return snapshot_rows_job
