"""Dagster assets of one source: a chunk-partitioned asset per captured table, and the stream asset.

Thin glue, the same for every source kind: the work is done by the source's ``CdcSource`` (``cdc_assets.source``:
the generic ``cdc_assets.pipeline`` over the kind's dialect). A table asset's partition is one chunk of its stored plan;
materializing partitions snapshots those chunks in one watermark window and stages them; each of the stream
asset's materializations is one micro-batch, and its metadata holds the offset (DDD-4 field names). A stream run
keeps its Spark session across batches for ``stream.run_seconds``, so a batch does not pay a driver start.

Names: a table's asset key is ``[source, dagster_part(schema), dagster_part(table)]`` and its partition set
``<source>__<table_slug>__chunks`` (``cdc_assets.engine.names``: ordinary names unchanged, any other name valid,
stable and collision-free); the real name is in the description and in the ``postgres_table`` (MongoDB:
``mongodb_collection``) metadata.
A selected table that cannot be captured (``CdcSource.skipped``) gets an asset of its own without materializations
(``build_skipped_table``) whose check ``table_is_captured`` fails naming the reason and the fix: the planner sensor
records that evaluation, and a run of the check evaluates it again.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    AssetsDefinition,
    AssetSpec,
    BackfillPolicy,
    DagsterExecutionInterruptedError,
    DagsterRunStatus,
    DynamicPartitionsDefinition,
    Failure,
    In,
    MaterializeResult,
    MetadataValue,
    Nothing,
    OpExecutionContext,
    Out,
    RetryPolicy,
    RunsFilter,
    asset,
    asset_check,
    graph_asset,
    op,
)

from cdc_assets.config import SourceConfig
from cdc_assets.engine.chunks import chunk_index, chunk_partition_key
from cdc_assets.engine.faults import fault_point
from cdc_assets.engine.names import dagster_part, split_qualified, table_slug
from cdc_assets.lake.layout import UpkeepStep
from cdc_assets.pipeline import failure_cause
from cdc_assets.range_check import RangeCheck, check_range
from cdc_assets.source import CdcSource, SkippedTableLike, SourceLag, StreamReport

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_assets.lake.warm_up import WarmUp
    from cdc_assets.source import ChunkCheck

CHUNK_CHECK_NAME = "chunk_matches_source"
CAPTURED_CHECK_NAME = "table_is_captured"
# a retried step re-reads (snapshot: new attempt, new window) or re-applies idempotently (stream)
RETRY = RetryPolicy(max_retries=3, delay=5)
# run tags of stream runs: when the run's batches end (unix seconds; the streaming sensor requests a successor before),
# and that a run's driver is warm and waits for the lake-write pool (the run holding it then ends after its batch)
ENDS_AT_TAG = "cdc/stream_ends_at"
READY_TAG = "cdc/ready_to_take_over"
MAX_RUNTIME_TAG = "dagster/max_runtime"  # read by Dagster's run monitor (run_monitoring in the instance's dagster.yaml)
MAX_RETRIES_TAG = "dagster/max_retries"  # read by the daemon's automatic run retries (run_retries in dagster.yaml)
# a run of a range of chunk partitions (the planner's snapshot runs, the consistency sweep's check runs)
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
HANDOFF_POLL_SECONDS = 0.5


@contextmanager
def not_retried_when_interrupted(step: str) -> Iterator[None]:
    """Contract: an interrupt inside (the run terminated, or its process asked to stop, as ``dagster dev`` asks its
    runs when it shuts down) ends the step as a ``Failure`` that ``RETRY`` does not retry, naming ``step``. Why:
    Dagster's RetryPolicy retries interrupted steps too; a stream step started again while ``dagster dev`` shut
    down kept it from ending, it was killed, and its runs stayed STARTED with no code server left to report them,
    so the streaming sensor waited on them for good (docs/deployment.md). Other errors pass through unchanged."""
    try:
        yield
    except (DagsterExecutionInterruptedError, KeyboardInterrupt) as interrupt:
        raise Failure(
            description=f"{step} was interrupted (its run was terminated or its process asked to stop); not retried",
            allow_retries=False,
        ) from interrupt


@contextmanager
def failure_naming_its_cause(step: str, retry_number: int, max_retries: int = RETRY.max_retries) -> Iterator[None]:
    """A step retried by ``RETRY``. Contract: an interrupt ends it as ``not_retried_when_interrupted`` does; any
    other error on the last attempt ``max_retries`` allows (``retry_number``: the attempts made before this one) ends
    it as a ``Failure`` whose description names ``step``, the attempts and the error's type and message; on an earlier
    attempt the error passes through unchanged (Dagster retries the step). Why: once a RetryPolicy's retries are
    used up, Dagster's step failure says only "Exceeded max_retries of 3", without the error's message (that is in
    the retry events before it), so a run failed for a reason its page did not show first (found 2026-12-07 with a
    source that refused the password)."""
    with not_retried_when_interrupted(step):
        try:
            yield
        except Failure:
            raise
        except Exception as error:
            if retry_number < max_retries:
                raise
            raise Failure(
                description=f"{step} failed on attempt {retry_number + 1} of {max_retries + 1}: "
                f"{type(error).__name__}: {error}",
                allow_retries=False,
            ) from error


ACTIVE_RUN_STATUSES = [
    DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED,
]  # fmt: skip


def table_asset_key(source: str, qualified_name: str) -> AssetKey:
    schema, name = split_qualified(qualified_name)
    return AssetKey([source, dagster_part(schema), dagster_part(name)])


def table_name_slug(qualified_name: str) -> str:
    """The table in one Dagster name (partition set, job, schedule names): ``cdc_assets.engine.names.table_slug``."""
    return table_slug(*split_qualified(qualified_name))


def stream_asset_key(source: str) -> AssetKey:
    return AssetKey([source, "_stream"])


def chunk_partitions(source: str, qualified_name: str) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=f"{source}__{table_name_slug(qualified_name)}__chunks")


def lake_pool(source: str) -> str:
    return f"cdc_lake_writes_{source}"


STARTUP_NOTES = {
    "latest": " startup_mode latest: no snapshot is requested; the mirror holds what the stream applied since the "
    "source was first discovered (materialize partitions to read chunks).",
    "timestamp": " startup_mode timestamp: no snapshot is requested; the mirror holds what the stream applied after "
    "startup_timestamp (materialize partitions to read chunks).",
    "snapshot": " startup_mode snapshot: the chunks are read and reconciled; the stream goes no further than that.",
}


def build_table_asset(source: SourceConfig, qualified_name: str) -> AssetsDefinition:
    key = table_asset_key(source.name, qualified_name)

    @asset(
        key=key,
        partitions_def=chunk_partitions(source.name, qualified_name),
        backfill_policy=BackfillPolicy.multi_run(max_partitions_per_run=source.chunks_per_run),
        retry_policy=RETRY,
        required_resource_keys={"cdc"},
        group_name=source.name,
        kinds={source.kind, "spark", "delta"},
        description=f"Delta mirror of {qualified_name}; one partition per primary-key chunk (snapshot + reconcile)."
        + STARTUP_NOTES.get(source.startup_mode, ""),
        metadata={table_metadata_key(source): qualified_name},
    )
    def table_chunks(context: AssetExecutionContext) -> MaterializeResult:
        step = f"snapshot of {qualified_name} (source {source.name!r})"
        with failure_naming_its_cause(step, context.retry_number):
            pipeline = context.resources.cdc.pipeline(source.name)
            table = pipeline.tables.get(qualified_name)
            if table is None:
                raise ValueError(f"source {source.name!r}: table {qualified_name} is no longer captured")
            indexes = sorted(chunk_index(k) for k in context.partition_keys)
            report = pipeline.snapshot(context.resources.cdc.spark(), table, indexes, context.run.run_id)
        paths = pipeline.lake.table(qualified_name)
        return MaterializeResult(
            metadata={
                "status": "staged",
                "chunks": MetadataValue.json([chunk_partition_key(i) for i in indexes]),
                "rows": report.rows,
                "seconds": round(report.seconds, 3),
                "rows_per_second": round(report.rows / report.seconds, 1) if report.seconds else 0.0,
                "low_watermark": report.low_watermark,
                "high_watermark": MetadataValue.text(pipeline.format_position(report.hw)),
                "attempt": report.attempt,
                table_metadata_key(source): qualified_name,
                "mirror": MetadataValue.path(paths.mirror),
            }
        )

    return table_chunks


def build_consistency_check(source: SourceConfig, qualified_name: str) -> AssetChecksDefinition:
    """Per-chunk check: source and mirror hold the same rows (count and checksum) at a consistent point. A run of one
    partition checks that chunk; a run of a partition range (the consistency sweep: every chunk; a backfill of
    several chunks, which runs the asset's checks too) checks every chunk of the range, ``checks.chunks_per_window``
    per watermark window, and records an evaluation per chunk partition plus one for the range (no partition)
    naming the differing chunks."""
    per_window = source.checks.chunks_per_window

    @asset_check(
        asset=table_asset_key(source.name, qualified_name),
        name=CHUNK_CHECK_NAME,
        partitions_def=chunk_partitions(source.name, qualified_name),
        required_resource_keys={"cdc"},
        blocking=False,
        description=(
            "Row count and checksum of the chunk's key range, computed by PostgreSQL and by Spark over the mirror, in "
            "a watermark window (keys that concurrent transactions touch are left out). Repair a failing chunk by "
            "re-materializing its partition. A run of a partition range checks every chunk of it (an evaluation per "
            "chunk, and one for the range naming the chunks that differ)."
        ),
    )
    def chunk_matches_source(context: AssetCheckExecutionContext) -> Iterator[AssetCheckEvaluation | AssetCheckResult]:
        cdc = context.resources.cdc
        pipeline = cdc.pipeline(source.name)
        table = pipeline.tables[qualified_name]
        if context.has_partition_key:
            (result,) = pipeline.check_chunks(cdc.spark(), table, [chunk_index(context.partition_key)])
            yield AssetCheckResult(**chunk_evaluation(qualified_name, result))
            return
        indexes = [chunk_index(key) for key in context.partition_keys]
        checked = check_range(pipeline, cdc.spark(), table, indexes, per_window)
        for result in checked.chunks:  # each partition's own evaluation (its status in the UI)
            yield AssetCheckEvaluation(
                asset_key=table_asset_key(source.name, qualified_name), check_name=CHUNK_CHECK_NAME,
                partition=chunk_partition_key(result.chunk), **chunk_evaluation(qualified_name, result),
            )  # fmt: skip
        yield range_check_result(checked, per_window)

    return chunk_matches_source


def chunk_evaluation(qualified_name: str, result: "ChunkCheck") -> dict[str, Any]:
    """The evaluation fields of one chunk's result: passed, severity (a warning when inconclusive), metadata
    (counts, both checksums, the first difference) and a description saying how to repair."""
    key = chunk_partition_key(result.chunk)
    metadata: dict[str, Any] = {
        "chunk": key,
        "source_rows": result.source_rows,
        "mirror_rows": result.mirror_rows,
        "source_checksum": result.source_checksum,
        "mirror_checksum": result.mirror_checksum,
        "excluded_keys": result.excluded_keys,
    }
    if result.first_difference:
        metadata["first_difference"] = MetadataValue.text(result.first_difference[:2000])
    if not result.conclusive:
        description = f"{qualified_name} {key}: inconclusive: {result.reason}"
        return {"passed": False, "severity": AssetCheckSeverity.WARN, "metadata": metadata, "description": description}
    description = f"{qualified_name} {key}: " + (
        "mirror matches source" if result.matches else f"mirror differs from source; {result.reason or ''} "
        f"{result.first_difference or ''} Re-materialize partition {key} to repair."
    )  # fmt: skip
    return {"passed": result.matches, "metadata": metadata, "description": description}


def range_check_result(result: RangeCheck, per_window: int) -> AssetCheckResult:
    """The evaluation of a partition range: failed naming the differing chunks, a warning when some stayed
    inconclusive, passed when every chunk matched."""
    keys = [chunk_partition_key(c.chunk) for c in result.chunks]
    differing = [chunk_partition_key(i) for i in result.differing]
    inconclusive = [chunk_partition_key(i) for i in result.inconclusive]
    source_rows, mirror_rows = result.rows()
    metadata = {
        "chunks": MetadataValue.text(f"{keys[0]}..{keys[-1]} ({len(keys)})" if keys else "none"),
        "chunks_per_window": per_window,
        "differing_chunks": MetadataValue.json(differing),
        "inconclusive_chunks": MetadataValue.json(inconclusive),
        "source_rows": source_rows,
        "mirror_rows": mirror_rows,
    }
    first = result.first_difference()
    if first:
        metadata["first_difference"] = MetadataValue.text(first[:2000])
    if differing:
        description = (
            f"{result.table}: {len(differing)} of {len(keys)} chunks differ from the source: {', '.join(differing)}. "
            f"Re-materialize those partitions to repair. {first}"
        )
        return AssetCheckResult(passed=False, metadata=metadata, description=description[:4000])
    if inconclusive:
        reasons = sorted({c.reason or "" for c in result.chunks if not c.conclusive})
        return AssetCheckResult(
            passed=False, severity=AssetCheckSeverity.WARN, metadata=metadata,
            description=f"{result.table}: inconclusive for {', '.join(inconclusive)}: {'; '.join(reasons)}",
        )  # fmt: skip
    return AssetCheckResult(
        passed=True, metadata=metadata, description=f"{result.table}: all {len(keys)} chunks match the source"
    )


def build_skipped_table(
    source: SourceConfig, skipped: SkippedTableLike
) -> tuple[AssetsDefinition, AssetChecksDefinition]:
    """An asset for a selected table that is not captured (never materialized), with a check that fails naming the
    reason and the fix. Running the check asks the source again; the planner sensor records its evaluation."""
    key = table_asset_key(source.name, skipped.qualified_name)
    spec = AssetSpec(
        key=key,
        group_name=source.name,
        kinds={source.kind},
        description=f"NOT CAPTURED: {skipped.message}",
        metadata={table_metadata_key(source): skipped.qualified_name, "reason": skipped.reason, "fix": skipped.fix},
    )
    qualified_name = skipped.qualified_name

    @asset_check(
        asset=key,
        name=CAPTURED_CHECK_NAME,
        required_resource_keys={"cdc"},
        blocking=False,
        description=f"Whether {qualified_name} is captured; fails with the reason and the fix while it is not.",
    )
    def table_is_captured(context: AssetCheckExecutionContext) -> AssetCheckResult:
        pipeline = context.resources.cdc.pipeline(source.name)
        pipeline.prepare()
        current = {t.qualified_name: t for t in pipeline.skipped()}
        if qualified_name in current:
            return AssetCheckResult(**skipped_table_evaluation(source, current[qualified_name]))
        return AssetCheckResult(
            passed=qualified_name in pipeline.tables,
            description=(
                f"{qualified_name} can be captured now: reload the code location to add its asset"
                if qualified_name in pipeline.tables
                else f"{qualified_name} is no longer selected by source {source.name!r}"
            ),
            metadata={table_metadata_key(source): qualified_name},
        )

    return AssetsDefinition(specs=[spec]), table_is_captured


def table_metadata_key(source: SourceConfig) -> str:
    """The metadata key that holds a table's real name: ``postgres_table``, ``mongodb_collection``."""
    return TABLE_METADATA_KEYS.get(source.kind, f"{source.kind}_table")


def skipped_table_evaluation(source: SourceConfig, skipped: SkippedTableLike) -> dict[str, Any]:
    """The failing evaluation of ``table_is_captured``: the table, the reason and the fix."""
    return {
        "passed": False,
        "description": skipped.message,
        "metadata": {table_metadata_key(source): skipped.qualified_name, "reason": skipped.reason, "fix": skipped.fix},
    }


def build_stream_asset(source: SourceConfig) -> AssetsDefinition:
    """The stream asset: two steps in the run's one process (``in_process_executor``). ``warm_up`` starts the Spark
    driver outside the source's lake-write pool and, when another run holds the pool (the predecessor a successor was
    requested for, ``sensors.stream``), warms it and waits there; ``batches`` then holds the pool and streams."""

    @op(
        name=f"{source.name}_stream_warm_up",
        required_resource_keys={"cdc"},
        out=Out(Nothing),
        description="Starts the run's Spark driver; while another run holds the lake-write pool, warms the driver "
        "(a batch of each table rehearsed on shallow clones of its tables, cdc_assets.lake.warm_up), tags this run "
        f"{READY_TAG}=true and waits for the pool to be free.",
    )
    def warm_up(context: OpExecutionContext) -> None:
        with not_retried_when_interrupted(f"warm-up of the stream of source {source.name!r}"):
            _warm_up_while_the_pool_is_held(context, source)

    @op(
        name=f"{source.name}_stream_batches",
        required_resource_keys={"cdc"},
        ins={"warm": In(Nothing)},
        out=Out(is_required=False),  # every batch is recorded as it happens (a materialization event), see below
        pool=lake_pool(source.name),
        retry_policy=RETRY,
    )
    def stream_batches(context: OpExecutionContext) -> Iterator[AssetMaterialization | AssetObservation]:
        """Batches back to back while the run lasts: each batch's offset is recorded (the event is stored when it is
        yielded), and only then may the source forget what it covers (PostgreSQL: the slot follows it). The run ends
        at ``run_seconds``, or after one batch when ``run_seconds`` is 0, or as soon as another run is waiting for the
        source's lake-write pool (a stream run only once it is warm). An interrupt ends it without a retry
        (``not_retried_when_interrupted``); an error on the last attempt fails it naming the error
        (``failure_naming_its_cause``)."""
        with failure_naming_its_cause(f"stream of source {source.name!r}", context.retry_number):
            yield from batches(context)

    @graph_asset(
        key=stream_asset_key(source.name),
        group_name=source.name,
        kinds={source.kind, "spark", "delta"},
        description=(
            f"Change stream of source {source.name!r} ({source.kind}): one materialization per micro-batch; metadata "
            "holds the offset with Debezium's field names (PostgreSQL: lsn, lsn_commit, lsn_proc, txId, ts_usec). A "
            f"run keeps its Spark session and runs batches for up to stream.run_seconds={source.stream.run_seconds}; "
            f"its successor is requested stream.handoff_seconds={source.stream.handoff_seconds} before that and warms "
            "its driver while this run streams."
        ),
    )
    def stream():
        return stream_batches(warm_up())

    def batches(context: OpExecutionContext) -> Iterator[AssetMaterialization | AssetObservation]:
        cdc = context.resources.cdc
        pipeline = cdc.pipeline(source.name)
        spark = cdc.spark()
        recorded = recorded_offset(context.instance, source.name)
        deadline = time.monotonic() + source.stream.run_seconds
        if source.stream.run_seconds:  # the streaming sensor requests a successor handoff_lead_seconds before this
            ends_at = str(round(time.time() + source.stream.run_seconds))
            context.instance.add_run_tags(context.run.run_id, {ENDS_AT_TAG: ends_at})
        while True:
            report = pipeline.stream_batch(spark, recorded, context.run.run_id)
            context.log.info(batch_log_line(report))
            if report.resnapshot:
                context.log.warning(report.resnapshot)
            if report.newly_captured:
                context.log.warning(
                    f"source {source.name!r} captures {', '.join(report.newly_captured)} from this batch on (created "
                    "or selected while the run was in flight): their changes are applied from now on; reload the code "
                    "location to add their assets, and the planner then requests their snapshots"
                )
            for item in report.reconciled:
                yield AssetObservation(
                    asset_key=table_asset_key(source.name, item["table"]),
                    partition=chunk_partition_key(item["chunk"]),
                    metadata={
                        "status": item["event"],
                        "kept": item["kept"],
                        "dropped": item["dropped"],
                        "deleted_from_mirror": item["deleted"],
                    },
                )
            for item in report.rows_windows:
                context.log.info(
                    f"table {item['table']}: ad-hoc snapshot of rows {item['attempt']} reconciled: {item['kept']} rows "
                    f"applied, {item['dropped']} left to the stream (changed by transactions not settled at its low "
                    "watermark); nothing deleted"
                )
                yield AssetObservation(
                    asset_key=table_asset_key(source.name, str(item["table"])),
                    metadata={"status": "rows reconciled", "attempt": str(item["attempt"]), "kept": item["kept"],
                              "dropped": item["dropped"]},
                )  # fmt: skip
            yield AssetMaterialization(asset_key=stream_asset_key(source.name), metadata=batch_metadata(report))
            # the offset is recorded: the source may now forget what it covers (never before)
            fault_point("stream.after_offset_record")
            recorded = report.offset
            pipeline.acknowledge(recorded)
            intervals: dict[UpkeepStep, int] = {
                "compact": source.stream.compact_seconds,
                "vacuum": source.stream.vacuum_seconds,
            }
            due = [step for step, interval in intervals.items() if pipeline.lake.upkeep_due(step, interval)]
            if due:
                yield _maintain(context, pipeline, spark, source, due)
            if not _next_batch_due(context, pipeline, source, deadline):
                return

    return stream


def _warm_up_while_the_pool_is_held(context: OpExecutionContext, source: SourceConfig) -> None:
    """Start the driver; while another run holds the source's lake-write pool, warm it once (``CdcSource.warm_up``:
    each table's latest batch rehearsed on shallow clones of its changelog and mirror), say so in a run tag the run
    holding the pool looks for (``_another_run_needs_the_pool``), and wait until the pool is free. With the pool free
    at once (no run in flight), the first batch starts without a warm-up."""
    cdc = context.resources.cdc
    spark = cdc.spark()  # the run's one process keeps it for the batches step
    run_id = context.run.run_id
    pool = lake_pool(source.name)

    def holders() -> set[str]:
        claimed = context.instance.event_log_storage.get_concurrency_info(pool).claimed_slots
        return {slot.run_id for slot in claimed} - {run_id}

    held_by = holders()
    if not held_by:
        return
    active = context.instance.get_run_records(RunsFilter(statuses=ACTIVE_RUN_STATUSES))
    live = {record.dagster_run.run_id for record in active}
    try:
        warm = cdc.pipeline(source.name).warm_up(spark, run_id, live, lambda: bool(holders()))
    except Exception as error:  # the source's tables not listed (a server not answering): the batches step retries
        context.log.warning(
            f"warm-up not done ({failure_cause(error)}); this run is not marked ready, so run "
            f"{', '.join(sorted(held_by))} streams on to its end, then this one streams with a cold driver (its "
            "batches step retries what failed here)"
        )
    else:
        _report_warm_up(context, warm, pool, held_by)
    waited = time.monotonic()
    while holders():
        time.sleep(HANDOFF_POLL_SECONDS)
    context.log.info(f"the lake-write pool {pool} is free after {time.monotonic() - waited:.1f} s: streaming")


def _report_warm_up(context: OpExecutionContext, warm: "WarmUp", pool: str, held_by: set[str]) -> None:
    """Log how the warm-up went; a warm-up that ran to its end tags the run ready (``READY_TAG``)."""
    rehearsed = ", ".join(warm.rehearsed) or "no table"
    if warm.stopped:  # the run in flight ended first: the stream goes on now, not after the rest of a warm-up
        context.log.info(
            f"warm-up stopped after {warm.seconds:.1f} s (rehearsed: {rehearsed}): the lake-write pool {pool} is free"
        )
    else:
        context.instance.add_run_tags(context.run.run_id, {READY_TAG: "true"})
        context.log.info(
            f"driver warmed in {warm.seconds:.1f} s (a batch rehearsed on shallow clones of the tables of {rehearsed}) "
            f"while run {', '.join(sorted(held_by))} holds the lake-write pool {pool}: waiting for it, ready to take "
            "over"
        )
    for table, error in warm.failed.items():
        context.log.warning(f"warm-up of table {table} failed, the first batch will be slower: {error}")


def _maintain(
    context: OpExecutionContext,
    pipeline: CdcSource,
    spark: "SparkSession",
    source: SourceConfig,
    steps: list[UpkeepStep],
) -> AssetObservation:
    """Lake upkeep between batches (``cdc_assets.lake.maintenance``), recorded as an observation of the stream."""
    from cdc_assets.lake.maintenance import maintain_lake  # Spark imports stay out of definition loading

    started = time.monotonic()
    target_bytes = source.stream.compact_target_mb * 1024 * 1024
    results = maintain_lake(spark, pipeline.lake, pipeline.tables, target_bytes, steps)
    for step in steps:
        pipeline.lake.mark_upkeep_done(step)
    seconds = round(time.monotonic() - started, 3)
    context.log.info(f"lake upkeep ({', '.join(steps)}) of source {source.name!r} took {seconds} s")
    return AssetObservation(
        asset_key=stream_asset_key(source.name),
        metadata={
            "upkeep_steps": ", ".join(steps),
            "upkeep_seconds": seconds,
            "files_compacted": sum(r.files_compacted for r in results),
            "files_vacuumed": sum(r.files_vacuumed for r in results),
            "staging_files_dropped": sum(r.staging_files_dropped for r in results),
            "per_table": MetadataValue.json([asdict(r) for r in results]),
        },
    )


def batch_log_line(report: StreamReport) -> str:
    """One line per batch in its run's log: changes, bytes, tables, lag, phase seconds, and the bounds when failed
    batches shrank them."""
    tables = ", ".join(f"{name} {figures['changes']}" for name, figures in sorted(report.per_table.items())) or "none"
    phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in report.phase_seconds.items())
    lag_seconds = 0.0 if report.lag_seconds is None else report.lag_seconds
    line = (
        f"stream batch: {report.changes} changes in {report.transactions} transactions, {report.bytes} bytes; "
        f"tables: {tables}; lag {report.lag_bytes} bytes, {lag_seconds:.1f} s; {phases}; "
        f"{len(report.reconciled)} chunks reconciled, {report.waiting_windows} waiting"
    )
    if report.resnapshot:
        line += "; HISTORY LOST: the stream restarted here and every chunk is read again"
    bounds = report.bounds
    if bounds.get("shrunk"):
        if bounds["failures"]:
            why = f"after {bounds['failures']} failed batch(es): {bounds.get('reason', '')}"
        else:  # the failures are behind it: the bounds grow back by doubling
            why = f"growing back after earlier failed batches (the last: {bounds.get('reason', '')})"
        line += (
            f"; a SMALLER batch than configured (at most {bounds['max_changes']} changes, {bounds['max_bytes']} bytes)"
            f" {why}; next batch at most {bounds['next_max_changes']} changes, {bounds['next_max_bytes']} bytes"
        )
    return line


def batch_metadata(report: StreamReport) -> dict[str, object]:
    """A batch's materialization metadata: the offset (DDD-4 names) and numeric figures the UI plots."""
    offset = {k: v for k, v in report.offset.items() if v is not None}
    bounds: dict[str, object] = {}
    if report.bounds:
        bounds = {
            "batch_max_changes": report.bounds["max_changes"],
            "batch_max_bytes": report.bounds["max_bytes"],
            "batch_shrunk": bool(report.bounds["shrunk"]),
        }
        if report.bounds.get("shrunk"):
            bounds["batch_shrunk_reason"] = MetadataValue.text(str(report.bounds.get("reason", "")))
    return {
        **offset,
        **bounds,
        "bytes": report.bytes,
        "changes": report.changes,
        "transactions": report.transactions,
        "seconds": round(report.seconds, 3),
        "changes_per_second": round(report.changes / report.seconds, 1) if report.seconds else 0.0,
        "lag_bytes": report.lag_bytes,
        "lag_seconds": round(report.lag_seconds, 3) if report.lag_seconds is not None else 0.0,
        "reconciled_chunks": len(report.reconciled),
        "waiting_chunks": report.waiting_windows,
        "per_table": MetadataValue.json(report.per_table),
        # selected tables that are not captured: their changes are not applied (name -> reason and fix)
        "skipped_tables": MetadataValue.json(report.skipped_tables),
        **{f"seconds_{phase}": seconds for phase, seconds in report.phase_seconds.items()},
        # the source lost changes before this batch: why, and that every chunk is read again (else absent)
        **({"history_lost": MetadataValue.text(report.resnapshot)} if report.resnapshot else {}),
    }


LAG_CHECK_NAME = "lag_within_bound"
TABLE_METADATA_KEYS = {"postgres": "postgres_table", "mongodb": "mongodb_collection"}


def lag_evaluation(source: SourceConfig, lag: SourceLag) -> dict[str, Any]:
    """The lag check's fields: failed when the slot lags more than ``stream.max_lag_alert_bytes`` or its oldest
    waiting change is older than ``stream.max_lag_alert_seconds``."""
    settings = source.stream
    over = []
    if lag.lag_bytes > settings.max_lag_alert_bytes:
        over.append(f"{lag.lag_bytes} bytes > stream.max_lag_alert_bytes={settings.max_lag_alert_bytes}")
    if lag.lag_seconds > settings.max_lag_alert_seconds:
        over.append(f"{lag.lag_seconds:.0f} s > stream.max_lag_alert_seconds={settings.max_lag_alert_seconds}")
    description = (
        f"stream of source {source.name!r} lags: " + "; ".join(over) + ". Look at the stream runs' failures and logs."
        if over
        else f"stream of source {source.name!r} lags {lag.lag_bytes} bytes, {lag.lag_seconds:.0f} s: within bounds"
    )
    return {
        "passed": not over,
        "metadata": lag_metadata(lag)
        | {
            "max_lag_alert_bytes": settings.max_lag_alert_bytes,
            "max_lag_alert_seconds": settings.max_lag_alert_seconds,
        },
        "description": description,
    }


def unanswered_evaluation(source: SourceConfig) -> dict[str, Any]:
    """The lag check's fields when the source did not answer within ``stream.sensor_timeout_seconds``: failed, the
    lag unknown."""
    seconds = source.stream.sensor_timeout_seconds
    return {
        "passed": False,
        "metadata": {"sensor_timeout_seconds": seconds},
        "description": (
            f"stream of source {source.name!r}: lag unknown, the source did not answer within {seconds} s "
            "(stream.sensor_timeout_seconds). A saturated or unreachable server, or a long backlog to read: look at "
            "the stream runs' logs."
        ),
    }


def lag_metadata(lag: SourceLag) -> dict[str, Any]:
    return {
        "lag_bytes": lag.lag_bytes,
        "lag_seconds": round(lag.lag_seconds, 3),
        "changes_waiting": lag.changes_waiting,
    }


def build_lag_check(source: SourceConfig) -> AssetChecksDefinition:
    """The stream asset's lag check. The streaming sensor also records an evaluation of it on every tick (with the
    lag as an observation), so it fails while stream runs fail or do not run at all."""

    @asset_check(
        asset=stream_asset_key(source.name),
        name=LAG_CHECK_NAME,
        required_resource_keys={"cdc"},
        blocking=False,
        description=(
            f"Fails when the stream of source {source.name!r} lags the source by more than stream.max_lag_alert_bytes="
            f"{source.stream.max_lag_alert_bytes} or its oldest waiting change is older than "
            f"stream.max_lag_alert_seconds={source.stream.max_lag_alert_seconds}. The streaming sensor evaluates it "
            "on every tick, whether or not stream runs succeed."
        ),
    )
    def lag_within_bound(context: AssetCheckExecutionContext) -> AssetCheckResult:
        return AssetCheckResult(**lag_evaluation(source, context.resources.cdc.pipeline(source.name).lag()))

    return lag_within_bound


def _next_batch_due(context: OpExecutionContext, pipeline: CdcSource, source: SourceConfig, deadline: float) -> bool:
    """Wait (polling every ``poll_seconds``) until a batch is due; False when the run should end instead."""
    while time.monotonic() < deadline:
        if _another_run_needs_the_pool(context, source.name):
            context.log.info("another run of this source waits for its lake-write pool: ending this stream run")
            return False
        if pipeline.pending_work() is not None:
            return True
        time.sleep(source.stream.poll_seconds)
    return False


def _another_run_needs_the_pool(context: OpExecutionContext, source_name: str) -> bool:
    """Whether another active run needs this source's lake-write pool: its offset job, its snapshot_rows job, or
    another stream run once that one's driver is warm (``READY_TAG``; a successor still starting does not end this
    run: its first batch would wait for its driver instead). A stream run is one of the source's stream job (what the
    streaming sensor launches: its runs carry no asset selection) or one whose asset selection holds the stream."""
    stream_key = stream_asset_key(source_name)
    for record in context.instance.get_run_records(RunsFilter(statuses=ACTIVE_RUN_STATUSES)):
        run = record.dagster_run
        if run.run_id == context.run.run_id:
            continue
        if run.job_name in (change_offset_job_name(source_name), snapshot_rows_job_name(source_name)):
            return True
        streams = run.job_name == stream_job_name(source_name) or stream_key in (run.asset_selection or set())
        if streams and run.tags.get(READY_TAG) == "true":
            return True
    return False


def change_offset_job_name(source_name: str) -> str:
    return f"{source_name}_change_offset"


def snapshot_rows_job_name(source_name: str) -> str:
    return f"{source_name}_snapshot_rows"


def stream_job_name(source_name: str) -> str:
    return f"{source_name}_stream"


def recorded_offset(instance, source_name: str) -> dict[str, object] | None:
    """The stream asset's latest materialization's metadata as plain values: the recorded offset (a batch's, or
    one the ``change_offset`` job recorded). The source's dialect reads its own fields of it."""
    event = instance.get_latest_materialization_event(stream_asset_key(source_name))
    if event is None or event.asset_materialization is None:
        return None
    return {name: value.value for name, value in event.asset_materialization.metadata.items()}
