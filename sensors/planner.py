"""The planner sensor of a source: plans chunks of captured tables, adds their partitions, requests snapshots.

For every captured table: plan its chunks once (stored in the lake, immutable), add the chunk partitions that the
instance does not have yet, and in ``initial`` or ``snapshot`` mode request snapshot runs for the new chunks, in
ranges of ``CHUNKS_PER_RUN`` chunks per run. Run keys make every chunk's initial snapshot requested once.
"""

from dagster import (
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from cdc_assets.assets import CHUNKS_PER_RUN, chunk_partitions, table_asset_key
from cdc_assets.engine.chunks import chunk_partition_key
from resources.cdc import CdcResource

RANGE_START = "dagster/asset_partition_range_start"
RANGE_END = "dagster/asset_partition_range_end"


def build_planner_sensor(source_name: str, table_names: list[str]) -> SensorDefinition:
    @sensor(
        name=f"{source_name}_planner_sensor",
        minimum_interval_seconds=30,
        default_status=DefaultSensorStatus.RUNNING,
        asset_selection=AssetSelection.assets(*[table_asset_key(source_name, t) for t in table_names]),
        required_resource_keys={"cdc"},
    )
    def planner(context: SensorEvaluationContext):
        cdc: CdcResource = context.resources.cdc
        pipeline = cdc.pipeline(source_name)
        source = cdc.config.source(source_name)
        tables = pipeline.prepare()  # checks role, publication and slot before any snapshot window opens
        requests = []
        partition_requests = []
        for name in table_names:
            table = tables.get(name)
            if table is None:
                context.log.warning(f"{name} is no longer captured by source {source_name}")
                continue
            plan = pipeline.plan(table)
            partitions = chunk_partitions(source_name, name)
            existing = set(context.instance.get_dynamic_partitions(partitions.name))
            new_keys = [c.partition_key for c in plan.chunks if c.partition_key not in existing]
            if not new_keys:
                continue
            partition_requests.append(partitions.build_add_request(new_keys))
            if source.startup_mode in ("initial", "snapshot"):
                indexes = sorted(c.index for c in plan.chunks if c.partition_key in new_keys)
                for start in range(0, len(indexes), CHUNKS_PER_RUN):
                    group = indexes[start : start + CHUNKS_PER_RUN]
                    first, last = chunk_partition_key(group[0]), chunk_partition_key(group[-1])
                    requests.append(
                        RunRequest(
                            run_key=f"initial:{name}:{first}:{last}",
                            asset_selection=[table_asset_key(source_name, name)],
                            # not the chunk checks: they take one chunk each, and a freshly staged chunk is not
                            # reconciled yet (run them once the stream has passed its window)
                            asset_check_keys=[],
                            tags={RANGE_START: first, RANGE_END: last, "cdc/reason": "initial snapshot"},
                        )
                    )
        if not partition_requests:
            return SkipReason("every captured table is planned")
        return SensorResult(run_requests=requests, dynamic_partitions_requests=partition_requests)

    return planner
