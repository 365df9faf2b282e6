"""Builds the project's ``Definitions`` from a configuration file (see ``cdc_assets.definitions``).

Captured tables are resolved at load time (explicit list + include patterns, from the source's catalog), and what
the source listed is kept in its lake (``SourceLake.store_listing``). When the source cannot be reached at load time,
the tables it listed last under the same selection are used (else the explicitly listed ones) and a warning names the
source's error: every process builds the definitions again (the code server, and each run's own process), and a run of
a discovered table whose process cannot reach the source must still find its asset, so that its step fails with the
source's error instead of Dagster's "no AssetsDefinition supplies these keys". Reload the code location to pick up a
table that newly matches a pattern.

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

import json
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
from cdc_assets.lake.layout import ListedSkippedTable, SourceLake, SourceListing
from cdc_assets.offsets import build_change_offset_job
from cdc_assets.snapshot_rows import build_snapshot_rows_job
from cdc_assets.source import SkippedTableLike, SourceError
from cdc_assets.sources import open_source
from resources.cdc import CdcResource
from sensors.consistency import build_chunk_check_job, build_consistency_sweep
from sensors.planner import build_planner_sensor
from sensors.stream import build_stream_sensor, stream_job_tags

log = logging.getLogger(__name__)


def table_selection(source: SourceConfig) -> str:
    """What chooses a source's tables, as text without credentials: a listing made under another selection (a
    pattern added, another server) is not this one's."""
    return json.dumps(
        {
            "kind": source.kind,
            "connection": source.connection.describe(),
            "tables": [t.qualified_name for t in source.tables],
            "include": list(source.include),
            "exclude": list(source.exclude),
            "databases": list(source.mongodb.databases) if source.mongodb is not None else [],
        },
        sort_keys=True,
    )


def selected_tables(config: CdcConfig, source: SourceConfig) -> tuple[list[str], list[SkippedTableLike]]:
    """The names of the captured tables, and the selected tables that cannot be captured (each logged).

    Contract: when the source answers, its listing is the answer and is kept in the lake (a lake that cannot be
    written is a warning: the definitions still load). When it does not, the listing kept under the same
    ``table_selection`` is the answer, else the explicitly configured tables; the warning names the source's error.
    """
    lake = SourceLake(config.lake_root, source.name)
    selection = table_selection(source)
    try:
        pipeline = open_source(config, source)
        names = sorted(pipeline.prepare())
    except SourceError as error:
        listing = _last_listing(lake, selection)
        if listing is None:
            log.warning("%s; using the explicitly configured tables only", error)
            return [t.qualified_name for t in source.tables], []
        log.warning("%s; using the tables it listed when it last answered (%s)", error, lake.listing_path)
        return list(listing.tables), list(listing.skipped)
    skipped = list(pipeline.skipped())
    for table in skipped:
        log.warning("source %r: %s (every other table is captured)", source.name, table.message)
    listed = tuple(ListedSkippedTable(t.qualified_name, t.reason, t.fix, t.message) for t in skipped)
    try:
        lake.store_listing(SourceListing(selection, tuple(names), listed))
    except OSError as error:
        log.warning("source %r: its table listing could not be kept in the lake: %s", source.name, error)
    return names, skipped


def _last_listing(lake: SourceLake, selection: str) -> SourceListing | None:
    try:
        listing = lake.read_listing()
    except (OSError, ValueError) as error:
        log.warning("%s cannot be read: %s", lake.listing_path, error)
        return None
    if listing is None or listing.selection != selection:
        return None
    return listing


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
