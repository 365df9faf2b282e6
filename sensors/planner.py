"""The planner sensor of a source: plans chunks of captured tables, adds their partitions, requests snapshots.

For every captured table: plan its chunks once (stored in the lake, immutable), add the chunk partitions that the
instance does not have yet, and in ``initial`` or ``snapshot`` mode request snapshot runs for the new chunks, in
ranges of the source's ``chunks_per_run`` chunks per run. Run keys make every chunk's initial snapshot requested once.

Added columns: the sensor's cursor holds each table's column names as it last saw them (recorded on first sight,
which the initial snapshot covers). When a table gains columns whose older rows hold a value no change carried
(``CdcSource.filled_without_changes``: PostgreSQL's ``ADD COLUMN ... DEFAULT`` or a generated column), it requests
a snapshot of every chunk of the table, as above, in ``initial`` or ``snapshot`` mode (``latest`` reads no
table at all); reconciliation then writes those values into the mirror (a row changed since the read gets its change
from the stream). The cursor makes each addition requested once.

Partitioned tables: the cursor also holds each captured table's partitions (``CdcSource.partitions``); when a
partition is attached, detached or dropped, rows entered or left the root without a change in the WAL, so every
chunk of the table is read again (``cdc_assets.engine.partitions``), in ``initial`` or ``snapshot`` mode.

Startup modes: ``latest`` and ``timestamp`` request no snapshot (partitions are added; a chunk is read only when
someone materializes its partition), and the skip reason says so.

Lost history (``SourceLake.resnapshot_markers``: the stream restarted after its source lost changes, MongoDB's
``on_history_lost: resnapshot``): every chunk of each marked table is requested again, in any startup mode, once per
marker position (the cursor and the run keys ``resnapshot@<position>:...``); the stream applies no window of the
table read before that position and removes the marker once every chunk was read after it.

Failed snapshot runs: each run requested here carries ``snapshot_run_tags``: Dagster's daemon runs it again after a
failure, up to the source's ``snapshot_run_retries`` times (``dagster/max_retries``; the instance's ``run_retries``
must be enabled, else the planner warns when it requests runs), and its run monitor fails one still in flight after
``snapshot_run_max_runtime_seconds`` (``dagster/max_runtime``), which ends a run orphaned with its code server (a lost
machine): it would otherwise stay STARTED, hold a run slot and leave its chunks unread for good. Reading a chunk
again is safe (its earlier window is superseded); a run key is still requested once.

Lost retries: every evaluation requests the retry Dagster's daemon never launched for a failed run of the source's
tables, as Dagster would have made it (in its backfill, counted against its ``dagster/max_retries``), and gives up
one it cannot request (its backfill ended), so a backfill ends instead of waiting for good (``sensors.lost_retries``).

Skipped tables: every evaluation logs a warning per selected table that cannot be captured (``CdcSource.skipped``),
names them in its skip reason, and records a failing ``table_is_captured`` check evaluation of the table's asset
(reason and fix) when it first sees it or its reason changed. Nothing else stops for them.
"""

import json
import time

from dagster import (
    AssetCheckEvaluation,
    AssetSelection,
    DefaultSensorStatus,
    RunRequest,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from cdc_assets.assets import (
    CAPTURED_CHECK_NAME,
    MAX_RETRIES_TAG,
    MAX_RUNTIME_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    chunk_partitions,
    skipped_table_evaluation,
    table_asset_key,
)
from cdc_assets.config import SourceConfig
from cdc_assets.engine.chunks import chunk_partition_key
from cdc_assets.engine.partitions import repartition_reason
from resources.cdc import CdcResource
from sensors.lost_retries import GIVEN_UP_MESSAGE, RELAUNCH_REASON, RETRY_OF_LOST_RUN_TAG, settle_lost_retries

# cursor keys that are no table name (a qualified name always holds a '.')
SKIPPED_KEY = "~skipped"
PARTITIONS_KEY = "~partitions"
RESNAPSHOT_KEY = "~resnapshot"
NO_SNAPSHOT_MODES = ("latest", "timestamp")


def build_planner_sensor(source_name: str, table_names: list[str], interval_seconds: int) -> SensorDefinition:
    table_keys = [table_asset_key(source_name, t) for t in table_names]

    @sensor(
        name=f"{source_name}_planner_sensor",
        minimum_interval_seconds=interval_seconds,
        default_status=DefaultSensorStatus.RUNNING,
        asset_selection=AssetSelection.assets(*table_keys),
        required_resource_keys={"cdc"},
    )
    def planner(context: SensorEvaluationContext):
        cdc: CdcResource = context.resources.cdc
        pipeline = cdc.pipeline(source_name)
        source = cdc.config.source(source_name)
        tables = pipeline.prepare()  # checks role, publication and slot before any snapshot window opens
        requests: list[RunRequest] = []
        partition_requests = []
        seen: dict = json.loads(context.cursor) if context.cursor else {}
        reads_tables = source.startup_mode in ("initial", "snapshot")
        skipped = list(pipeline.skipped())
        reported: dict[str, str] = seen.get(SKIPPED_KEY, {})
        events = []
        for table in skipped:
            context.log.warning(f"source {source_name}: {table.message}")
            if reported.get(table.qualified_name) != table.message:
                events.append(
                    AssetCheckEvaluation(
                        asset_key=table_asset_key(source_name, table.qualified_name),
                        check_name=CAPTURED_CHECK_NAME,
                        **skipped_table_evaluation(source, table),
                    )
                )
        seen[SKIPPED_KEY] = {t.qualified_name: t.message for t in skipped}
        known_partitions: dict[str, list[str]] = seen.get(PARTITIONS_KEY, {})
        resnapshots = pipeline.lake.resnapshot_markers()
        requested_resnapshots: dict[str, int] = seen.get(RESNAPSHOT_KEY, {})
        for name in table_names:
            table = tables.get(name)
            if table is None:
                context.log.warning(f"{name} is no longer captured by source {source_name}")
                continue
            plan = pipeline.plan(table)
            columns = pipeline.column_names(table)
            added = [c for c in columns if c not in seen.get(name, columns)]
            seen[name] = columns
            partitions_now = pipeline.partitions(table)
            repartitioned = repartition_reason(known_partitions.get(name), partitions_now) if reads_tables else None
            known_partitions[name] = partitions_now
            if repartitioned:
                context.log.info(f"{name}: {repartitioned}")
                indexes = [c.index for c in plan.chunks]
                requests += _snapshot_requests(source, name, indexes, f"repartition@{int(time.time())}", repartitioned)
            filled = pipeline.filled_without_changes(table, added) if reads_tables else []
            if filled:
                reason = (
                    f"column(s) {', '.join(filled)} added with a value for older rows (DEFAULT or generated) that "
                    "no change carries: every chunk is read again"
                )
                context.log.info(f"{name}: {reason}")
                indexes = [c.index for c in plan.chunks]
                # the cursor makes each addition seen once; the time tells a column added again after a drop apart
                kind = f"refill:{','.join(filled)}@{int(time.time())}"
                requests += _snapshot_requests(source, name, indexes, kind, reason)
            marker = resnapshots.get(name)
            if marker is not None and requested_resnapshots.get(name) != marker.position:
                context.log.warning(f"{name}: {marker.reason}")
                indexes = [c.index for c in plan.chunks]
                requests += _snapshot_requests(
                    source, name, indexes, f"resnapshot@{marker.position}", f"read again: {marker.reason}"
                )
                requested_resnapshots[name] = marker.position
            partitions = chunk_partitions(source_name, name)
            existing = set(context.instance.get_dynamic_partitions(partitions.name))
            new_keys = [c.partition_key for c in plan.chunks if c.partition_key not in existing]
            if not new_keys:
                continue
            partition_requests.append(partitions.build_add_request(new_keys))
            if reads_tables:
                indexes = sorted(c.index for c in plan.chunks if c.partition_key in new_keys)
                requests += _snapshot_requests(source, name, indexes, "initial", "initial snapshot")
        lost = settle_lost_retries(context.instance, source_name, table_keys, time.time())
        for request in lost.requests:
            context.log.warning(f"source {source_name}: run {request.tags[RETRY_OF_LOST_RUN_TAG]}: {RELAUNCH_REASON}")
        for run_id, retry_id in lost.linked.items():
            context.log.info(f"source {source_name}: run {run_id}: {RELAUNCH_REASON} as run {retry_id}")
        for run_id in lost.given_up:
            context.log.warning(f"source {source_name}: run {run_id}: {GIVEN_UP_MESSAGE}")
        requests += lost.requests
        if requests and source.snapshot_run_retries and not context.instance.run_retries_enabled:
            context.log.warning(
                f"source {source_name}: snapshot_run_retries is {source.snapshot_run_retries}, but this Dagster "
                "instance does not retry runs (run_retries.enabled in its dagster.yaml): a failed snapshot run stays "
                "failed until it is re-executed"
            )
        seen[PARTITIONS_KEY] = known_partitions
        seen[RESNAPSHOT_KEY] = {k: v for k, v in requested_resnapshots.items() if k in resnapshots}
        cursor = json.dumps(seen, sort_keys=True)
        not_captured = ""
        if skipped:
            not_captured = f"; {len(skipped)} table(s) NOT captured: " + "; ".join(t.message for t in skipped)
        if source.startup_mode in NO_SNAPSHOT_MODES:
            not_captured += (
                f"; startup_mode is {source.startup_mode!r}: no snapshot is requested (the mirrors hold what the "
                "stream applies; materialize chunk partitions to read them)"
            )
        if not partition_requests and not requests:
            return SensorResult(
                skip_reason=SkipReason(f"every captured table is planned{not_captured}"), cursor=cursor,
                asset_events=events,
            )  # fmt: skip
        return SensorResult(
            run_requests=requests, dynamic_partitions_requests=partition_requests, cursor=cursor, asset_events=events
        )

    return planner


def _snapshot_requests(source: SourceConfig, name: str, indexes: list[int], kind: str, reason: str) -> list[RunRequest]:
    """Snapshot runs of ``indexes``, the source's ``chunks_per_run`` chunks each; run key
    ``<kind>:<table>:<first>:<last>``."""
    requests = []
    for start in range(0, len(indexes), source.chunks_per_run):
        group = indexes[start : start + source.chunks_per_run]
        first, last = chunk_partition_key(group[0]), chunk_partition_key(group[-1])
        requests.append(
            RunRequest(
                run_key=f"{kind}:{name}:{first}:{last}",
                asset_selection=[table_asset_key(source.name, name)],
                # not the chunk checks: they take one chunk each, and a freshly staged chunk is not reconciled yet
                # (run them once the stream has passed its window)
                asset_check_keys=[],
                tags={
                    RANGE_START_TAG: first,
                    RANGE_END_TAG: last,
                    "cdc/reason": reason[:200],
                    **snapshot_run_tags(source),
                },
            )
        )
    return requests


def snapshot_run_tags(source: SourceConfig) -> dict[str, str]:
    """Dagster's tags that retry a failed snapshot run of ``source`` and bound its time in flight:
    ``dagster/max_retries`` (``snapshot_run_retries``) and ``dagster/max_runtime``
    (``snapshot_run_max_runtime_seconds``), 0 included (never; no bound): a run without them takes the instance's
    defaults (``run_retries.max_retries``, ``run_monitoring.max_runtime_seconds`` in dagster.yaml)."""
    return {
        MAX_RETRIES_TAG: str(source.snapshot_run_retries),
        MAX_RUNTIME_TAG: str(source.snapshot_run_max_runtime_seconds),
    }
