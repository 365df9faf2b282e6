"""The consistency sweep of a source: every chunk of every captured table checked on a cron schedule.

One schedule per captured table (``<source>__<schema>__<table>__consistency_sweep``; a name that is not a valid
Dagster name is mapped by ``cdc_assets.engine.names.table_slug``). Each tick requests one run of
the table's chunk check job (``check_job_name``) over the partition range from the first chunk to the last: the
check compares every chunk, ``checks.chunks_per_window`` chunks per watermark window, in one run and one Spark
driver, and records an evaluation per chunk partition and one for the range naming the chunks that differ
(``cdc_assets.assets.build_consistency_check``).
The check writes nothing; it waits for the stream to pass each window, so the stream must be running.
Re-materializing the differing partitions repairs them; a run of the same job with one ``dagster/partition`` tag
checks one chunk again. The source's ``checks.cron`` (UTC) sets the schedule; ``off`` builds no sweep. The run key
makes the check requested once per tick. Sweep runs have the lowest queue priority (``SWEEP_TAGS``).
"""

from typing import TYPE_CHECKING

from dagster import (
    AssetCheckKey,
    AssetSelection,
    DagsterInvalidDefinitionError,
    DefaultScheduleStatus,
    RunRequest,
    ScheduleDefinition,
    ScheduleEvaluationContext,
    SkipReason,
    define_asset_job,
    schedule,
)

from cdc_assets.assets import (
    CHUNK_CHECK_NAME,
    RANGE_END_TAG,
    RANGE_START_TAG,
    chunk_partitions,
    table_asset_key,
    table_name_slug,
)
from cdc_assets.config import ConfigError
from sensors.stream import PRIORITY_TAG

if TYPE_CHECKING:
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

# below every other run in the queue: a check waits for the stream to pass its window, so a stream run (or a
# snapshot) queued behind a day's worth of checks would make them inconclusive; the instance's
# tag_concurrency_limits can bound how many run at once (dagster_home/dagster.yaml: one)
SWEEP_TAGS = {"cdc/reason": "consistency sweep", PRIORITY_TAG: "-1"}


def check_job_name(source_name: str, qualified_name: str) -> str:
    return f"{source_name}__{table_name_slug(qualified_name)}__chunk_checks"


def sweep_name(source_name: str, qualified_name: str) -> str:
    return f"{source_name}__{table_name_slug(qualified_name)}__consistency_sweep"


def build_chunk_check_job(source_name: str, qualified_name: str) -> "UnresolvedAssetJobDefinition":
    """The job of the table's chunk check alone: a run checks the chunk of its ``dagster/partition`` tag, or every
    chunk between its ``dagster/asset_partition_range_start`` and ``_end`` tags."""
    check_key = AssetCheckKey(table_asset_key(source_name, qualified_name), CHUNK_CHECK_NAME)
    return define_asset_job(
        check_job_name(source_name, qualified_name),
        selection=AssetSelection.checks(check_key),
        description=f"Consistency check of chunks of {qualified_name} (a partition or a range); writes nothing.",
    )


def build_consistency_sweep(
    source_name: str, qualified_name: str, job: "UnresolvedAssetJobDefinition", cron: str
) -> ScheduleDefinition:
    """The table's sweep schedule of its chunk check ``job`` (``build_chunk_check_job``). An invalid ``cron`` raises
    ``ConfigError`` naming the setting."""
    partitions = chunk_partitions(source_name, qualified_name)

    def sweep(context: ScheduleEvaluationContext):
        keys = sorted(context.instance.get_dynamic_partitions(partitions.name))
        if not keys:
            return SkipReason(f"{qualified_name} has no chunk partitions yet (the planner adds them)")
        tick = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "now"
        # a check-only job takes its partitions from the run's tags (as a run launched from the UI carries them)
        tags = {RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1], **SWEEP_TAGS}
        return RunRequest(run_key=tick, tags=tags)

    try:
        return schedule(
            name=sweep_name(source_name, qualified_name),
            job=job,
            cron_schedule=cron,
            execution_timezone="UTC",
            default_status=DefaultScheduleStatus.RUNNING,
            description=f"Checks every chunk of {qualified_name} against the source ({cron}, UTC).",
        )(sweep)
    except DagsterInvalidDefinitionError:
        raise ConfigError(
            f"source {source_name!r}: checks.cron: {cron!r} is not a valid cron expression; allowed: five fields "
            "(minute hour day-of-month month day-of-week), e.g. '0 3 * * *', or 'off'"
        ) from None
