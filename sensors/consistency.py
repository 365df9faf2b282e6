"""The consistency sweep of a source: every chunk of every captured table checked on a cron schedule.

One check job and one schedule per captured table (a job's partitions are one table's chunks). At each tick the
schedule requests one run per chunk partition the instance has; a run executes only that chunk's
``chunk_matches_source`` check (it writes nothing; it waits for the stream to pass its window, so the stream must
be running). A failing check names its chunk and the first differing key; re-materializing that partition repairs
it. The source's ``checks.cron`` (UTC) sets the schedule; ``off`` builds no sweep. Run keys make each chunk's check
requested once per tick. Sweep runs have the lowest queue priority (``SWEEP_TAGS``).
"""

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

from cdc_assets.assets import CHUNK_CHECK_NAME, chunk_partitions, table_asset_key
from cdc_assets.config import ConfigError

PARTITION_TAG = "dagster/partition"
# below every other run in the queue: a check waits for the stream to pass its window, so a stream run (or a
# snapshot) queued behind a day's worth of checks would make them inconclusive; the instance's
# tag_concurrency_limits can bound how many run at once (dagster_home/dagster.yaml: one)
SWEEP_TAGS = {"cdc/reason": "consistency sweep", "dagster/priority": "-1"}


def check_job_name(source_name: str, qualified_name: str) -> str:
    return f"{source_name}__{qualified_name.replace('.', '__')}__chunk_checks"


def build_consistency_sweep(source_name: str, qualified_name: str, cron: str) -> ScheduleDefinition:
    """The table's sweep schedule; its job (``check_job_name``) comes with it. An invalid ``cron`` raises
    ``ConfigError`` naming the setting."""
    check_key = AssetCheckKey(table_asset_key(source_name, qualified_name), CHUNK_CHECK_NAME)
    partitions = chunk_partitions(source_name, qualified_name)
    job = define_asset_job(
        check_job_name(source_name, qualified_name),
        selection=AssetSelection.checks(check_key),
        description=f"Consistency check of one chunk of {qualified_name} (the partition); writes nothing.",
    )

    def sweep(context: ScheduleEvaluationContext):
        keys = context.instance.get_dynamic_partitions(partitions.name)
        if not keys:
            return SkipReason(f"{qualified_name} has no chunk partitions yet (the planner adds them)")
        tick = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "now"
        # a check-only job takes its partition from the run's tag (as a run launched from the UI carries it)
        return [RunRequest(run_key=f"{tick}:{key}", tags={PARTITION_TAG: key, **SWEEP_TAGS}) for key in keys]

    try:
        return schedule(
            name=f"{job.name}_sweep",
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
