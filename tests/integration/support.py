"""Helpers for integration tests: a source database with a read-only CDC role, and mirror/source comparison."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psycopg
from dagster import DagsterEventType, DagsterInstance
from psycopg import sql
from pyspark.sql import SparkSession

from cdc_assets.config import CdcConfig, PostgresConnection, Secret, SourceConfig, SparkConfig, StreamConfig
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.connection import connect
from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN, copy_query_to_arrow

ROOT = Path(__file__).resolve().parents[2]
READER_PASSWORD = "rd-7Qx"
# the cluster scripts/pg.sh starts (its environment: CDC_PG_PORT, CDC_PG_STATE; CDC_PG_SOCKET overrides the socket)
PG_PORT = int(os.environ.get("CDC_PG_PORT", "54329"))
PG_SOCKET = os.environ.get("CDC_PG_SOCKET", str(Path(os.environ.get("CDC_PG_STATE", ROOT / ".state" / "pg")) / "sock"))

SCHEMA_SQL = """
create type mood as enum ('sad', 'ok', 'happy');
create table items (
    id bigint primary key, name text, price numeric(12,2), big numeric, qty int, ratio float8, flag bool,
    created timestamptz, local_ts timestamp, day date, at_time time, uid uuid, doc jsonb, raw bytea,
    tags text[], scores int[], feeling mood, note varchar(40)
);
create table pairs (region int, code text, amount bigint, label text, primary key (region, code));
create table docs (id uuid primary key, title text, body text);
alter table docs alter column body set storage external;
"""


SEED_SQL = """
insert into items
select g, 'name ' || g || E'\\n"quoted"', (g * 1.25)::numeric(12,2), g * 1000000000000, g % 17, g / 7.0, g % 2 = 0,
       timestamptz '2024-01-01 00:00:00.123456+00' + g * interval '1 minute',
       timestamp '2024-01-01' + g * interval '1 s',
       date '2024-01-01' + g, time '12:00' + g * interval '1 s', md5(g::text)::uuid, jsonb_build_object('g', g),
       decode(lpad(to_hex(g), 8, '0'), 'hex'), array['a' || g, null, 'x,y'], array[g, g + 1], 'ok',
       case when g % 5 = 0 then '' end
from generate_series(1, 2000) g;
insert into items (id, big, day, created) values (100000, 'NaN', 'infinity', '-infinity');
insert into pairs select g % 9, 'c' || g, g, 'l' || g from generate_series(1, 1500) g;
insert into docs select md5('d' || g)::uuid, 't' || g, repeat('body' || g, 3000) from generate_series(1, 300) g;
"""


def create_source(admin_dsn: str, database: str) -> None:
    root = psycopg.connect(f"{admin_dsn} dbname=postgres", autocommit=True)
    for (slot,) in root.execute("select slot_name from pg_replication_slots where database = %s", [database]):
        root.execute("select pg_drop_replication_slot(%s)", [slot])
    root.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(database)))
    root.execute(sql.SQL("create database {}").format(sql.Identifier(database)))
    role = f"{database}_reader"
    root.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(role)))
    root.execute(
        sql.SQL("create role {} login replication password {}").format(
            sql.Identifier(role), sql.Literal(READER_PASSWORD)
        )
    )
    root.execute(sql.SQL("alter role {} set default_transaction_read_only = on").format(sql.Identifier(role)))
    root.close()
    conn = psycopg.connect(f"{admin_dsn} dbname={database}", autocommit=True)
    conn.execute(SCHEMA_SQL)
    conn.execute(sql.SQL("grant select on all tables in schema public to {}").format(sql.Identifier(role)))
    conn.execute(sql.SQL("create publication {} for table items, pairs, docs").format(sql.Identifier(database)))
    conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [database])
    conn.close()


@contextmanager
def seeded_source(postgres_server: dict[str, str], database: str) -> Iterator[tuple[psycopg.Connection, str]]:
    """A fresh source database with the test schema and ``SEED_SQL``, its slot and publication: yields an autocommit
    administrator connection (``synchronous_commit = on``) and the administrator DSN; drops it all afterwards."""
    admin_dsn = f"host={postgres_server['socket']} port={postgres_server['port']} user=postgres"
    create_source(admin_dsn, database)
    admin = psycopg.connect(f"{admin_dsn} dbname={database}", autocommit=True)
    try:
        admin.execute("set synchronous_commit = on")
        admin.execute(SEED_SQL)
        yield admin, admin_dsn
    finally:
        admin.close()
        drop_source(admin_dsn, database)


def drop_source(admin_dsn: str, database: str) -> None:
    root = psycopg.connect(f"{admin_dsn} dbname=postgres", autocommit=True)
    for (slot,) in root.execute("select slot_name from pg_replication_slots where database = %s", [database]):
        root.execute("select pg_drop_replication_slot(%s)", [slot])
    root.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(database)))
    root.close()


def pipeline_config(database: str, lake_root: Path, chunk_size: int = 400, max_changes: int = 100_000) -> CdcConfig:
    source = SourceConfig(
        name=database,
        kind="postgres",
        connection=PostgresConnection("127.0.0.1", PG_PORT, database, f"{database}_reader", Secret(READER_PASSWORD)),
        slot=database,
        publication=database,
        startup_mode="initial",
        chunk_size=chunk_size,
        read_parallelism=2,
        tables=(),
        include=("public.*",),
        exclude=(),
        stream=StreamConfig(max_changes=max_changes, spill_rows=5000),
    )
    return CdcConfig(lake_root=lake_root, spark=SparkConfig(), sources=(source,))


def source_rows(source: SourceConfig, table: CapturedTable) -> set[tuple]:
    conn = connect(source.connection, source.name)
    try:
        query = sql.SQL("select * from {}").format(table.identifier)
        rows: set[tuple] = set()
        for part in copy_query_to_arrow(conn, query, list(table.columns)):
            rows |= _as_tuples(part.to_pylist(), [c.name for c in table.columns])
        return rows
    finally:
        conn.close()


def mirror_rows(spark: SparkSession, path: str, table: CapturedTable) -> set[tuple]:
    names = [c.name for c in table.columns] + [UNREPRESENTABLE_COLUMN]
    frame = spark.read.format("delta").load(path).select(*[f"`{n}`" for n in names])
    return _as_tuples([r.asDict(recursive=True) for r in frame.collect()], [c.name for c in table.columns])


def _freeze(value: object) -> object:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, bytearray):
        return bytes(value)
    if hasattr(value, "tzinfo") and getattr(value, "tzinfo", None) is not None:
        return value.astimezone(__import__("datetime").UTC).replace(tzinfo=None)
    return value


def _as_tuples(rows: list[dict], names: list[str]) -> set[tuple]:
    out = set()
    for row in rows:
        extra = row.get(UNREPRESENTABLE_COLUMN)
        if isinstance(extra, list):  # arrow map as list of pairs
            extra = dict(extra)
        out.add((*(_freeze(row[n]) for n in names), _freeze(extra or None)))
    return out


ABSENT_STANDBY = "cdc_test_absent_standby"


@contextmanager
def commit_held_by_absent_standby(admin_dsn: str, database: str, statement: str) -> Iterator[int]:
    """Run ``statement`` in its own transaction while the server waits for a synchronous standby that never comes:
    its commit record is written and flushed (logical decoding reads it) but the transaction stays in the process
    array, so ``pg_current_snapshot()`` lists it in ``xip`` and no other snapshot sees its rows. Yields the held
    backend's pid; on exit cancels the wait (the commit becomes visible) and resets ``synchronous_standby_names``.

    Server-wide while it lasts: any other commit with ``synchronous_commit = on`` would wait too, so the test must
    write nothing else meanwhile (the pipeline's reads and slot moves assign no transaction id and never wait)."""
    root = psycopg.connect(f"{admin_dsn} dbname=postgres", autocommit=True)
    held = psycopg.connect(f"{admin_dsn} dbname={database}", autocommit=True)
    held.execute("set synchronous_commit = on")
    pid = held.info.backend_pid
    errors: list[BaseException] = []

    def run() -> None:
        try:
            held.execute(statement)
        except BaseException as error:  # reported below
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    try:
        root.execute(sql.SQL("alter system set synchronous_standby_names = {}").format(sql.Literal(ABSENT_STANDBY)))
        root.execute("select pg_reload_conf()")
        time.sleep(1.5)  # the checkpointer publishes the standby list after it reloads
        thread.start()
        deadline = time.monotonic() + 20
        while True:
            (event,) = root.execute("select wait_event from pg_stat_activity where pid = %s", [pid]).fetchone()
            if event == "SyncRep":
                break
            assert thread.is_alive() and time.monotonic() < deadline, (
                f"the statement did not wait for the absent standby (wait event {event!r}, errors {errors})"
            )
            time.sleep(0.1)
        yield pid
    finally:
        root.execute("alter system reset synchronous_standby_names")
        root.execute("select pg_reload_conf()")
        if thread.is_alive():
            root.execute("select pg_cancel_backend(%s)", [pid])  # "the transaction has already committed locally"
            thread.join(30)
        held.close()
        root.close()
    assert not errors, errors


T = TypeVar("T")


def wait_for(
    what: str, probe: Callable[[], T], timeout_seconds: float, poll_seconds: float = 1.0,
    context: Callable[[], str] = lambda: "",
) -> T:  # fmt: skip
    """``probe()``'s first truthy answer, asked every ``poll_seconds``; an assertion naming ``what`` (and
    ``context()``, e.g. a log's tail) when none came within ``timeout_seconds``."""
    deadline = time.monotonic() + timeout_seconds
    while not (found := probe()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_seconds} s{context()}"
        time.sleep(poll_seconds)
    return found


def run_pid(instance: DagsterInstance, run_id: str) -> int | None:
    """The pid of a run's process, from the engine event Dagster writes when it starts it."""
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.ENGINE_EVENT):
        found = re.search(r"Started process for run \(pid: (\d+)\)", entry.message or "")
        if found:
            return int(found.group(1))
    return None
