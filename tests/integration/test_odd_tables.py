"""Every table a database holds (issue 25): one odd table never takes down the others.

A source with a table without a key, tables whose names collide once made valid for Dagster (``order-items`` and
``order_items``), a table and columns with spaces and punctuation, a non-ASCII table name, a schema with a dot and a
partitioned table (publication ``FOR ALL TABLES`` without ``publish_via_partition_root``, so pgoutput names the
partitions) beside an ordinary table:
- the definitions load (also through ``dagster definitions validate``); the keyless table is reported by name with
  its reason and fix (a failing ``table_is_captured`` check, the planner's skip reason, the stream's metadata);
- every capturable table is snapshotted and streamed exactly under a concurrent writer;
- a partition attached while streaming: its rows and changes reach the root's mirror exactly once;
- a table created while a stream run is in flight, and one added under a live workload (issue 28): snapshotted
  chunk by chunk while the other mirrors stay current, then exact.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest
from dagster import AssetKey, AssetSelection, DagsterInstance, build_sensor_context, materialize
from psycopg import sql

from cdc_assets.build import build_definitions
from cdc_assets.engine.names import dagster_part
from cdc_assets.engine.partitions import repartition_reason
from cdc_assets.sources.postgres.pipeline import PostgresPipeline
from cdc_assets.sources.postgres.stream import current_flush_lsn
from tests.integration.support import PG_PORT, READER_PASSWORD, drop_source, mirror_rows
from tests.integration.test_pipeline_guarantees import assert_exact, catch_up, stream_once

ROOT = Path(__file__).resolve().parents[2]
DATABASE = "odd_tables"
ROLE = f"{DATABASE}_reader"
ORDER_ITEMS = "Order Items"
GROESSE = "Größe"
SCHEMA_SQL = f"""
create table plain (id bigint primary key, v text);
create table "{ORDER_ITEMS}" (id int primary key, "unit price (€)" numeric(10,2), "a,b=c;d{{e}}" text,
                              "tab\tnew" int, "v.1" text, "quote""d" text);
create table backtick (id int primary key, "a`b" text);
create table "order-items" (id int primary key, v text);
create table order_items (id int primary key, v text);
create table "{GROESSE}" (id int primary key, "Maß" text);
create schema "my.schema";
create table "my.schema"."t.1" (id int primary key, v text);
create table nolog (a int, b text);
create table meas (id int primary key, v text) partition by range (id);
create table meas_low partition of meas for values from (0) to (1000);
create table meas_high partition of meas for values from (1000) to (2000);
insert into plain select g, 'p' || g from generate_series(1, 900) g;
insert into "{ORDER_ITEMS}"
select g, g / 3.0, 'x,' || g || '=y', g, 'dot' || g, 'q' || g from generate_series(1, 700) g;
insert into "order-items" select g, 'dash' || g from generate_series(1, 300) g;
insert into order_items select g, 'under' || g from generate_series(1, 300) g;
insert into "{GROESSE}" select g, 'ß' || g from generate_series(1, 300) g;
insert into "my.schema"."t.1" select g, 'dot' || g from generate_series(1, 300) g;
insert into nolog select g, 'n' || g from generate_series(1, 100) g;
insert into meas select g, 'm' || g from generate_series(1, 1999, 2) g;
"""
CONFIG = """
lake_root: {lake}
spark: {{master: "local[2]"}}
sources:
  - name: odd
    kind: postgres
    connection: {{host: 127.0.0.1, port: {port}, dbname: odd_tables, user: odd_tables_reader, password: "${{ODD_PW}}"}}
    slot: odd_tables
    publication: odd_tables
    chunk_size: 400
    include: ["public.*", '"my.schema".*']
    stream: {{interval_seconds: 5}}
"""


@pytest.fixture()
def source(postgres_server: dict[str, str], tmp_path: Path) -> Iterator[tuple[psycopg.Connection, str, Path]]:
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    drop_source(admin_dsn, DATABASE)
    with psycopg.connect(f"{admin_dsn} dbname=postgres", autocommit=True) as root:
        root.execute(sql.SQL("create database {}").format(sql.Identifier(DATABASE)))
        root.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(ROLE)))
        root.execute(
            sql.SQL("create role {} login replication password {}").format(
                sql.Identifier(ROLE), sql.Literal(READER_PASSWORD)
            )
        )
        root.execute(sql.SQL("alter role {} set default_transaction_read_only = on").format(sql.Identifier(ROLE)))
    admin = psycopg.connect(f"{admin_dsn} dbname={DATABASE}", autocommit=True)
    admin.execute("set synchronous_commit = on")
    admin.execute(SCHEMA_SQL)
    for schema in ("public", "my.schema"):
        admin.execute(
            sql.SQL("grant usage on schema {s} to {r}; grant select on all tables in schema {s} to {r}").format(
                s=sql.Identifier(schema), r=sql.Identifier(ROLE)
            )
        )
    admin.execute(sql.SQL("create publication {} for all tables").format(sql.Identifier(DATABASE)))
    admin.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [DATABASE])
    path = tmp_path / "cdc.yaml"
    path.write_text(CONFIG.format(lake=tmp_path / "lake", port=PG_PORT))
    os.environ["ODD_PW"] = READER_PASSWORD
    try:
        yield admin, admin_dsn, path
    finally:
        admin.close()
        drop_source(admin_dsn, DATABASE)


CAPTURED = [
    '"my.schema"."t.1"', f"public.{ORDER_ITEMS}", f"public.{GROESSE}", "public.meas", "public.order-items",
    "public.order_items", "public.plain",
]  # fmt: skip


def test_definitions_load_with_every_odd_name_and_report_the_keyless_table(source) -> None:
    """Failed on the old code: the keyless table switched off every table of the source, and ``Order Items`` made
    the code location fail to load ("is not a valid name in Dagster")."""
    _, _, path = source
    defs = build_definitions(path)
    keys = {key for asset in defs.assets for key in asset.keys}
    for name in ("plain", ORDER_ITEMS, GROESSE, "meas", "order-items", "order_items", "nolog"):
        assert AssetKey(["odd", "public", dagster_part(name)]) in keys, name
    assert AssetKey(["odd", dagster_part("my.schema"), dagster_part("t.1")]) in keys
    assert AssetKey(["odd", "public", "meas_low"]) not in keys  # captured through its root only
    assert AssetKey(["odd", "public", "order_items"]) != AssetKey(["odd", "public", dagster_part("order-items")])
    checks = {(k.asset_key, k.name) for c in defs.asset_checks for k in c.check_keys}
    assert (AssetKey(["odd", "public", "nolog"]), "table_is_captured") in checks
    assert (AssetKey(["odd", "public", "nolog"]), "chunk_matches_source") not in checks
    nolog = next(a for a in defs.assets if AssetKey(["odd", "public", "nolog"]) in a.keys)
    description = nolog.descriptions_by_key[AssetKey(["odd", "public", "nolog"])]
    assert "NOT CAPTURED" in description and "has no primary key" in description and "surrogate_key" in description
    assert not nolog.is_executable
    odd = next(a for a in defs.assets if AssetKey(["odd", "public", dagster_part(ORDER_ITEMS)]) in a.keys)
    assert ORDER_ITEMS in (odd.descriptions_by_key[AssetKey(["odd", "public", dagster_part(ORDER_ITEMS)])] or "")

    planner = next(s for s in defs.sensors if s.name == "odd_planner_sensor")
    instance = DagsterInstance.ephemeral()
    with build_sensor_context(instance=instance, resources=defs.resources, definitions=defs) as context:
        result = planner.evaluate_tick(context)
    requested = {tuple(k.path) for r in result.run_requests for k in r.asset_selection}
    assert len(requested) == len(CAPTURED)  # every capturable table's initial snapshot
    assert ("odd", "public", "nolog") not in requested
    evaluations = [e for e in result.asset_events if getattr(e, "check_name", None) == "table_is_captured"]
    assert [(tuple(e.asset_key.path), e.passed) for e in evaluations] == [
        (("odd", "public", "backtick"), False),
        (("odd", "public", "nolog"), False),
    ]
    assert "public.backtick is not captured: has column(s) ['a`b'] whose names hold a backtick" in (
        evaluations[0].description
    )
    assert "public.nolog is not captured: has no primary key" in evaluations[1].description
    for request in result.dynamic_partitions_requests:  # as the daemon applies them
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    with build_sensor_context(
        instance=instance, resources=defs.resources, definitions=defs, cursor=result.cursor
    ) as context:
        again = planner.evaluate_tick(context)  # once planned: the skip reason names the table, reason and fix
    assert again.skip_message and "2 table(s) NOT captured: table public.backtick" in again.skip_message
    assert "table public.nolog is not captured: has no primary key" in again.skip_message
    assert "surrogate_key" in again.skip_message
    assert not again.asset_events  # the check's evaluation is recorded once per reason

    # running the check asks the source again: it fails naming table, reason and fix
    check = next(c for c in defs.asset_checks if (AssetKey(["odd", "public", "nolog"]), "table_is_captured") in {
        (k.asset_key, k.name) for k in c.check_keys
    })  # fmt: skip
    ran = materialize([nolog, check], selection=AssetSelection.checks(check), resources=defs.resources,
                      instance=instance, raise_on_error=False)  # fmt: skip
    (evaluation,) = ran.get_asset_check_evaluations()
    assert not evaluation.passed and "has no primary key" in (evaluation.description or "")

    env = {**os.environ, "CDC_CONFIG": str(path)}
    validated = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-m", "cdc_assets.definitions"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert validated.returncode == 0, validated.stderr[-2000:]
    assert "public.nolog" in validated.stderr + validated.stdout  # the warning names it


class Writer(threading.Thread):
    """Inserts, updates, deletes on every odd table (and rows into the keyless one) until stopped."""

    pause = 0.01  # seconds between steps

    def __init__(self, dsn: str, seed: int = 25) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute("set synchronous_commit = on")
        self.random = random.Random(seed)
        self.stop = threading.Event()
        self.done = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.step()
                self.done += 1
                time.sleep(self.pause)
        except BaseException as error:  # reported by the test
            self.error = error

    def step(self) -> None:
        r, c = self.random, self.conn
        n = r.randrange(1, 2000)
        table = r.choice(
            [sql.Identifier("public", t) for t in (ORDER_ITEMS, "order-items", "order_items", GROESSE, "plain")]
            + [sql.Identifier("my.schema", "t.1"), sql.Identifier("public", "meas")]
        )
        choice = r.random()
        if table == sql.Identifier("public", ORDER_ITEMS):
            if choice < 0.4:
                statement = sql.SQL(
                    'update {} set "unit price (€)" = %s, "a,b=c;d{{e}}" = %s, "v.1" = %s, "quote""d" = %s '
                    "where id = %s"
                )
                c.execute(statement.format(table), [n / 7, f"w,{n}=", f"v{n}", f"q{n}", n % 800])
            elif choice < 0.7:
                statement = sql.SQL("insert into {} values (%s, 1, 'new', %s, 'n', 'n') on conflict do nothing")
                c.execute(statement.format(table), [n, n])
            else:
                c.execute(sql.SQL("delete from {} where id = %s").format(table), [n % 800])
        elif table == sql.Identifier("public", GROESSE):
            c.execute(sql.SQL('update {} set "Maß" = %s where id = %s').format(table), [f"w{n}", n % 300])
        elif choice < 0.4:
            c.execute(sql.SQL("update {} set v = %s where id = %s").format(table), [f"w{n}", n])
        elif choice < 0.7:
            c.execute(sql.SQL("insert into {} values (%s, 'new') on conflict do nothing").format(table), [n])
        elif choice < 0.8 and table == sql.Identifier("public", "meas"):  # a row moving to the other partition
            c.execute(
                "update meas set id = (id + 1000) %% 2000 where id = %s "
                "and not exists (select from meas where id = (%s + 1000) %% 2000)",
                [n, n],
            )
        else:
            c.execute(sql.SQL("delete from {} where id = %s").format(table), [n])
        if choice < 0.05:
            c.execute("insert into nolog values (%s, 'w')", [n])


class Ticker(Writer):
    """A live workload: bumps ``plain`` row 1's tick and changes rows of ``plain`` and, once it exists, of
    ``added_live``, until stopped; ``done`` is the last tick committed."""

    pause = 0.02

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn, seed=28)
        self.added = threading.Event()

    def step(self) -> None:
        n = self.random.randrange(2, 1200)
        with self.conn.transaction():
            self.conn.execute("update plain set v = %s where id = 1", [f"tick {self.done + 1}"])
            self.conn.execute("insert into plain values (%s, 'live') on conflict (id) do update set v = 'up'", [n])
        if self.added.is_set():
            if n % 3:
                self.conn.execute("update added_live set v = %s where id = %s", [f"w{n}", n % 900])
            else:
                self.conn.execute("delete from added_live where id = %s", [n % 900])


def test_a_table_added_under_a_live_workload_ends_exact_while_the_other_mirrors_stay_current(source, spark) -> None:
    """Issue #28: a table created at the source while writes go on to it and to a captured table. Its chunks are
    snapshotted one by one (another run's work) while the stream run in flight goes on: after each chunk a batch
    brings the captured table's mirror up to the tick committed before that chunk started (the stream never paused
    for the snapshot), and the batch meeting the new table captures it. Once the writer stops, every mirror equals
    its source."""
    admin, admin_dsn, path = source
    from cdc_assets.config import load_config

    loaded = load_config(path)
    config = replace(loaded, sources=(replace(loaded.sources[0], include=("public.plain", "public.added_live")),))
    in_flight = PostgresPipeline(config, config.sources[0])
    plain = in_flight.prepare()["public.plain"]
    in_flight.snapshot(spark, plain, list(range(len(in_flight.plan(plain).chunks))), "initial")
    recorded = catch_up(in_flight, spark, None)
    ticker = Ticker(f"{admin_dsn} dbname={DATABASE}")
    ticker.start()
    try:
        admin.execute("create table added_live (id int primary key, v text)")
        admin.execute(sql.SQL("grant select on added_live to {}").format(sql.Identifier(ROLE)))
        admin.execute("insert into added_live select g, 'a' || g from generate_series(1, 800) g")
        ticker.added.set()
        snapshotting = PostgresPipeline(config, config.sources[0])
        added = snapshotting.prepare()["public.added_live"]
        chunks = list(range(len(snapshotting.plan(added).chunks)))
        assert len(chunks) == 2  # 800 rows in chunks of 400
        captured_by: list[str] = []
        for chunk in chunks:
            before = ticker.done
            with in_flight.connect() as conn:
                target = current_flush_lsn(conn)
            snapshotting.snapshot(spark, added, [chunk], f"added-{chunk}")
            for _ in range(5):  # the writer goes on: batches until the stream has passed what was there before
                recorded, report = stream_once(in_flight, spark, recorded)
                captured_by += report.newly_captured
                if in_flight.position(recorded) >= target:
                    break
            mirror = spark.read.format("delta").load(in_flight.lake.table("public.plain").mirror)
            (row,) = mirror.where("id = 1").select("v").collect()
            assert int(row.v.split()[1]) >= before, (chunk, row.v, before)
        assert ticker.error is None, ticker.error
        assert ticker.done > 200, ticker.done  # the workload really ran beside the snapshot
    finally:
        ticker.stop.set()
        ticker.join()
        ticker.conn.close()
    assert captured_by == ["public.added_live"]
    recorded = catch_up(in_flight, spark, recorded)
    assert sorted(in_flight.tables) == ["public.added_live", "public.plain"]
    assert_exact(in_flight, spark, config)


def assert_no_duplicate_keys(pipeline: PostgresPipeline, spark) -> None:
    for name, table in pipeline.tables.items():
        frame = spark.read.format("delta").load(pipeline.lake.table(name).mirror)
        assert frame.count() == len(mirror_rows(spark, pipeline.lake.table(name).mirror, table)), name


def test_every_capturable_table_is_mirrored_exactly_under_a_concurrent_writer(source, spark) -> None:
    _, admin_dsn, path = source
    from cdc_assets.config import load_config

    config = load_config(path)
    pipeline = PostgresPipeline(config, config.sources[0])
    tables = pipeline.prepare()
    assert sorted(tables) == sorted(CAPTURED)
    assert [t.qualified_name for t in pipeline.skipped()] == ["public.backtick", "public.nolog"]
    writer = Writer(f"{admin_dsn} dbname={DATABASE}")
    writer.start()
    recorded = None
    try:
        for step, (_name, table) in enumerate(sorted(tables.items())):
            pipeline.snapshot(spark, table, list(range(len(pipeline.plan(table).chunks))), f"run{step}")
            if step % 3 == 2:  # a batch every third table: each batch applies changes to every table
                recorded, report = stream_once(pipeline, spark, recorded)
                assert "no primary key" in report.skipped_tables["public.nolog"]
    finally:
        writer.stop.set()
        writer.join(30)
    assert writer.error is None, writer.error
    assert writer.done > 50
    catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)
    assert_no_duplicate_keys(pipeline, spark)
    names = {t.name for t in tables.values()}
    assert {ORDER_ITEMS, GROESSE, "t.1"} <= names
    mirror = spark.read.format("delta").load(pipeline.lake.table(f"public.{ORDER_ITEMS}").mirror)
    real_names = {"unit price (€)", "a,b=c;d{e}", "tab\tnew", "v.1", 'quote"d'}
    assert real_names <= set(mirror.columns)


def test_a_partition_attached_while_streaming_reaches_the_roots_mirror_exactly_once(source, spark) -> None:
    admin, _, path = source
    from cdc_assets.config import load_config

    loaded = load_config(path)
    config = replace(loaded, sources=(replace(loaded.sources[0], include=("public.meas",)),))
    pipeline = PostgresPipeline(config, config.sources[0])
    meas = pipeline.prepare()["public.meas"]
    pipeline.snapshot(spark, meas, list(range(len(pipeline.plan(meas).chunks))), "initial")
    recorded = catch_up(pipeline, spark, None)
    before = pipeline.partitions(meas)
    assert before == ["public.meas_high", "public.meas_low"]
    # a table filled before it is attached (its rows enter the root without a change), then attached while streaming
    admin.execute("create table meas_next (id int primary key, v text)")
    admin.execute("insert into meas_next select g, 'next' || g from generate_series(2000, 2499) g")
    recorded, _ = stream_once(pipeline, spark, recorded)
    admin.execute("alter table meas attach partition meas_next for values from (2000) to (3000)")
    admin.execute("update meas set v = 'changed' where id between 2000 and 2049")  # changes named meas_next
    admin.execute("insert into meas values (2600, 'inserted'), (2601, 'inserted')")
    admin.execute("delete from meas where id between 2100 and 2109")
    recorded, _ = stream_once(pipeline, spark, recorded)
    # the planner sees the new partition (its cursor holds the partitions) and requests every chunk again
    reason = repartition_reason(before, pipeline.partitions(meas))
    assert reason is not None and "public.meas_next attached" in reason
    pipeline.snapshot(spark, meas, list(range(len(pipeline.plan(meas).chunks))), "repartition")
    admin.execute("update meas set v = 'after' where id between 2200 and 2209")
    recorded = catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)
    assert_no_duplicate_keys(pipeline, spark)
    mirror = spark.read.format("delta").load(pipeline.lake.table("public.meas").mirror)
    assert mirror.where("id >= 2000").count() == 500 - 10 + 2
    assert mirror.where("v = 'changed'").count() == 50 and mirror.where("v = 'after'").count() == 10
    # a partition detached: its rows leave the root without a change; the planner has every chunk read again
    partitions = pipeline.partitions(meas)
    admin.execute("alter table meas detach partition meas_high")
    admin.execute("update meas_high set v = 'detached, not captured' where id < 1100")
    reason = repartition_reason(partitions, pipeline.partitions(meas))
    assert reason is not None and "public.meas_high detached" in reason
    pipeline.snapshot(spark, meas, list(range(len(pipeline.plan(meas).chunks))), "detached")
    recorded = catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)
    mirror = spark.read.format("delta").load(pipeline.lake.table("public.meas").mirror)
    assert mirror.where("id between 1000 and 1999").count() == 0 and mirror.where("id < 1000").count() > 0
    # a TRUNCATE of the root: pgoutput lists every partition, and the root's mirror is truncated (once)
    admin.execute("truncate meas")
    admin.execute("insert into meas values (5, 'five'), (2005, 'later')")
    catch_up(pipeline, spark, recorded)
    assert_exact(pipeline, spark, config)
    assert spark.read.format("delta").load(pipeline.lake.table("public.meas").mirror).count() == 2


def test_a_table_created_while_a_stream_run_is_in_flight_loses_no_change(source, spark) -> None:
    """A run resolves its tables when it starts. A table created later in the ``FOR ALL TABLES`` publication and
    matching the include patterns: another process (the snapshot run) captures it and reads its chunks, then rows
    change, and the run that is still in flight streams on. Its batch meets the new table, resolves its tables
    again and applies those changes (before, it left them out, the slot moved past them, and the mirror kept the
    snapshot's values: lost updates). A keyless table created the same way is resolved once and then skipped."""
    admin, _, path = source
    from cdc_assets.config import load_config

    loaded = load_config(path)
    config = replace(loaded, sources=(replace(loaded.sources[0], include=("public.plain", "public.fresh*")),))
    in_flight = PostgresPipeline(config, config.sources[0])
    assert sorted(in_flight.prepare()) == ["public.plain"]
    plain = in_flight.tables["public.plain"]
    in_flight.snapshot(spark, plain, list(range(len(in_flight.plan(plain).chunks))), "initial")
    recorded = catch_up(in_flight, spark, None)
    admin.execute("create table fresh (id int primary key, v text)")
    admin.execute("create table fresh_log (a int, b text)")  # no key: skipped once seen
    admin.execute(sql.SQL("grant select on fresh, fresh_log to {}").format(sql.Identifier(ROLE)))
    admin.execute("insert into fresh select g, 'new' || g from generate_series(1, 300) g")
    # the snapshot run of the new table (its own process: its own resolution of the tables)
    snapshotting = PostgresPipeline(config, config.sources[0])
    fresh = snapshotting.prepare()["public.fresh"]
    snapshotting.snapshot(spark, fresh, list(range(len(snapshotting.plan(fresh).chunks))), "fresh")
    admin.execute("update fresh set v = 'changed after its snapshot' where id <= 50")
    admin.execute("delete from fresh where id > 290")
    admin.execute("insert into fresh_log values (1, 'x')")
    admin.execute("update plain set v = 'plain too' where id <= 5")
    recorded, report = stream_once(in_flight, spark, recorded)
    recorded = catch_up(in_flight, spark, recorded)
    # the next run (the tables resolved when it starts) finds every change of both tables in their mirrors
    next_run = PostgresPipeline(config, config.sources[0])
    recorded = catch_up(next_run, spark, recorded)
    assert sorted(next_run.tables) == ["public.fresh", "public.plain"]
    assert_exact(next_run, spark, config)
    mirror = spark.read.format("delta").load(next_run.lake.table("public.fresh").mirror)
    assert mirror.where("v = 'changed after its snapshot'").count() == 50 and mirror.count() == 290
    # the run in flight captured the table from the batch that met it on
    assert report.newly_captured == ["public.fresh"] and sorted(in_flight.tables) == sorted(next_run.tables)
    assert "no primary key" in report.skipped_tables["public.fresh_log"]
    # the keyless table does not make every later batch resolve the tables again
    admin.execute("insert into fresh_log values (2, 'y')")
    admin.execute("update fresh set v = 'later' where id = 1")
    recorded, report = stream_once(in_flight, spark, recorded)
    assert report.newly_captured == [] and report.changes == 1
