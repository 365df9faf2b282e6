"""Builds the project's ``Definitions`` from a configuration file (see ``cdc_assets.definitions``).

Captured tables are resolved at load time (explicit list + include patterns, from the source's catalog); when the
source cannot be reached at load time, the explicitly listed tables are used and a warning is logged. Reload the
code location to pick up a table that newly matches a pattern.

Contract: one table never takes the others down. A selected table that cannot be captured (``CdcSource.skipped``:
no key, no ``SELECT``, a partition, ...) is logged as a warning naming it, its reason and its fix, and gets an
asset of its own whose ``table_is_captured`` check fails with them (``cdc_assets.assets.build_skipped_table``);
every other table keeps its assets, checks, jobs and schedules, and the planner sensor reports the skipped tables
on every evaluation. Any table name gets valid Dagster names (``cdc_assets.engine.names``).

Every job runs its steps in the run's own process (``in_process_executor``): a snapshot run's read step and its chunk
check step share one Spark driver instead of starting one each (Dagster's default executor runs each step in a
process of its own); the steps of a run are sequential anyway.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from dagster import Definitions, define_asset_job, in_process_executor

from cdc_assets.assets import (
    build_consistency_check,
    build_lag_check,
    build_skipped_table,
    build_stream_asset,
    build_table_asset,
    stream_asset_key,
    stream_job_name,
)
from cdc_assets.config import CdcConfig, SourceConfig, load_config
from cdc_assets.offsets import build_change_offset_job
from cdc_assets.snapshot_rows import build_snapshot_rows_job
from cdc_assets.source import SkippedTableLike, SourceError
from cdc_assets.sources import open_source
from resources.cdc import CdcResource
from sensors.consistency import build_chunk_check_job, build_consistency_sweep
from sensors.planner import build_planner_sensor
from sensors.stream import build_stream_sensor, stream_job_tags

log = logging.getLogger(__name__)


def captured_table_names(config: CdcConfig, source: SourceConfig) -> list[str]:
    return selected_tables(config, source)[0]


def selected_tables(config: CdcConfig, source: SourceConfig) -> tuple[list[str], list[SkippedTableLike]]:
    """The names of the captured tables, and the selected tables that cannot be captured (each logged)."""
    try:
        pipeline = open_source(config, source)
        names = sorted(pipeline.prepare())
    except SourceError as error:
        log.warning("%s; using the explicitly configured tables only", error)
        return [t.qualified_name for t in source.tables], []
    skipped = list(pipeline.skipped())
    for table in skipped:
        log.warning("source %r: %s (every other table is captured)", source.name, table.message)
    return names, skipped


def build_definitions(config_path: str | os.PathLike[str]) -> Definitions:
    config = load_config(config_path)
    assets, checks, jobs, sensors, schedules = [], [], [], [], []
    for source in config.sources:
        names, skipped = selected_tables(config, source)
        for table in skipped:
            spec, check = build_skipped_table(source, table)
            assets.append(spec)
            checks.append(check)
        assets += [build_table_asset(source, name) for name in names]
        checks += [build_consistency_check(source, name) for name in names]
        check_jobs = {name: build_chunk_check_job(source.name, name) for name in names}
        jobs += check_jobs.values()
        assets.append(build_stream_asset(source))
        checks.append(build_lag_check(source))
        stream_job = define_asset_job(
            stream_job_name(source.name), selection=[stream_asset_key(source.name)], tags=stream_job_tags(source.stream)
        )
        jobs += [stream_job, build_change_offset_job(source.name), build_snapshot_rows_job(source)]
        sensors.append(build_stream_sensor(source.name, stream_job.name, source.stream.interval_seconds))
        if names or skipped:
            sensors.append(build_planner_sensor(source.name, names, source.planner_interval_seconds))
        if source.checks.cron is not None:
            schedules += [
                build_consistency_sweep(source.name, name, check_jobs[name], source.checks.cron) for name in names
            ]
    return Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=jobs,
        sensors=sensors,
        schedules=schedules,
        executor=in_process_executor,
        resources={"cdc": CdcResource(config_path=str(Path(config_path).resolve()))},
    )
