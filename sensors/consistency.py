"""The consistency sweep of a source: every chunk of every captured table checked on a cron schedule.

One schedule per captured table (``<source>__<schema>__<table>__consistency_sweep``). Each tick requests one run of
the table's ``table_matches_source`` check (job ``table_check_job_name``): every chunk of the table's plan,
``checks.chunks_per_window`` chunks per watermark window, in one run and one Spark driver. The check writes nothing;
it waits for the stream to pass each window, so the stream must be running. A failing check names the chunks that
differ and the first differing key; re-materializing those partitions repairs them. The source's ``checks.cron``
(UTC) sets the schedule; ``off`` builds no sweep. The run key makes the check requested once per tick. Sweep runs
have the lowest queue priority (``SWEEP_TAGS``).

Each table also has a job for the per-chunk check alone (``check_job_name``; its run takes the chunk from the
``dagster/partition`` tag), to check one chunk again, e.g. after repairing it.
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

from cdc_assets.assets import CHUNK_CHECK_NAME, TABLE_CHECK_NAME, chunk_partitions, table_asset_key
from cdc_assets.config import ConfigError

if TYPE_CHECKING:
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition

# below every other run in the queue: a check waits for the stream to pass its window, so a stream run (or a
# snapshot) queued behind a day's worth of checks would make them inconclusive; the instance's
# tag_concurrency_limits can bound how many run at once (dagster_home/dagster.yaml: one)
SWEEP_TAGS = {"cdc/reason": "consistency sweep", "dagster/priority": "-1"}


def check_job_name(source_name: str, qualified_name: str) -> str:
    return f"{source_name}__{qualified_name.replace('.', '__')}__chunk_checks"


def table_check_job_name(source_name: str, qualified_name: str) -> str:
    return f"{source_name}__{qualified_name.replace('.', '__')}__table_check"


def sweep_name(source_name: str, qualified_name: str) -> str:
    return f"{source_name}__{qualified_name.replace('.', '__')}__consistency_sweep"


def build_chunk_check_job(source_name: str, qualified_name: str) -> "UnresolvedAssetJobDefinition":
    """The job of the per-chunk check alone (one chunk per run, from the run's partition tag)."""
    check_key = AssetCheckKey(table_asset_key(source_name, qualified_name), CHUNK_CHECK_NAME)
    return define_asset_job(
        check_job_name(source_name, qualified_name),
        selection=AssetSelection.checks(check_key),
        description=f"Consistency check of one chunk of {qualified_name} (the partition); writes nothing.",
    )


def build_consistency_sweep(source_name: str, qualified_name: str, cron: str) -> ScheduleDefinition:
    """The table's sweep schedule; its job (``table_check_job_name``) comes with it. An invalid ``cron`` raises
    ``ConfigError`` naming the setting."""
    check_key = AssetCheckKey(table_asset_key(source_name, qualified_name), TABLE_CHECK_NAME)
    partitions = chunk_partitions(source_name, qualified_name)
    job = define_asset_job(
        table_check_job_name(source_name, qualified_name),
        selection=AssetSelection.checks(check_key),
        description=f"Consistency check of every chunk of {qualified_name}; writes nothing.",
    )

    def sweep(context: ScheduleEvaluationContext):
        if not context.instance.get_dynamic_partitions(partitions.name):
            return SkipReason(f"{qualified_name} has no chunk partitions yet (the planner adds them)")
        tick = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "now"
        return RunRequest(run_key=tick, tags=dict(SWEEP_TAGS))

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
