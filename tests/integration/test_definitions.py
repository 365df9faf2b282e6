"""The Dagster glue: definitions load and validate, and the stream asset records the offset, then moves the slot."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckKey,
    AssetKey,
    DagsterEventType,
    DagsterInstance,
    DagsterRun,
    DagsterRunStatus,
    RunRequest,
    build_schedule_context,
    build_sensor_context,
    instance_for_test,
    materialize,
    partition_loading_context,
)
from dagster._core.execution.backfill import BulkActionStatus, PartitionBackfill
from dagster._core.instance.ref import InstanceRef
from psycopg import sql

from cdc_assets.assets import (
    ENDS_AT_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    READY_TAG,
    chunk_partitions,
    lake_pool,
    recorded_offset,
    stream_asset_key,
)
from cdc_assets.build import build_definitions
from cdc_assets.engine.chunks import chunk_partition_key
from cdc_assets.lake.layout import SourceLake
from cdc_assets.lake.spark import SHORT_LIVED_DRIVER_OPTIONS
from cdc_assets.offsets import OffsetError
from cdc_assets.sources.postgres.dialect import validate_postgres_offset
from cdc_assets.sources.postgres.lsn import format_lsn, parse_lsn
from cdc_assets.sources.postgres.stream import slot_position
from resources.cdc import CdcResource
from sensors.consistency import check_job_name, sweep_name
from sensors.stream import build_stream_sensor
from tests.integration.support import PG_PORT, READER_PASSWORD, create_source, drop_source

DATABASE = "pipe_defs"
ROOT = Path(__file__).resolve().parents[2]

CONFIG = """
lake_root: {lake}
spark: {{master: "local[2]", conf: {{spark.driver.extraJavaOptions: "{driver_options}"}}}}  # the commands' drivers
sources:
  - name: defs
    kind: postgres
    connection: {{host: 127.0.0.1, port: {port}, dbname: pipe_defs, user: pipe_defs_reader, password: "${{DEFS_PW}}"}}
    slot: pipe_defs
    publication: pipe_defs
    chunk_size: 100
    include: ["public.*"]
    stream: {{interval_seconds: 5}}
"""


@pytest.fixture(scope="module")
def config_path(postgres_server: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    create_source(admin_dsn, DATABASE)
    directory = tmp_path_factory.mktemp("defs")
    path = directory / "cdc.yaml"
    path.write_text(CONFIG.format(lake=directory / "lake", port=PG_PORT, driver_options=SHORT_LIVED_DRIVER_OPTIONS))
    os.environ["DEFS_PW"] = READER_PASSWORD
    yield path, admin_dsn
    drop_source(admin_dsn, DATABASE)


def test_definitions_build_with_tables_sensors_and_jobs(config_path) -> None:
    path, _ = config_path
    defs = build_definitions(path)
    keys = {key for asset in defs.assets for key in asset.keys}
    assert {
        AssetKey(["defs", "public", "items"]),
        AssetKey(["defs", "public", "pairs"]),
        AssetKey(["defs", "public", "docs"]),
        stream_asset_key("defs"),
    } <= keys
    assert {s.name: s.minimum_interval_seconds for s in defs.sensors} == {
        "defs_stream_sensor": 5,
        "defs_planner_sensor": 30,
    }  # the configured stream.interval_seconds; planner_interval_seconds' default
    tables = ("items", "pairs", "docs")
    assert {j.name for j in defs.jobs} == {"defs_stream", "defs_change_offset", "defs_snapshot_rows"} | {
        check_job_name("defs", f"public.{name}") for name in tables
    }
    check_keys = {key for checks in defs.asset_checks for key in checks.check_keys}
    assert {(k.asset_key, k.name) for k in check_keys} == {
        (AssetKey(["defs", "public", name]), "chunk_matches_source") for name in tables
    } | {(stream_asset_key("defs"), "lag_within_bound")}


def test_dagster_cli_validates_the_code_location(config_path) -> None:
    path, _ = config_path
    env = {**os.environ, "CDC_CONFIG": str(path), "DEFS_PW": READER_PASSWORD}
    result = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-m", "cdc_assets.definitions"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Validation successful" in result.stderr + result.stdout
    assert READER_PASSWORD not in result.stderr + result.stdout


def test_stream_asset_records_offset_then_advances_slot(config_path, spark) -> None:
    path, admin_dsn = config_path
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        admin.execute("set synchronous_commit = on")
        admin.execute("insert into pairs values (1, 'a', 1, 'x'), (2, 'b', 2, 'y')")
        before, _ = slot_position(admin, DATABASE)
    # the compaction clock ran out an hour ago; the vacuum clock has not started (it starts now, nothing runs)
    lake = SourceLake(path.parent / "lake", "defs")
    lake.mark_upkeep_done("compact")
    an_hour_ago = time.time() - 3601
    os.utime(path.parent / "lake" / "defs" / "_cdc" / "upkeep" / "compact", (an_hour_ago, an_hour_ago))
    defs = build_definitions(path)
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    instance = DagsterInstance.ephemeral()
    result = materialize([stream_asset], resources=defs.resources, instance=instance)
    assert result.success
    metadata = result.asset_materializations_for_node(stream_asset.node_def.name)[0].metadata
    assert {"lsn", "lsn_commit", "lsn_proc", "txId", "ts_usec", "slot", "publication"} <= set(metadata)
    assert metadata["changes"].value == 2
    recorded = recorded_offset(instance, "defs")
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        after, _ = slot_position(admin, DATABASE)
    assert recorded is not None and parse_lsn(str(recorded["lsn"])) > before
    assert after == parse_lsn(str(recorded["lsn"]))  # the slot followed the recorded offset, not further
    rows = spark.read.format("delta").load(str(path.parent / "lake" / "defs" / "public.pairs" / "mirror"))
    assert rows.count() == 2
    # the batch is followed by the due upkeep step, recorded as an observation of the stream
    upkeep = [
        event.event_specific_data.asset_observation.metadata
        for event in result.all_events
        if event.event_type_value == "ASSET_OBSERVATION"
        and event.event_specific_data.asset_observation.asset_key == stream_asset_key("defs")
    ]
    assert len(upkeep) == 1 and {"upkeep_seconds", "files_compacted", "staging_files_dropped"} <= set(upkeep[0])
    assert upkeep[0]["upkeep_steps"].value == "compact"
    assert not lake.upkeep_due("compact", 3600)  # done: the clock starts again
    assert (lake.control / "upkeep" / "vacuum").is_file() and not lake.upkeep_due("vacuum", 86400)


def test_change_offset_validation_names_field_and_range() -> None:
    with pytest.raises(OffsetError, match=r"lsn: not a PostgreSQL LSN"):
        validate_postgres_offset("12345", 0, 100)
    with pytest.raises(OffsetError, match=r"lsn: 0/5 is outside the allowed range \[0/10, 0/20\]"):
        validate_postgres_offset("0/5", 0x10, 0x20)
    assert validate_postgres_offset("0/15", 0x10, 0x20) == parse_lsn("0/15")


def insert_pair(dsn: str, region: int, code: str) -> None:
    """Insert a row of ``pairs`` (key ``region``, ``code``) and commit it with ``synchronous_commit = on``: the test
    server's is off, and a batch and the sensor's peek of the slot read flushed WAL only."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("set synchronous_commit = on")
        admin.execute("insert into pairs values (%s, %s, 0, 'z')", [region, code])


def long_lived_config(path: Path, run_seconds: int) -> Path:
    """The module's configuration with stream runs that keep their Spark session for ``run_seconds``."""
    text = path.read_text().replace(
        "stream: {interval_seconds: 5}", f"stream: {{interval_seconds: 5, run_seconds: {run_seconds}, poll_seconds: 1}}"
    )
    assert f"run_seconds: {run_seconds}" in text
    long_lived = path.with_name(f"cdc-run-{run_seconds}.yaml")
    long_lived.write_text(text)
    return long_lived


def test_long_lived_stream_run_records_every_batch_then_moves_the_slot(config_path, spark) -> None:
    path, admin_dsn = config_path
    defs = build_definitions(long_lived_config(path, 25))
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    instance = DagsterInstance.ephemeral()
    dsn = f"{admin_dsn} dbname={DATABASE}"
    errors: list[BaseException] = []

    def write_while_the_run_lasts() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute("set synchronous_commit = on")
                for i in range(5):
                    time.sleep(3)
                    admin.execute("insert into pairs values (%s, 'late', %s, 'z')", [1000 + i, i])
        except BaseException as error:  # reported by the test
            errors.append(error)

    insert_pair(dsn, 999, "early")
    writer = threading.Thread(target=write_while_the_run_lasts)
    writer.start()
    result = materialize([stream_asset], resources=defs.resources, instance=instance)
    writer.join()
    assert result.success and not errors, errors
    batches = result.asset_materializations_for_node(stream_asset.node_def.name)
    assert len(batches) >= 2  # one run, several batches, each recorded as it happened
    assert sum(b.metadata["changes"].value for b in batches) == 6
    lsns = [parse_lsn(str(b.metadata["lsn"].value)) for b in batches]
    assert lsns == sorted(lsns)
    with psycopg.connect(dsn, autocommit=True) as admin:
        after, _ = slot_position(admin, DATABASE)
    assert after == parse_lsn(str(recorded_offset(instance, "defs")["lsn"])) == lsns[-1]
    mirror = spark.read.format("delta").load(str(path.parent / "lake" / "defs" / "public.pairs" / "mirror"))
    assert {999, 1000, 1001, 1002, 1003, 1004} <= {r[0] for r in mirror.select(mirror.columns[0]).collect()}


@pytest.mark.parametrize(
    ("job_name", "op_name", "config"),
    [
        ("defs_change_offset", "defs_record_offset", {"lsn": "0/0", "changed_by": "test", "reason": "waits"}),
        ("defs_snapshot_rows", "defs_stage_rows",
         {"tables": [{"table": "public.items"}], "requested_by": "test", "reason": "waits for the pool"}),
    ],
)  # fmt: skip
def test_long_lived_stream_run_steps_aside_for_a_waiting_run_of_the_pool(
    config_path, spark, job_name: str, op_name: str, config: dict
) -> None:
    path, _ = config_path
    defs = build_definitions(long_lived_config(path, 600))
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    instance = DagsterInstance.ephemeral()
    instance.create_run_for_job(
        defs.get_job_def(job_name),
        run_config={"ops": {op_name: {"config": config}}},
        status=DagsterRunStatus.STARTED,  # started; its op waits for the pool slot
    )
    started = time.monotonic()
    result = materialize([stream_asset], resources=defs.resources, instance=instance)
    assert result.success
    assert len(result.asset_materializations_for_node(stream_asset.node_def.name)) == 1
    assert time.monotonic() - started < 300  # ended after its batch, not at run_seconds


def test_a_long_lived_stream_run_hands_over_only_to_a_successor_whose_driver_is_warm(config_path, spark) -> None:
    """A stream run of the same source in flight ends a long-lived run after its batch once it is tagged ready
    (its driver warm, waiting for the pool); one still starting does not: the run goes on to its ``run_seconds``.
    The other run is made as the streaming sensor's are: a run of the stream job with no asset selection (a bench
    found the run in flight ignoring such a ready successor: it looked for the stream in the run's asset selection)."""
    path, _ = config_path
    defs = build_definitions(long_lived_config(path, 15))
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    for ready, ends_at_run_seconds in ((False, True), (True, False)):
        instance = DagsterInstance.ephemeral()
        tags = {READY_TAG: "true"} if ready else {}
        other = instance.create_run_for_job(defs.get_job_def("defs_stream"), status=DagsterRunStatus.STARTED, tags=tags)
        assert other.asset_selection is None
        started = time.monotonic()
        result = materialize([stream_asset], resources=defs.resources, instance=instance)
        elapsed = time.monotonic() - started
        assert result.success
        assert (elapsed >= 15) is ends_at_run_seconds, (ready, elapsed)
        (run,) = [r for r in instance.get_runs() if r.run_id == result.run_id]
        assert ENDS_AT_TAG in run.tags  # what the streaming sensor times the successor by


def test_a_stream_run_whose_pool_is_held_warms_its_driver_and_streams_once_the_pool_is_free(config_path, spark) -> None:
    """The stream asset's first step starts the driver outside the lake-write pool; while another run holds the
    pool it warms the driver, tags the run ready (what the run holding the pool looks for) and waits; the batch
    runs once the pool is free."""
    path, admin_dsn = config_path
    defs = build_definitions(path)
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    dsn = f"{admin_dsn} dbname={DATABASE}"
    insert_pair(dsn, 4000, "a batch to rehearse")
    pool = lake_pool("defs")
    freed: list[float] = []
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 1}}}) as instance:
        assert materialize([stream_asset], resources=defs.resources, instance=instance).success  # the pool free
        insert_pair(dsn, 4002, "while the pool is held")
        instance.event_log_storage.initialize_concurrency_limit_to_default(pool)  # as a run's executor does
        assert instance.event_log_storage.claim_concurrency_slot(pool, "predecessor", "stream").is_claimed

        def free_once_ready() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not freed:
                if any(run.tags.get(READY_TAG) == "true" for run in instance.get_runs()):
                    time.sleep(2)  # the run waits while the pool stays held
                    freed.append(time.time())
                    instance.event_log_storage.free_concurrency_slot_for_step("predecessor", "stream")
                time.sleep(0.2)

        freeing = threading.Thread(target=free_once_ready)
        freeing.start()
        result = materialize([stream_asset], resources=defs.resources, instance=instance)
        freeing.join()
        assert result.success and freed, freed
        messages = [entry.message for entry in instance.all_logs(result.run_id)]
        warmed = [m for m in messages if "driver warmed in" in m and "holds the lake-write pool" in m]
        assert warmed and "rehearsed on shallow clones of the tables of public.pairs" in warmed[0], messages
        assert not any("warm-up of table" in m for m in messages), messages  # no rehearsal failed
        batches = instance.get_records_for_run(result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
        assert batches and min(record.event_log_entry.timestamp for record in batches) >= freed[0]
        assert not (SourceLake(path.parent / "lake", "defs").control / "warm_up" / result.run_id).exists()


def test_a_warm_up_that_cannot_reach_the_source_does_not_fail_the_run_which_streams_once_the_pool_is_free(
    config_path, spark
) -> None:
    """A successor whose warm-up cannot list the source's tables (in the demo on 2026-12-05 the MongoDB test server
    timed out, and the run failed in its warm-up step) logs why, is not tagged ready (its predecessor streams on to
    its end) and waits for the pool; its batches step then streams. Here the reader role may not log in while the
    run warms up, and may again before the pool is freed."""
    path, admin_dsn = config_path
    defs = build_definitions(path)
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    dsn = f"{admin_dsn} dbname={DATABASE}"
    reader = sql.Identifier(f"{DATABASE}_reader")
    insert_pair(dsn, 4003, "after a failed warm-up")
    pool = lake_pool("defs")
    seen: list[str] = []
    with instance_for_test(overrides={"concurrency": {"pools": {"default_limit": 1}}}) as instance:
        instance.event_log_storage.initialize_concurrency_limit_to_default(pool)  # as a run's executor does
        assert instance.event_log_storage.claim_concurrency_slot(pool, "predecessor", "stream").is_claimed

        def free_once_warned() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not seen:
                for run in instance.get_runs():
                    seen.extend(e.message for e in instance.all_logs(run.run_id) if "warm-up not done" in e.message)
                time.sleep(0.2)
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("alter role {} login").format(reader))
            instance.event_log_storage.free_concurrency_slot_for_step("predecessor", "stream")

        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("alter role {} nologin").format(reader))
        freeing = threading.Thread(target=free_once_warned)
        freeing.start()
        try:
            result = materialize([stream_asset], resources=defs.resources, instance=instance, raise_on_error=False)
        finally:
            freeing.join()
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute(sql.SQL("alter role {} login").format(reader))
        assert seen and "is not permitted to log in" in seen[0] and "not marked ready" in seen[0], seen
        assert result.success, [e.message for e in instance.all_logs(result.run_id)][-5:]
        (run,) = [r for r in instance.get_runs() if r.run_id == result.run_id]
        assert READY_TAG not in run.tags  # the predecessor was not told to hand over
        assert instance.get_records_for_run(result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records


def test_the_stream_sensor_requests_a_successor_within_the_handoff_lead_of_the_runs_end(config_path) -> None:
    path, admin_dsn = config_path
    defs = build_definitions(long_lived_config(path, 600))  # handoff_seconds 120 by default
    sensor = defs.resolve_sensor_def("defs_stream_sensor")
    insert_pair(f"{admin_dsn} dbname={DATABASE}", 4001, "pending")  # work for the stream
    reasons = []
    for ends_in in (300, 30):
        with DagsterInstance.ephemeral() as instance:
            in_flight = instance.create_run_for_job(
                defs.get_job_def("defs_stream"), asset_selection=frozenset({stream_asset_key("defs")}),
                status=DagsterRunStatus.STARTED, tags={ENDS_AT_TAG: str(round(time.time() + ends_in))},
            )  # fmt: skip
            with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context:
                result = sensor.evaluate_tick(context)
            reasons.append([request.tags["cdc/reason"] for request in result.run_requests])
    assert reasons[0] == [], reasons
    (successor,) = reasons[1]
    assert successor.startswith(f"successor of stream run {in_flight.run_id}, whose batches end in "), successor


def test_planner_requests_initial_snapshot_runs_without_the_chunk_checks(config_path, capfd) -> None:
    """Each run a range of chunks, retried by Dagster's daemon after a failure (``dagster/max_retries``), and a
    warning when the instance does not retry runs (an ephemeral instance's default; the project's enable it)."""
    path, _ = config_path
    defs = build_definitions(path)
    planner = next(s for s in defs.sensors if s.name == "defs_planner_sensor")
    instance = DagsterInstance.ephemeral()
    with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context:
        result = planner.evaluate_tick(context)
    assert result.run_requests, result
    for request in result.run_requests:
        # a range of chunks per run; a chunk check in such a run would fail ("partition_key for a range")
        assert request.asset_check_keys == [], request
        assert request.tags["dagster/asset_partition_range_start"] <= request.tags["dagster/asset_partition_range_end"]
        assert request.tags["dagster/max_retries"] == "3", request.tags  # snapshot_run_retries' default
    added = {key for r in result.dynamic_partitions_requests for key in r.partition_keys}
    assert chunk_partition_key(0) in added, added
    warning = "this Dagster instance does not retry runs (run_retries.enabled in its dagster.yaml)"
    assert warning in capfd.readouterr().err
    retrying = DagsterInstance.ephemeral(settings={"run_retries": {"enabled": True}})
    with build_sensor_context(instance=retrying, resources=defs.resources, definitions=defs) as context:
        assert planner.evaluate_tick(context).run_requests
    assert warning not in capfd.readouterr().err


def test_planner_requests_a_lost_retry_again_in_its_backfill_and_links_the_run_launched_for_it(
    config_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backfill's run of one chunk that failed "will retry" with no retry launched (Dagster's race, made by hand)
    is requested again by the planner's tick, and Dagster's sensor evaluation accepts the request (its partition,
    selection and tags); once a run of it exists, the next tick tags the failed run with it (``sensors.lost_retries``,
    whose wait is set to 0 here)."""
    import sensors.lost_retries as lost_retries

    docs = AssetKey(["defs", "public", "docs"])
    monkeypatch.setattr(lost_retries, "LOST_RETRY_AFTER_SECONDS", 0)
    path, _ = config_path
    defs = build_definitions(path)
    planner = next(s for s in defs.sensors if s.name == "defs_planner_sensor")
    with instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 3}}) as instance:

        def tick() -> list[RunRequest]:
            # a request of one dynamic partition is checked against the instance's partitions: the daemon's context
            # loads them through its instance's ref, a test's context needs them given
            with (
                build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context,
                partition_loading_context(dynamic_partitions_store=instance),
            ):
                return [r for r in planner.evaluate_tick(context).run_requests if r.run_key.startswith("lost-retry:")]

        assert tick() == []
        first_chunk = chunk_partition_key(0)
        instance.add_dynamic_partitions(chunk_partitions("defs", "public.docs").name, [first_chunk])  # as the daemon
        backfill = PartitionBackfill(backfill_id="lostretry", status=BulkActionStatus.REQUESTED, from_failure=False,
                                     tags={}, backfill_timestamp=time.time(), asset_selection=[docs])  # fmt: skip
        instance.add_backfill(backfill)
        check = AssetCheckKey(docs, "chunk_matches_source")  # a backfill's run of a chunk runs its check too
        run = DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), asset_selection=frozenset({docs}),
                         asset_check_selection=frozenset({check}),
                         tags={"dagster/backfill": "lostretry", "dagster/partition": first_chunk})  # fmt: skip
        instance.add_run(run)
        instance.report_run_failed(run)
        instance.add_run_tags(run.run_id, {"dagster/will_retry": "true"})

        (request,) = tick()
        assert request.run_key == f"lost-retry:{run.run_id}" and request.partition_key == first_chunk
        assert request.asset_selection == [docs] and request.asset_check_keys == [check]
        assert request.tags["dagster/backfill"] == "lostretry"
        assert request.tags["dagster/max_retries"] == "2", request.tags  # the instance default of 3, less this retry
        retry = DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), asset_selection=frozenset({docs}),
                           tags=dict(request.tags))  # fmt: skip
        instance.add_run(retry)
        assert tick() == []
        assert instance.get_run_by_id(run.run_id).tags["dagster/auto_retry_run_id"] == retry.run_id


def test_planner_reads_every_chunk_again_when_a_column_with_a_default_is_added(config_path) -> None:
    """No change carries an added column's DEFAULT to older rows (docs/known-limits.md): the planner sees the new
    column in the catalog (its cursor holds the columns it saw) and requests a snapshot of every chunk of the
    table, once. A column added without a default needs none."""
    path, admin_dsn = config_path
    defs = build_definitions(path)
    from cdc_assets.config import load_config
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline

    planner = next(s for s in defs.sensors if s.name == "defs_planner_sensor")
    instance = DagsterInstance.ephemeral()

    def tick(cursor: str | None):
        with build_sensor_context(
            instance=instance, resources=defs.resources, definitions=defs, cursor=cursor
        ) as context:
            result = planner.evaluate_tick(context)
        refills = [r for r in result.run_requests if r.run_key.startswith("refill:")]
        return result.cursor, refills

    cursor, refills = tick(None)
    assert refills == [] and "title" in json.loads(cursor)["public.docs"]  # first sight: the snapshot covers it
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        try:
            admin.execute("alter table docs add column plain integer")
            cursor, refills = tick(cursor)
            assert refills == [] and "plain" in json.loads(cursor)["public.docs"]
            admin.execute("alter table docs add column shade text not null default 'grey'")
            cursor, refills = tick(cursor)
            config = load_config(path)
            pipeline = PostgresPipeline(config, config.sources[0])
            chunks = len(pipeline.plan(pipeline.tables["public.docs"]).chunks)
            assert len(refills) == -(-chunks // 4), refills  # every chunk, four per run
            assert all(r.run_key.startswith("refill:shade@") and "shade" in r.tags["cdc/reason"] for r in refills)
            assert {tuple(k.path) for r in refills for k in r.asset_selection} == {("defs", "public", "docs")}
            cursor, refills = tick(cursor)
            assert refills == []  # requested once
        finally:
            admin.execute("alter table docs drop column if exists plain, drop column if exists shade")


def test_consistency_sweep_requests_one_check_run_over_every_chunk_per_tick(config_path) -> None:
    """A schedule per captured table (``checks.cron``, default daily 03:00 UTC) requests one run of the table's
    check job per tick, once (run key), behind other runs, over the partition range from the first chunk to the
    last; the job holds the chunk check and no asset."""
    from cdc_assets.assets import chunk_partitions, table_asset_key

    path, _ = config_path
    defs = build_definitions(path)
    name = check_job_name("defs", "public.pairs")
    sweep = defs.resolve_schedule_def(sweep_name("defs", "public.pairs"))
    assert (sweep.cron_schedule, sweep.execution_timezone, sweep.job_name) == ("0 3 * * *", "UTC", name)
    assert {s.name for s in defs.schedules} == {sweep_name("defs", f"public.{t}") for t in ("items", "pairs", "docs")}
    job = defs.resolve_job_def(name)
    assert job.asset_layer.executable_asset_keys == set()  # the check alone: nothing is materialized
    assert [k.name for k in job.asset_layer.asset_graph.asset_check_keys if k.asset_key == table_asset_key(
        "defs", "public.pairs")] == ["chunk_matches_source"]  # fmt: skip
    at = datetime(2026, 11, 25, 3, tzinfo=UTC)
    with instance_for_test() as instance:  # a schedule's context needs a persistent instance
        with build_schedule_context(instance=instance, scheduled_execution_time=at) as context:
            assert sweep.evaluate_tick(context).run_requests == []  # no partitions yet: a skip, not an error
        keys = [chunk_partition_key(i) for i in (2, 0, 1)]
        instance.add_dynamic_partitions(chunk_partitions("defs", "public.pairs").name, keys)
        with build_schedule_context(instance=instance, scheduled_execution_time=at) as context:
            [request] = sweep.evaluate_tick(context).run_requests
    assert request.run_key == at.isoformat() and "dagster/partition" not in request.tags
    assert (request.tags[RANGE_START_TAG], request.tags[RANGE_END_TAG]) == (
        chunk_partition_key(0),
        chunk_partition_key(2),
    )
    assert request.tags["dagster/priority"] == "-1"  # behind stream and snapshot runs


def test_a_backfill_of_several_chunks_and_the_sweep_check_every_chunk_of_their_range(config_path, spark) -> None:
    """A backfill of several chunks runs the table asset's checks in its range run (Dagster includes every check of
    a backfilled asset). The chunk check used to fail such a run ("Cannot access partition_key for a partitioned run
    with a range of partitions"; found in the demo by backfilling two chunks): it now checks every chunk of the
    range once the stream has reconciled them. The sweep's range run over a drifted mirror names the chunk."""
    from delta.tables import DeltaTable
    from pyspark.sql import functions as F

    from cdc_assets.assets import chunk_partitions, table_asset_key
    from cdc_assets.config import load_config
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline
    from tests.integration.test_consistency import Streamer

    path, admin_dsn = config_path
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        admin.execute("create table wide (id bigint primary key, label text)")
        admin.execute("insert into wide select g, 'w' || g from generate_series(1, 250) g")
        admin.execute("grant select on wide to pipe_defs_reader")
        admin.execute("alter publication pipe_defs add table wide")
    config = load_config(path)
    pipeline = PostgresPipeline(config, config.sources[0])
    wide = pipeline.prepare()["public.wide"]
    keys = [chunk_partition_key(i) for i in range(len(pipeline.plan(wide).chunks))]
    assert len(keys) == 3  # 250 rows, chunk_size 100
    defs = build_definitions(path)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(chunk_partitions("defs", "public.wide").name, keys)
    whole_range = {RANGE_START_TAG: keys[0], RANGE_END_TAG: keys[-1]}
    streamer = Streamer(pipeline, spark, None)
    streamer.start()
    try:
        backfill_run = defs.resolve_implicit_global_asset_job_def().execute_in_process(
            instance=instance, asset_selection=[table_asset_key("defs", "public.wide")], tags=whole_range,
            raise_on_error=False,
        )  # fmt: skip
        mirror = pipeline.lake.table("public.wide").mirror
        DeltaTable.forPath(spark, mirror).delete(F.col("id") == 150)  # chunk 1: [100, 200)
        sweep_run = defs.resolve_job_def(check_job_name("defs", "public.wide")).execute_in_process(
            instance=instance, tags=whole_range, raise_on_error=False
        )
    finally:
        streamer.finish()
    assert backfill_run.success and sweep_run.success  # a failed check is not a failed run
    assert len(backfill_run.get_asset_materialization_events()) == 3  # one per chunk
    # an evaluation per chunk partition (each partition's status), then one for the range
    *per_chunk, after_backfill = backfill_run.get_asset_check_evaluations()
    assert [(e.partition, e.passed) for e in per_chunk] == [(k, True) for k in keys]
    assert after_backfill.partition is None and after_backfill.passed, after_backfill.description
    metadata = {k: v.value for k, v in after_backfill.metadata.items()}
    assert metadata["source_rows"] == metadata["mirror_rows"] == 250 and metadata["differing_chunks"] == []
    assert metadata["chunks"] == f"{keys[0]}..{keys[-1]} (3)"
    *per_chunk, drifted = sweep_run.get_asset_check_evaluations()
    assert [(e.partition, e.passed) for e in per_chunk] == [(keys[0], True), (keys[1], False), (keys[2], True)]
    assert (
        "key (id=150)" in per_chunk[1].description and f"Re-materialize partition {keys[1]}" in per_chunk[1].description
    )
    assert not drifted.passed and drifted.metadata["differing_chunks"].value == [keys[1]], drifted.description
    assert "key (id=150)" in drifted.description and "mirror=absent" in drifted.description
    assert "Re-materialize those partitions" in drifted.description


def dagster_cli(
    config: Path, home: Path, *args: str, password: str = READER_PASSWORD
) -> subprocess.CompletedProcess[str]:
    """``dagster <args> -m cdc_assets.definitions`` as the README shows it, with this module's configuration
    (``CDC_CONFIG``) and instance (``DAGSTER_HOME``)."""
    env = {**os.environ, "CDC_CONFIG": str(config), "DAGSTER_HOME": str(home), "DEFS_PW": password}
    command = [str(Path(sys.executable).parent / "dagster"), *args, "-m", "cdc_assets.definitions"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_readmes_commands_materialize_a_chunk_check_it_and_move_the_offset(config_path, spark, tmp_path) -> None:
    """The README's commands, run as a user runs them, while the stream runs beside them: ``dagster asset
    materialize --partition`` reads one chunk of the pairs table (filled by the stream tests above) and checks it;
    ``dagster job execute`` of the table's chunk-check job with a partition tag checks it again (counts and both
    checksums in each evaluation's metadata; that run materializes nothing); ``dagster job execute`` of
    ``defs_change_offset`` refuses an LSN ahead of the server naming the field and range, and records a valid one
    with who and why. Its stream thread moves the slot outside any Dagster run."""
    from dagster import AssetCheckKey, DagsterEventType

    from cdc_assets.assets import CHUNK_CHECK_NAME, chunk_partitions, table_asset_key
    from cdc_assets.config import load_config
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline
    from tests.integration.test_consistency import Streamer

    path, admin_dsn = config_path
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        (rows,) = admin.execute("select count(*) from pairs").fetchone()
    assert rows >= 7  # written by the stream tests above
    home = tmp_path / "dagster_home"
    home.mkdir()
    partition = chunk_partition_key(0)
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        instance.add_dynamic_partitions(chunk_partitions("defs", "public.pairs").name, [partition])  # the planner's
    config = load_config(path)
    pipeline = PostgresPipeline(config, config.sources[0])
    pipeline.prepare()
    assert len(pipeline.plan(pipeline.tables["public.pairs"]).chunks) == 1
    streamer = Streamer(pipeline, spark, None)
    streamer.start()
    try:
        select = ["--select", "defs/public/pairs", "--partition", partition]
        read = dagster_cli(path, home, "asset", "materialize", *select)
        assert read.returncode == 0, read.stdout[-3000:] + read.stderr[-3000:]
        tags = json.dumps({"dagster/partition": partition})
        job = check_job_name("defs", "public.pairs")
        checked = dagster_cli(path, home, "job", "execute", "-j", job, "--tags", tags)
        assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    finally:
        streamer.finish()
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        materialized = instance.fetch_materializations(table_asset_key("defs", "public.pairs"), limit=10).records
        assert [r.asset_materialization.partition for r in materialized if r.asset_materialization] == [partition]
        check = AssetCheckKey(table_asset_key("defs", "public.pairs"), CHUNK_CHECK_NAME)
        # the materialize run checks the chunk it read (an asset's checks run with it), then the check job's run
        check_run, read_run = instance.event_log_storage.get_asset_check_execution_history(check, limit=10)
        assert read_run.run_id == materialized[0].run_id != check_run.run_id
        for execution in (read_run, check_run):
            assert execution.event is not None and execution.event.dagster_event is not None
            evaluation = execution.event.dagster_event.asset_check_evaluation_data
            assert evaluation.passed, evaluation.description
            metadata = {k: v.value for k, v in evaluation.metadata.items()}
            assert metadata["chunk"] == partition and metadata["source_rows"] == metadata["mirror_rows"] == rows
            assert metadata["source_checksum"] == metadata["mirror_checksum"] != "0"
        check_records = instance.get_records_for_run(check_run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
        assert not check_records.records  # the check alone ran

    def change_offset(lsn: str) -> subprocess.CompletedProcess[str]:
        run_config = tmp_path / "offset.yaml"  # `dagster job execute` takes run config from files only
        offset = f"{{lsn: {lsn}, changed_by: operator, reason: why}}"
        run_config.write_text(f"ops: {{defs_record_offset: {{config: {offset}}}}}\n")
        return dagster_cli(path, home, "job", "execute", "-j", "defs_change_offset", "-c", str(run_config))

    refused = change_offset("FFFFFFFF/FFFFFFFF")
    assert refused.returncode != 0
    assert "lsn: FFFFFFFF/FFFFFFFF is outside the allowed range" in refused.stdout + refused.stderr
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        confirmed, _ = slot_position(admin, DATABASE)
    lsn = format_lsn(confirmed)
    moved = change_offset(lsn)
    assert moved.returncode == 0, moved.stdout[-3000:] + moved.stderr[-3000:]
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        (record,) = instance.fetch_materializations(stream_asset_key("defs"), limit=10).records  # the refused: none
        assert record.asset_materialization is not None
        recorded = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    assert recorded["lsn"] == lsn and recorded["changed_by"] == "operator", recorded


def stream_config(path: Path, settings: str, name: str) -> Path:
    """The module's configuration with other ``stream`` settings."""
    text = path.read_text().replace("stream: {interval_seconds: 5}", f"stream: {{interval_seconds: 5, {settings}}}")
    assert settings in text
    changed = path.with_name(name)
    changed.write_text(text)
    return changed


def test_a_run_whose_process_cannot_reach_the_source_fails_with_the_sources_error(
    config_path, tmp_path, monkeypatch, caplog
) -> None:
    """A run's process builds the definitions again; when it cannot list the source (here: a wrong password in its
    environment), it builds the assets of the tables the source listed when it last answered (kept in the lake by
    the load before), so ``dagster asset materialize`` of a discovered table gets as far as its step, which fails
    with the source's error, not with Dagster's "no AssetsDefinition objects supply these keys". A listing made
    under another table selection is not used (only the explicitly listed tables then)."""
    from cdc_assets.assets import chunk_partitions

    path, _ = config_path
    defs = build_definitions(path)  # the source answers: its listing is kept
    listed = {key for asset in defs.assets for key in asset.keys}
    assert AssetKey(["defs", "public", "pairs"]) in listed
    lake = SourceLake(path.parent / "lake", "defs")
    assert lake.read_listing() is not None and "public.pairs" in lake.read_listing().tables

    wrong = "not-the-password"
    monkeypatch.setenv("DEFS_PW", wrong)
    with caplog.at_level("WARNING", logger="cdc_assets.build"):
        unreachable = build_definitions(path)
    assert {key for asset in unreachable.assets for key in asset.keys} == listed
    assert "password authentication failed" in caplog.text and "listed when it last answered" in caplog.text
    assert wrong not in caplog.text

    home = tmp_path / "dagster_home"
    home.mkdir()
    partition = chunk_partition_key(0)
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        instance.add_dynamic_partitions(chunk_partitions("defs", "public.pairs").name, [partition])
    run = dagster_cli(path, home, "asset", "materialize", "--select", "defs/public/pairs", "--partition", partition,
                      password=wrong)  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "no AssetsDefinition objects supply these keys" not in output, output[-3000:]
    assert wrong not in output
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        (record,) = instance.get_runs()
        assert record.status == DagsterRunStatus.FAILURE
        failures = instance.get_records_for_run(record.run_id, of_type=DagsterEventType.STEP_FAILURE).records
        assert failures, output[-3000:]
        error = failures[0].event_log_entry.dagster_event.step_failure_data.error
        assert "source 'defs': cannot connect" in error.message and "password authentication failed" in error.message

    other = path.with_name("other_selection.yaml")
    other.write_text(path.read_text().replace('include: ["public.*"]', 'include: ["public.p*"]'))
    assert 'include: ["public.p*"]' in other.read_text()
    narrowed = build_definitions(other)  # the source does not answer, and the listing was made under "public.*"
    assert {key for asset in narrowed.assets for key in asset.keys} == {stream_asset_key("defs")}


def test_a_failed_batch_is_retried_smaller_and_the_run_log_says_so(config_path, spark, monkeypatch) -> None:
    path, admin_dsn = config_path
    defs = build_definitions(path)
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    instance = DagsterInstance.ephemeral()
    assert materialize([stream_asset], resources=defs.resources, instance=instance).success  # caught up
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        admin.execute("set synchronous_commit = on")
        for i in range(30):  # 30 transactions
            admin.execute("insert into pairs values (%s, 'shrink', %s, 'z')", [2000 + i, i])
    monkeypatch.setenv("CDC_FAULTS", "stream.batch_over=20")
    result = materialize([stream_asset], resources=defs.resources, instance=instance)
    assert result.success  # the step's retry read a smaller batch
    messages = [entry.message or "" for entry in instance.all_logs(result.run_id)]
    errors = []  # the step's failure before its retry (the retry request's cause): the error the UI shows first
    for entry in instance.all_logs(result.run_id):
        error = getattr(entry.dagster_event.event_specific_data, "error", None) if entry.dagster_event else None
        while error is not None:
            errors.append(error.message)
            error = error.cause
    failure = next(m for m in errors if "stream batch of source 'defs' failed" in m)
    assert failure.startswith("cdc_assets.pipeline.StreamBatchError: stream batch of source 'defs' failed")
    assert "failed in phase changelog" in failure and "30 changes in 30 transactions" in failure
    assert "at most 15 changes" in failure and "spark.driver.memory" in failure
    batches = result.asset_materializations_for_node(stream_asset.node_def.name)
    # the slot's rows bound it (begin, insert, commit per transaction) and so did the halved bytes
    assert batches[0].metadata["batch_shrunk"].value is True and 0 < batches[0].metadata["changes"].value <= 15
    assert any("a SMALLER batch than configured (at most 15 changes" in m for m in messages)
    monkeypatch.delenv("CDC_FAULTS")
    assert materialize([stream_asset], resources=defs.resources, instance=instance).success


KILLED_DRIVER_RUN = """
import json, os, sys
import psycopg
from dagster import DagsterInstance, materialize
from dagster._core.instance.ref import InstanceRef
from cdc_assets.assets import chunk_partitions, stream_asset_key, table_asset_key
from cdc_assets.build import build_definitions
from cdc_assets.engine.chunks import chunk_partition_key

path, admin_dsn, home = sys.argv[1:4]
defs = build_definitions(path)
stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
instance = DagsterInstance.from_ref(InstanceRef.from_dir(home))
assert materialize([stream_asset], resources=defs.resources, instance=instance).success  # caught up
with psycopg.connect(admin_dsn, autocommit=True) as admin:
    for i in range(10):
        admin.execute("insert into pairs values (%s, 'jvm', %s, 'killed driver')", [3000 + i, i])
os.environ["CDC_FAULTS"] = "stream.driver_killed_after_changelog"
result = materialize([stream_asset], resources=defs.resources, instance=instance, raise_on_error=False)
table_asset = next(a for a in defs.assets if table_asset_key("defs", "public.pairs") in a.keys)
instance.add_dynamic_partitions(chunk_partitions("defs", "public.pairs").name, [chunk_partition_key(0)])
os.environ["CDC_FAULTS"] = "snapshot.driver_killed_before_read"
snapshot = materialize([table_asset], resources=defs.resources, instance=instance, partition_key=chunk_partition_key(0),
                       raise_on_error=False)
print(json.dumps({"run_id": result.run_id, "success": result.success, "snapshot_run_id": snapshot.run_id,
                  "snapshot_success": snapshot.success}))
"""


def retry_causes(instance: DagsterInstance, run_id: str) -> list[list[str]]:
    """Per retry of the run's step, the messages of its error's chain (the first is what the UI shows first)."""
    retries = [e for e in instance.all_logs(run_id) if e.dagster_event_type == DagsterEventType.STEP_UP_FOR_RETRY]
    causes = []
    for retry in retries:
        chain, error = [], retry.dagster_event.event_specific_data.error
        while error is not None:
            chain.append(error.message)
            error = error.cause
        causes.append(chain)
    return causes


def test_a_stream_or_snapshot_step_whose_driver_jvm_was_killed_is_retried_with_a_new_one(
    config_path, spark, tmp_path
) -> None:
    """The kernel's OOM killer takes the driver JVM (the process's largest child) between a batch's changelog append
    and its MERGE: the step's retry starts a new JVM and applies the batch once, and the retry's cause names the dead
    JVM. Before, each retry failed at once with py4j's "Connection refused" and the run failed naming only that. The
    same for a snapshot step whose JVM died before its read: its cause names the table, the chunks and the dead JVM
    (before: py4j's "Connection refused" only)."""
    path, admin_dsn = config_path
    home = tmp_path / "dagster_home"
    home.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", KILLED_DRIVER_RUN, str(path), f"{admin_dsn} dbname={DATABASE}", str(home)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DEFS_PW": READER_PASSWORD},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        entries = instance.all_logs(outcome["run_id"])
        stream_retries = retry_causes(instance, outcome["run_id"])
        snapshot_entries = instance.all_logs(outcome["snapshot_run_id"])
        snapshot_retries = retry_causes(instance, outcome["snapshot_run_id"])
    assert outcome["success"], [e.message for e in entries][-10:]
    assert len(stream_retries) == 1  # one retry, with a new JVM
    causes = stream_retries[0]
    assert any("failed in phase merge" in c and "the Spark driver's JVM died" in c for c in causes), causes
    assert outcome["snapshot_success"], [e.message for e in snapshot_entries][-10:]
    assert len(snapshot_retries) == 1, snapshot_retries
    first = next(c for c in snapshot_retries[0] if "RetryRequestedFromPolicy" not in c)  # the step's own error
    assert first.startswith(
        "cdc_assets.pipeline.SnapshotDriverError: snapshot of table public.pairs (source 'defs'), chunks 0 failed: "
        "the Spark driver's JVM died"
    ), snapshot_retries
    staged = [e for e in snapshot_entries if e.dagster_event_type == DagsterEventType.ASSET_MATERIALIZATION]
    assert len(staged) == 1 and staged[0].asset_materialization.metadata["rows"].value > 0
    # the retried batch read a smaller batch (bounds halved after a failure); the next runs, here, read the rest
    defs = build_definitions(path)
    stream_asset = next(a for a in defs.assets if stream_asset_key("defs") in a.keys)
    mirror = SourceLake(path.parent / "lake", "defs").table("public.pairs").mirror
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        for _ in range(12):
            if spark.read.format("delta").load(mirror).where("code = 'jvm'").count() == 10:
                break
            assert materialize([stream_asset], resources=defs.resources, instance=instance).success
    rows = spark.read.format("delta").load(mirror).where("code = 'jvm'").select("region", "amount").collect()
    assert sorted((r.region, r.amount) for r in rows) == [(3000 + i, i) for i in range(10)]  # each once


LAG_QUERY = """
query Lag($key: AssetKeyInput!) {
  assetOrError(assetKey: $key) {
    __typename
    ... on Asset {
      assetObservations(limit: 10) {
        timestamp
        metadataEntries {
          label
          ... on IntMetadataEntry { intValue }
          ... on FloatMetadataEntry { floatValue }
        }
      }
    }
  }
  assetCheckExecutions(assetKey: $key, checkName: "lag_within_bound", limit: 5) {
    status
    evaluation { success description }
  }
}
"""


def graphql(port: int, query: str, variables: dict[str, object] | None = None) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        body = json.load(response)
    assert not body.get("errors"), body
    return body["data"]


@contextmanager
def webserver(home: Path, config: Path) -> Iterator[int]:
    """``dagster-webserver`` (what ``dagster dev`` serves the UI with) on ``home``'s instance and the project's root
    ``Definitions`` built from ``config``; yields its port once the code location loaded."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "DAGSTER_HOME": str(home), "CDC_CONFIG": str(config)}
    command = [sys.executable, "-m", "dagster_webserver", "-h", "127.0.0.1", "-p", str(port),
               "-m", "cdc_assets.definitions"]  # fmt: skip
    log = (home / "webserver.log").open("w")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, (home / "webserver.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (home / "webserver.log").read_text()[-4000:]
            try:
                entries = graphql(
                    port,
                    "{ workspaceOrError { ... on Workspace { locationEntries { "
                    "locationOrLoadError { __typename } } } } }",
                )["workspaceOrError"]["locationEntries"]
            except (OSError, urllib.error.URLError):
                entries = []
            if entries and all(e["locationOrLoadError"] for e in entries):
                assert [e["locationOrLoadError"]["__typename"] for e in entries] == ["RepositoryLocation"], entries
                break
            time.sleep(1)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_the_stream_sensor_records_lag_and_fails_the_lag_check_while_the_stream_stands_still(
    config_path, tmp_path
) -> None:
    """The sensor's lag observations and its failing lag check, read back through the UI's GraphQL API from a
    ``dagster-webserver`` on the same instance: what the stream asset's page plots and shows."""
    path, admin_dsn = config_path
    config = stream_config(path, "max_lag_alert_seconds: 2", "cdc-lag.yaml")
    defs = build_definitions(config)
    sensor = defs.resolve_sensor_def("defs_stream_sensor")
    home = tmp_path / "dagster_home"
    home.mkdir()
    instance = DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    dsn = f"{admin_dsn} dbname={DATABASE}"
    with psycopg.connect(dsn, autocommit=True) as admin:  # no stream run: the slot stands still, writes go on
        admin.execute("set synchronous_commit = on")
        for i in range(2):
            admin.execute("insert into pairs values (%s, 'lag', %s, 'z')", [3000 + i, i])
            with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context:
                result = sensor.evaluate_tick(context)
            assert result.run_requests  # a run would be requested; none runs
            for event in result.asset_events:  # what the daemon stores for a sensor's asset events
                instance.report_runless_asset_event(event)
            time.sleep(3)
    instance.dispose()
    key = stream_asset_key("defs")
    with webserver(home, config) as port:
        data = graphql(port, LAG_QUERY, {"key": {"path": key.path}})
    asset = data["assetOrError"]
    assert asset["__typename"] == "Asset", asset
    observations = sorted(asset["assetObservations"], key=lambda o: float(o["timestamp"]))
    lags = []
    for observation in observations:
        entries = {e["label"]: e.get("intValue", e.get("floatValue")) for e in observation["metadataEntries"]}
        lags.append((int(entries["lag_bytes"]), float(entries["lag_seconds"])))
    assert len(lags) == 2 and lags[1][0] > lags[0][0] and lags[1][1] > lags[0][1] > 0, lags
    executions = data["assetCheckExecutions"]  # newest first
    assert executions and executions[0]["status"] == "FAILED", executions
    evaluation = executions[0]["evaluation"]
    assert evaluation["success"] is False and "max_lag_alert_seconds=2" in (evaluation["description"] or "")


def test_the_stream_sensor_gives_a_silent_source_its_timeout_then_fails_the_lag_check_and_requests_a_run(
    config_path,
) -> None:
    """A server that takes the connection and never answers holds a sensor tick ``stream.sensor_timeout_seconds``,
    not its own connect_timeout (past Dagster's 60-second limit of a tick, which would fail the tick with no word
    of the source): the lag check fails saying the lag is unknown and why, and a run is requested (it reads the
    stream itself and names the cause if the source is down)."""
    path, _ = config_path
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # the kernel completes the handshake; nothing ever reads or answers
        hung = stream_config(path, "sensor_timeout_seconds: 3", "cdc-sensor-timeout.yaml")
        hung.write_text(
            hung.read_text().replace(f"port: {PG_PORT}", f"port: {silent.getsockname()[1]}")
            .replace('password: "${DEFS_PW}"', 'password: "${DEFS_PW}", connect_timeout: 120')
        )  # fmt: skip
        assert "connect_timeout: 120" in hung.read_text()
        sensor = build_stream_sensor("defs", "defs_stream", 5)
        with DagsterInstance.ephemeral() as instance:
            resources = {"cdc": CdcResource(config_path=str(hung))}
            started = time.monotonic()
            with build_sensor_context(instance=instance, resources=resources) as context:
                result = sensor.evaluate_tick(context)
            elapsed = time.monotonic() - started
    assert elapsed < 40, elapsed  # the source's connect_timeout (120 s) did not hold the tick
    (request,) = result.run_requests
    assert "source 'defs' did not answer within 3 s (stream.sensor_timeout_seconds)" in request.tags["cdc/reason"]
    (evaluation,) = result.asset_events
    assert isinstance(evaluation, AssetCheckEvaluation) and evaluation.check_name == "lag_within_bound"
    assert evaluation.passed is False
    assert "lag unknown, the source did not answer within 3 s" in (evaluation.description or ""), evaluation
    assert READER_PASSWORD not in repr(result)


def run_offsets_cli(config: Path, home: Path, *options: str) -> tuple[int, dict, str]:
    env = {**os.environ, "DAGSTER_HOME": str(home), "DEFS_PW": READER_PASSWORD}
    result = subprocess.run(
        [sys.executable, "-m", "cdc_assets.cli", "offsets", "--config", str(config), *options],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return result.returncode, json.loads(result.stdout or "{}"), result.stdout + result.stderr


def test_the_offsets_cli_prints_every_sources_recorded_offset_and_lag(config_path, tmp_path: Path) -> None:
    """``python -m cdc_assets.cli offsets``: the offset the ``change_offset`` job recorded (who and why), its
    position, the acknowledged position and the lag, as JSON; an unreachable source gets an error naming it (no
    credential) while the others are listed, and the exit status says so."""
    path, admin_dsn = config_path
    home = tmp_path / "dagster_home"
    home.mkdir()
    with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
        confirmed, _ = slot_position(admin, DATABASE)
    lsn = format_lsn(confirmed)
    defs = build_definitions(path)
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
        offset = {"lsn": lsn, "changed_by": "operator", "reason": "offsets cli test"}
        run = defs.get_job_def("defs_change_offset").execute_in_process(
            run_config={"ops": {"defs_record_offset": {"config": offset}}}, instance=instance
        )
        assert run.success
    status, report, output = run_offsets_cli(path, home)
    assert status == 0, output
    (entry,) = report["sources"]
    assert (entry["source"], entry["kind"]) == ("defs", "postgres")
    fields = entry["recorded"]["fields"]
    assert fields["lsn"] == lsn and fields["changed_by"] == "operator" and fields["reason"] == "offsets cli test"
    assert entry["recorded"]["run_id"] == run.run_id
    assert entry["position"] == lsn and entry["acknowledged"] == lsn
    assert isinstance(entry["lag_bytes"], int) and entry["lag_bytes"] >= 0 and "error" not in entry
    # a second source whose server does not answer
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    broken = tmp_path / "two.yaml"
    broken.write_text(
        path.read_text()
        + f"""  - name: gone
    kind: postgres
    connection: {{host: 127.0.0.1, port: {closed_port}, dbname: nowhere, user: someone, password: "${{DEFS_PW}}",
                 connect_timeout: 3}}
    slot: gone
    publication: gone
    include: ["public.*"]
"""
    )
    status, report, output = run_offsets_cli(broken, home)
    assert status == 1, output
    defs_entry, gone = report["sources"]
    assert defs_entry["position"] == lsn and "error" not in defs_entry
    assert gone["source"] == "gone" and gone["recorded"] is None and "gone" in gone["error"], gone
    assert READER_PASSWORD not in output
    # a server that takes the connection and never answers (a hung or saturated one) is given --timeout seconds,
    # not its own minute of connect_timeout: the report of the others comes out all the same
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)  # the kernel completes the handshake; nothing ever reads or answers
        hung = tmp_path / "hung.yaml"
        hung.write_text(
            broken.read_text().replace(f"port: {closed_port}", f"port: {silent.getsockname()[1]}")
            .replace("connect_timeout: 3", "connect_timeout: 120")
        )  # fmt: skip
        started = time.monotonic()
        status, report, output = run_offsets_cli(hung, home, "--timeout", "4")
        elapsed = time.monotonic() - started
    assert status == 1, output
    defs_entry, gone = report["sources"]
    assert defs_entry["position"] == lsn and "error" not in defs_entry
    assert "'gone' did not answer within 4 s (--timeout)" in gone["error"], gone
    assert elapsed < 100, elapsed  # the source's own connect_timeout (120 s) did not hold the command
    assert READER_PASSWORD not in output
    status, _, output = run_offsets_cli(path, home, "--timeout", "0")
    assert status == 2 and "--timeout must be a number of seconds above 0, not '0'" in output, output
