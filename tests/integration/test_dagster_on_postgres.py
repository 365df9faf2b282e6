"""The Dagster instance on PostgreSQL (``dagster_home_postgres/dagster.yaml``, dagster-postgres): runs, the event log
and schedule storage in a database of their own on the session's PostgreSQL server, the connection from the
environment only.

- The definitions' planner sensor, a chunk's snapshot run and the stream job run on that instance; the mirror ends
  equal to its source, and the runs, the materializations (the stream asset's offset among them) and the sensor's
  dynamic partitions are rows of that database.
- The lake-write pool holds one slot there (``concurrency.pools.default_limit: 1``): a second run's claim is
  blocked until the first frees it; the run queue's settings are those of the default instance.
- The storage password is in no stored or shown form of the instance (its ref, which runs receive; its info).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml
from dagster import DagsterInstance, build_sensor_context, materialize
from dagster._core.instance.ref import InstanceRef
from dagster._serdes import serialize_value
from psycopg import sql

from cdc_assets.assets import lake_pool, recorded_offset, table_asset_key
from cdc_assets.build import build_definitions
from cdc_assets.config import load_config
from cdc_assets.engine.chunks import chunk_partition_key
from cdc_assets.lake.spark import SHORT_LIVED_DRIVER_OPTIONS
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from tests.integration.support import PG_PORT, READER_PASSWORD, create_source, drop_source, mirror_rows, source_rows

ROOT = Path(__file__).resolve().parents[2]
DATABASE = "pipe_dagster_pg"
STORAGE_DATABASE, STORAGE_ROLE = "cdc_dagster_storage", "cdc_dagster"
CONFIG = """
lake_root: {lake}
spark: {{master: "local[2]", conf: {{spark.driver.extraJavaOptions: "{driver_options}"}}}}
sources:
  - name: dgpg
    kind: postgres
    connection: {{host: 127.0.0.1, port: {port}, dbname: {database}, user: {database}_reader,
                 password: "${{DGPG_PW}}"}}
    slot: {database}
    publication: {database}
    chunk_size: 100
    include: ["public.pairs"]
"""


@pytest.fixture()
def storage_password(postgres_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database and a role for Dagster's storage, apart from every source database; the ``DAGSTER_PG_*``
    variables the instance file reads."""
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres dbname=postgres"
    password = secrets.token_hex(12)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(STORAGE_DATABASE)))
        admin.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(STORAGE_ROLE)))
        admin.execute(
            sql.SQL("create role {} login password {}").format(sql.Identifier(STORAGE_ROLE), sql.Literal(password))
        )
        admin.execute(
            sql.SQL("create database {} owner {}").format(
                sql.Identifier(STORAGE_DATABASE), sql.Identifier(STORAGE_ROLE)
            )
        )
    for name, value in {
        "DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(PG_PORT), "DAGSTER_PG_DB": STORAGE_DATABASE,
        "DAGSTER_PG_USER": STORAGE_ROLE, "DAGSTER_PG_PASSWORD": password,
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    yield password
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(STORAGE_DATABASE)))
        admin.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(STORAGE_ROLE)))


def storage_count(postgres_server: dict[str, str], query: str) -> int:
    dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres dbname={STORAGE_DATABASE}"
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def test_the_postgres_instance_differs_from_the_default_only_in_its_storage() -> None:
    default = yaml.safe_load((ROOT / "dagster_home" / "dagster.yaml").read_text())
    on_postgres = yaml.safe_load((ROOT / "dagster_home_postgres" / "dagster.yaml").read_text())
    assert "storage" not in default and set(on_postgres.pop("storage")) == {"postgres"}
    assert on_postgres == default


def test_snapshot_and_stream_run_on_an_instance_stored_in_postgres(
    postgres_server: dict[str, str], storage_password: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spark
) -> None:
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    create_source(admin_dsn, DATABASE)
    monkeypatch.setenv("DGPG_PW", READER_PASSWORD)
    try:
        with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
            admin.execute("set synchronous_commit = on")
            admin.execute("insert into pairs select g, 'p' || g, g, 'z' from generate_series(1, 250) g")
        path = tmp_path / "cdc.yaml"
        path.write_text(CONFIG.format(
            lake=tmp_path / "lake", port=PG_PORT, database=DATABASE, driver_options=SHORT_LIVED_DRIVER_OPTIONS
        ))  # fmt: skip
        home = tmp_path / "dagster_home"
        home.mkdir()
        shutil.copy(ROOT / "dagster_home_postgres" / "dagster.yaml", home / "dagster.yaml")
        defs = build_definitions(path)
        with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as instance:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
            assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
            ref = serialize_value(instance.get_ref())  # what every run receives
            assert "DAGSTER_PG_PASSWORD" in ref and storage_password not in ref
            assert storage_password not in instance.info_str()  # the UI's Deployment > Configuration page

            planner = defs.resolve_sensor_def("dgpg_planner_sensor")
            with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context:
                planned = planner.evaluate_tick(context)
            for request in planned.dynamic_partitions_requests:  # what the daemon does with them
                instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            keys = [chunk_partition_key(i) for i in range(3)]  # 250 rows, chunk_size 100
            assert set(keys) <= {key for r in planned.dynamic_partitions_requests for key in r.partition_keys}
            table_asset = next(a for a in defs.assets if table_asset_key("dgpg", "public.pairs") in a.keys)
            for key in keys:  # the chunk's run without its check (that one waits for the stream)
                run = materialize([table_asset], partition_key=key, resources=defs.resources, instance=instance)
                assert run.success
                with psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True) as admin:
                    admin.execute("set synchronous_commit = on")  # writes between the chunks: the stream has them
                    admin.execute("update pairs set label = label || '+' where region %% 7 = %s", [keys.index(key)])
                    admin.execute("delete from pairs where region = %s", [200 + keys.index(key)])
            stream_job = defs.resolve_job_def("dgpg_stream")
            config = load_config(path)
            pipeline = PostgresPipeline(config, config.sources[0])
            table = pipeline.prepare()["public.pairs"]
            stream_runs = 0
            for _ in range(3):  # a batch reconciles the windows whose high watermark it passed
                assert stream_job.execute_in_process(instance=instance).success
                stream_runs += 1
                if mirror_rows(spark, str(tmp_path / "lake" / "dgpg" / "public.pairs" / "mirror"), table) == (
                    source_rows(config.sources[0], table)
                ):
                    break
            else:
                pytest.fail("the mirror did not reach its source after three stream runs")
            offset = recorded_offset(instance, "dgpg")
            assert offset is not None and offset["slot"] == DATABASE

            # the pool of lake writes: one slot, held in this storage
            pool = lake_pool("dgpg")
            assert instance.get_concurrency_config().pool_config.default_pool_limit == 1
            assert instance.get_concurrency_config().run_queue_config.max_concurrent_runs == 5
            storage = instance.event_log_storage
            assert storage.get_concurrency_info(pool).slot_count == 1  # set up by the stream runs' step
            assert storage.claim_concurrency_slot(pool, "run-a", "write").is_claimed
            assert not storage.claim_concurrency_slot(pool, "run-b", "write").is_claimed  # blocked: one slot
            storage.free_concurrency_slot_for_step("run-a", "write")
            assert storage.claim_concurrency_slot(pool, "run-b", "write").is_claimed
            storage.free_concurrency_slot_for_step("run-b", "write")
            runs = len(instance.get_run_records())
        # what the instance wrote is in the database, not under DAGSTER_HOME
        assert runs == len(keys) + stream_runs
        assert storage_count(postgres_server, "select count(*) from runs") == runs
        assert (
            storage_count(
                postgres_server, "select count(*) from event_logs where dagster_event_type = 'ASSET_MATERIALIZATION'"
            )
            >= len(keys) + 1
        )
        assert storage_count(postgres_server, "select count(*) from dynamic_partitions") >= len(keys)
        assert (
            storage_count(postgres_server, f"select count(*) from concurrency_limits where concurrency_key = '{pool}'")
            == 1
        )
        assert not list(home.rglob("*.db")), list(home.rglob("*.db"))  # no SQLite storage beside it
    finally:
        drop_source(admin_dsn, DATABASE)
