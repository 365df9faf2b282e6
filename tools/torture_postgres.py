"""The PostgreSQL side of the torture harness (``tools/torture.py``; the interface is ``tools/torture_source.py``).

Contract
--------
- **Server** (``PostgresTorture``): a cluster the harness starts with ``scripts/pg.sh`` (default: a private
  cluster, port 54339, ``.state/torture-pg``, so that restarting it never disturbs the test suite's cluster);
  ``restart`` is ``scripts/pg.sh restart`` (the ``pg-restart`` fault).
- **Source** (``create``): database ``torture_<seed>``, a read-only role ``torture_<seed>_reader``
  (``REPLICATION``, ``SELECT``, ``default_transaction_read_only``), four tables with bigint, composite
  ``(int, text)``, uuid and text keys and columns of every supported type (numeric with NaN and more than 38
  digits, float NaN/Infinity, timestamptz, timestamp, date with infinity and BC, time, interval, uuid, json, jsonb,
  bytea, text[] and int[] incl. multi-dimensional, enum, bool, NULLs, empty strings, TOAST-sized text and bytea with
  storage external). The administrator creates the publication, the pipeline's slot, and an **oracle** slot
  (``test_decoding``) right after it, with no write in between.
- **Workload** (admin sessions, ``synchronous_commit = on``): writer threads doing inserts, updates, deletes,
  primary-key updates (keys move between chunks), delete-then-reinsert in one transaction and across two,
  SAVEPOINT + ROLLBACK TO, multi-row updates, TOAST updates and TOAST left unchanged, chains of primary-key updates
  leaving a TOAST value (now and then 100k-400k characters, rarely 1-3 MB; ``blob`` now and then 1-2 MB of bytea;
  two seeded rows hold a 2-3 MB ``body`` and a 1-2 MB ``blob``) unchanged with the freed keys reused at once by new
  rows, in one transaction and across several (issue 24); a thread of long
  transactions spanning many chunk windows (committed or rolled back). Schema events: ``ALTER TABLE ADD COLUMN``
  (twice) and ``TRUNCATE`` (with re-inserts in the same transaction or the next). A statement that fails as
  malformed SQL (``HARNESS_BUGS``) stops the seed as a harness bug instead of being rolled back like a lock timeout.
- **Checks** (``verify``, in the stream worker): every mirror equals its source row by row, every column (tables
  re-described by a fresh ``prepare()``, so added columns are compared), no row has ``_cdc_unknown``; no changelog
  has a duplicate ``(_cdc_commit_lsn, _cdc_seq)``; every changelog holds exactly the changes PostgreSQL's own
  ``test_decoding`` reports for that table from the oracle slot, per commit (end LSN), xid and operation (no gap,
  nothing extra). The runner then checks the oracle against the workload's own count of committed changes.
- ``--broken-reconciliation`` (``break_settled_rule``): the worker replaces ``PostgresSettledRule.unsettled``
  (``cdc_assets.sources.postgres.watermark``) by "every transaction is settled" inside its own process; production
  code is unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from cdc_assets.config import (
    CdcConfig,
    PostgresConnection,
    Secret,
    SourceConfig,
    SparkConfig,
    StreamConfig,
    TableConfig,
)
from cdc_assets.sources.postgres.lsn import format_lsn, parse_lsn
from tools.torture_source import (
    WORKER_MASTER,
    Tally,
    VerifyResult,
    WorkloadContext,
    compare_rows,
    lake_failures,
    show,
    show_key,
)

ROOT = Path(__file__).resolve().parents[1]
READER_PASSWORD = "torture-rd-9"

# ----------------------------------------------------------------------------------------------------------------
# Source schema and values


Gen = Callable[[random.Random], str | None]


def _null(p: float, gen: Gen) -> Gen:
    return lambda r: None if r.random() < p else gen(r)


TEXTS = ["", " ", "plain", "with\nnewline", "quote ' and \" double", "back\\slash", "comma,{brace}", "ünïcødé ✓ 😀",
         "tab\there", "NULL", "x" * 300]  # fmt: skip


def g_text(r: random.Random) -> str:
    return r.choice(TEXTS) if r.random() < 0.5 else f"t{r.randrange(10**6)}"


def g_varchar40(r: random.Random) -> str:
    return g_text(r)[:40]


def g_numeric_12_2(r: random.Random) -> str:
    return str(Decimal(r.randrange(-(10**12) + 1, 10**12)).scaleb(-2))


def g_numeric(r: random.Random) -> str:
    return r.choice(
        [
            str(Decimal(r.randrange(-(10**9), 10**9)).scaleb(-r.randrange(0, 10))),
            "NaN",
            "1" + "7" * 44,  # 45 digits: more than decimal(38, 18) holds
            "-" + "3" * 40 + ".5",
            "0.0000000000000000000001",  # more fractional digits than the scale: never rounded
            "0",
            "1e30",
        ]
    )


def g_numeric_60_5(r: random.Random) -> str:
    return str(Decimal(r.randrange(10**55)).scaleb(-5)) if r.random() < 0.5 else str(r.randrange(10**6))


def g_int(r: random.Random) -> str:
    return str(r.choice([0, 1, -1, 2**31 - 1, -(2**31), r.randrange(-1000, 1000)]))


def g_smallint(r: random.Random) -> str:
    return str(r.choice([0, 32767, -32768, r.randrange(-300, 300)]))


def g_float(r: random.Random) -> str:
    return r.choice(["0", "-0", "1.5", "0.1", "1e308", "-1e-308", "5e-324", "Infinity", "-Infinity", "NaN",
                     repr(r.uniform(-1e6, 1e6))])  # fmt: skip


def g_real(r: random.Random) -> str:
    return r.choice(["0", "1.1", "3.4e38", "-1e-45", "NaN", "Infinity", repr(r.uniform(-1e3, 1e3))])


def g_bool(r: random.Random) -> str:
    return r.choice(["true", "false"])


def _instant(r: random.Random) -> str:
    seconds = r.randrange(946684800, 1893456000)
    micros = r.choice([0, r.randrange(10**6)])
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + (f".{micros:06d}" if micros else "")


def g_timestamptz(r: random.Random) -> str:
    special = ["infinity", "-infinity", "0001-01-01 00:00:00+00", "9999-12-31 23:59:59.999999+00",
               "1000-06-01 12:00:00+00 BC"]  # fmt: skip
    if r.random() < 0.1:
        return r.choice(special)
    return _instant(r) + r.choice(["+00", "+05:30", "-08", "+14"])


def g_timestamp(r: random.Random) -> str:
    if r.random() < 0.1:
        return r.choice(["infinity", "-infinity", "0001-01-01 00:00:00", "0500-01-01 00:00:00 BC"])
    return _instant(r)


def g_date(r: random.Random) -> str:
    if r.random() < 0.15:
        return r.choice(["infinity", "-infinity", "0044-03-15 BC", "9999-12-31", "0001-01-01"])
    return _instant(r)[:10]


def g_time(r: random.Random) -> str:
    if r.random() < 0.2:
        return r.choice(["00:00:00", "23:59:59.999999", "24:00:00"])
    return f"{r.randrange(24):02d}:{r.randrange(60):02d}:{r.randrange(60):02d}.{r.randrange(10**6):06d}"


def g_interval(r: random.Random) -> str:
    return r.choice(["1 day 02:03:04.5", "-1 mons +2 days", "0", "1 year", "P1Y2M3DT4H5M6.7S",
                     f"{r.randrange(1000)} seconds"])  # fmt: skip


def g_uuid(r: random.Random) -> str:
    return str(uuid.UUID(int=r.getrandbits(128), version=4))


def g_jsonb(r: random.Random) -> str:
    return r.choice(['{"a": [1, 2, {"b": null}], "s": "x\\"y"}', "[]", '"str"', "null", "{}", '"\\u00e9"',
                     "12345678901234567890.123", json.dumps({"n": r.randrange(10**6), "t": g_text(r)})])  # fmt: skip


def g_json(r: random.Random) -> str:
    return r.choice(['{ "a" : 1 , "a" : 2 }', "[1,  2]", ' "s" ', "null", '{"k":"v"}',
                     json.dumps({"n": r.randrange(10**6)}, indent=1)])  # fmt: skip


def g_bytea(r: random.Random) -> str:
    return "\\x" + r.randbytes(r.choice([0, 1, 16, 40])).hex()


def bytea_of(r: random.Random, size: int) -> str:
    return "\\x" + r.randbytes(size).hex()


def g_big_bytea(r: random.Random) -> str:
    # now and then a value of a few MB (issue 23: values of any size stream through)
    return bytea_of(r, r.randrange(1 << 20, 2 << 20) if r.random() < 0.01 else r.choice([0, 10, 3000, 12000]))


def g_text_array(r: random.Random) -> str:
    return r.choice(['{}', '{a,NULL,"x,y","q\\"u"}', "{{a,b},{c,d}}", '{""}', '{"NULL"}', '{" spaced "}',
                     "{" + ",".join(f"e{r.randrange(100)}" for _ in range(r.randrange(1, 5))) + "}"])  # fmt: skip


def g_int_array(r: random.Random) -> str:
    return r.choice(["{1,2,3}", "{}", "{NULL,5}", "{{1,2},{3,4}}", "[0:1]={7,8}", "{-2147483648}",
                     "{" + ",".join(str(r.randrange(-99, 99)) for _ in range(r.randrange(1, 6))) + "}"])  # fmt: skip


def g_mood(r: random.Random) -> str:
    return r.choice(["sad", "ok", "happy", "très bien"])


BODY_ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ0123456789.,;\n\"'\\éü✓"


def g_body(r: random.Random) -> str:
    # TOAST-sized, stored external; now and then a large one (issue 24's row carried 400,000 characters), rarely
    # one of a few MB (issue 23)
    draw = r.random()
    if draw < 0.005:
        size = r.randrange(1_000_000, 3_000_000)
    elif draw < 0.02:
        size = r.randrange(100_000, 400_000)
    else:
        size = r.randrange(3000, 30000)
    return body_of(r, size)


def body_of(r: random.Random, size: int) -> str:
    return "".join(r.choices(BODY_ALPHABET, k=size))


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    gen: Gen


@dataclass(frozen=True)
class TableSpec:
    name: str
    key: tuple[str, ...]
    columns: tuple[Column, ...]  # non-key columns

    def key_type(self, name: str) -> str:
        return KEY_TYPES[self.name][name]


KEY_TYPES: dict[str, dict[str, str]] = {
    "big_items": {"id": "bigint"},
    "pair_items": {"region": "int", "code": "text"},
    "uuid_docs": {"id": "uuid"},
    "text_notes": {"key": "text"},
}

TABLES: dict[str, TableSpec] = {
    "big_items": TableSpec("big_items", ("id",), tuple(Column(n, t, _null(0.08, g)) for n, t, g in [
        ("name", "text", g_text), ("note", "varchar(40)", g_varchar40), ("price", "numeric(12,2)", g_numeric_12_2),
        ("big", "numeric", g_numeric), ("huge", "numeric(60,5)", g_numeric_60_5), ("qty", "int", g_int),
        ("small", "smallint", g_smallint), ("ratio", "float8", g_float), ("flag", "bool", g_bool),
        ("created", "timestamptz", g_timestamptz), ("local_ts", "timestamp", g_timestamp), ("day", "date", g_date),
        ("at_time", "time", g_time), ("span", "interval", g_interval), ("uid", "uuid", g_uuid),
        ("doc", "jsonb", g_jsonb), ("js", "json", g_json), ("raw", "bytea", g_bytea), ("tags", "text[]", g_text_array),
        ("scores", "int[]", g_int_array), ("feeling", "mood", g_mood),
    ])),
    "pair_items": TableSpec("pair_items", ("region", "code"), tuple(Column(n, t, _null(0.1, g)) for n, t, g in [
        ("amount", "bigint", lambda r: str(r.randrange(-(2**63), 2**63))), ("label", "text", g_text),
        ("day", "date", g_date), ("doc", "json", g_json), ("flag", "bool", g_bool), ("ratio", "real", g_real),
    ])),
    "uuid_docs": TableSpec("uuid_docs", ("id",), tuple(Column(n, t, _null(0.05, g)) for n, t, g in [
        ("title", "text", g_text), ("body", "text", g_body), ("blob", "bytea", g_big_bytea),
        ("tags", "text[]", g_text_array), ("rev", "int", g_int),
    ])),
    "text_notes": TableSpec("text_notes", ("key",), tuple(Column(n, t, _null(0.1, g)) for n, t, g in [
        ("val", "numeric", g_numeric), ("at", "timestamptz", g_timestamptz), ("note", "text", g_text),
        ("flag", "bool", g_bool), ("scores", "int[]", g_int_array), ("local_ts", "timestamp", g_timestamp),
    ])),
}  # fmt: skip

ADDED_COLUMNS: list[tuple[str, Column]] = [
    ("big_items", Column("extra_note", "text", _null(0.2, g_text))),
    ("text_notes", Column("extra_num", "numeric", _null(0.2, g_numeric))),
]

SPECIAL_TEXT_KEYS = ["", " ", "Ä", "é", "ключ", "😀", "a b", "Z", "zz", "~", "k", "K"]


def base_rows(scale: float) -> dict[str, int]:
    return {
        "big_items": max(60, int(3000 * scale)),
        "pair_items": max(40, int(1500 * scale)),
        "uuid_docs": max(20, int(240 * scale)),
        "text_notes": max(40, int(1200 * scale)),
    }


def new_key(table: str, r: random.Random, rows: int) -> tuple[str, ...]:
    if table == "big_items":
        return (str(r.randrange(1, 3 * rows)),)
    if table == "pair_items":
        return (str(r.randrange(10)), f"c{r.randrange(3 * rows)}")
    if table == "uuid_docs":
        return (g_uuid(r),)
    if r.random() < 0.05:
        return (r.choice(SPECIAL_TEXT_KEYS) + str(r.randrange(10)),)
    return (f"k{r.randrange(3 * rows):05d}",)


SCHEMA_SQL = """
create type mood as enum ('sad', 'ok', 'happy', 'très bien');
create table big_items (id bigint primary key, {big});
create table pair_items (region int, code text, {pair}, primary key (region, code));
create table uuid_docs (id uuid primary key, {docs});
alter table uuid_docs alter column body set storage external, alter column blob set storage external;
create table text_notes (key text primary key, {notes});
"""


def schema_sql() -> str:
    def columns(table: str) -> str:
        return ", ".join(f"{c.name} {c.type}" for c in TABLES[table].columns)

    return SCHEMA_SQL.format(
        big=columns("big_items"), pair=columns("pair_items"), docs=columns("uuid_docs"), notes=columns("text_notes")
    )


def insert_sql(spec: TableSpec, columns: Sequence[Column], conflict: bool) -> sql.Composed:
    names = [*spec.key, *[c.name for c in columns]]
    types = [*[spec.key_type(k) for k in spec.key], *[c.type for c in columns]]
    return sql.SQL("insert into {} ({}) values ({}){}").format(
        sql.Identifier(spec.name),
        sql.SQL(", ").join(sql.Identifier(n) for n in names),
        sql.SQL(", ").join(sql.SQL("%s::" + t) for t in types),
        sql.SQL(" on conflict do nothing" if conflict else ""),
    )


def key_match(spec: TableSpec) -> sql.Composed:
    return sql.SQL(" and ").join(sql.SQL("{} = %s::" + spec.key_type(k)).format(sql.Identifier(k)) for k in spec.key)


# ----------------------------------------------------------------------------------------------------------------
# PostgreSQL cluster and databases


@dataclass(frozen=True)
class Cluster:
    port: int
    state: Path

    @property
    def socket(self) -> Path:
        return self.state / "sock"

    def admin_dsn(self, database: str) -> str:
        return f"host={self.socket} port={self.port} user=postgres dbname={database}"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "CDC_PG_PORT": str(self.port), "CDC_PG_STATE": str(self.state)}

    def running(self) -> bool:
        status = subprocess.run([str(ROOT / "scripts" / "pg.sh"), "status"], env=self._env(), capture_output=True)
        return status.returncode == 0

    def start(self) -> None:
        subprocess.run([str(ROOT / "scripts" / "pg.sh"), "start"], env=self._env(), check=True, capture_output=True)

    def stop(self) -> None:
        subprocess.run([str(ROOT / "scripts" / "pg.sh"), "stop"], env=self._env(), check=True, capture_output=True)

    def restart(self) -> None:
        subprocess.run([str(ROOT / "scripts" / "pg.sh"), "restart"], env=self._env(), check=True, capture_output=True)


def drop_database(cluster: Cluster, database: str) -> None:
    with psycopg.connect(cluster.admin_dsn("postgres"), autocommit=True) as root:
        for (slot,) in root.execute("select slot_name from pg_replication_slots where database = %s", [database]):
            root.execute("select pg_drop_replication_slot(%s)", [slot])
        root.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(database)))
        root.execute(sql.SQL("drop role if exists {}").format(sql.Identifier(f"{database}_reader")))


def create_database(cluster: Cluster, database: str, r: random.Random, rows: dict[str, int]) -> int:
    """Create the source (schema, seeded rows, read-only role, publication, pipeline slot, oracle slot); returns
    the oracle slot's start LSN."""
    drop_database(cluster, database)
    role = f"{database}_reader"
    with psycopg.connect(cluster.admin_dsn("postgres"), autocommit=True) as root:
        root.execute(sql.SQL("create database {}").format(sql.Identifier(database)))
        root.execute(
            sql.SQL("create role {} login replication password {}").format(
                sql.Identifier(role), sql.Literal(READER_PASSWORD)
            )
        )
        root.execute(sql.SQL("alter role {} set default_transaction_read_only = on").format(sql.Identifier(role)))
    with psycopg.connect(cluster.admin_dsn(database), autocommit=True) as conn:
        conn.execute(schema_sql())
        with conn.cursor() as cur:
            for name, spec in TABLES.items():
                statement = insert_sql(spec, spec.columns, conflict=True)
                values = []
                for i in range(rows[name]):
                    if name == "text_notes":
                        key: tuple[str, ...] = (SPECIAL_TEXT_KEYS[i] if i < len(SPECIAL_TEXT_KEYS) else f"k{i:05d}",)
                    elif name == "big_items":
                        key = (str(i + 1),)
                    elif name == "pair_items":
                        key = (str(i % 10), f"c{i}")
                    else:
                        key = (g_uuid(r),)
                    values.append([*key, *[c.gen(r) for c in spec.columns]])
                if name == "uuid_docs" and len(values) >= 2:  # every seed holds values of a few MB (issue 23)
                    at = {c.name: len(spec.key) + i for i, c in enumerate(spec.columns)}
                    values[0][at["body"]] = body_of(r, r.randrange(2_000_000, 3_000_000))
                    values[1][at["blob"]] = bytea_of(r, r.randrange(1 << 20, 2 << 20))
                cur.executemany(statement, values)
        conn.execute(sql.SQL("grant select on all tables in schema public to {}").format(sql.Identifier(role)))
        conn.execute("analyze")
        conn.execute(
            sql.SQL("create publication {} for table {}").format(
                sql.Identifier(database), sql.SQL(", ").join(sql.Identifier(t) for t in TABLES)
            )
        )
        conn.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [database])
        (start,) = conn.execute(
            "select lsn::text from pg_create_logical_replication_slot(%s, 'test_decoding')", [f"{database}_oracle"]
        ).fetchone()
    return parse_lsn(start)


def build_config(spec: Mapping[str, Any]) -> CdcConfig:
    database = spec["db"]
    source = SourceConfig(
        name=database,
        kind="postgres",
        connection=PostgresConnection(
            "127.0.0.1", int(spec["port"]), database, f"{database}_reader", Secret(READER_PASSWORD)
        ),
        slot=database,
        publication=database,
        startup_mode="initial",
        chunk_size=int(spec["chunk_size"]),
        read_parallelism=2,
        tables=(TableConfig("public", "uuid_docs", chunk_size=max(10, int(spec["chunk_size"]) // 5)),),
        include=("public.*",),
        exclude=(),
        stream=StreamConfig(max_changes=20_000, spill_rows=2_000),
    )
    return CdcConfig(lake_root=Path(spec["lake"]), spark=SparkConfig(master=WORKER_MASTER), sources=(source,))


# ----------------------------------------------------------------------------------------------------------------
# Workload


class Session:
    """One admin session of the workload: explicit transactions, counted changes, reconnects after a restart."""

    def __init__(self, dsn: str, tally: Tally, stop: threading.Event) -> None:
        self.dsn = dsn
        self.tally = tally
        self.stop = stop
        self.pending: Counter[str] = Counter()
        self.conn: psycopg.Connection | None = None

    def connect(self) -> psycopg.Connection:
        deadline = time.monotonic() + 120
        while True:
            try:
                conn = psycopg.connect(self.dsn, autocommit=False, connect_timeout=5)
                conn.execute("set synchronous_commit = on")
                conn.execute("set lock_timeout = '1s'")
                conn.execute("set statement_timeout = '30s'")
                conn.commit()
                self.conn = conn
                return conn
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def c(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.pending.clear()
            return self.connect()
        return self.conn

    def run(self, table: str | None, query: sql.Composable | str, params: Sequence[Any] = ()) -> psycopg.Cursor:
        cursor = self.c().execute(query, params)  # type: ignore[arg-type]
        if table is not None and cursor.rowcount > 0:
            self.pending[table] += cursor.rowcount
        return cursor

    def commit(self) -> None:
        counts, self.pending = self.pending, Counter()
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            return  # the transaction died with its connection
        try:
            conn.commit()
        except psycopg.Error:
            if conn.broken or conn.closed:
                self.tally.add(counts, certain=False)  # the commit may or may not have happened
            return
        self.tally.add(counts, certain=True)

    def rollback(self) -> None:
        self.pending = Counter()
        if self.conn is not None and not self.conn.closed and not self.conn.broken:
            try:
                self.conn.rollback()
            except psycopg.Error:
                pass

    def close(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.rollback()
            self.conn.close()


class Ops:
    """The workload's operations on one session (each leaves its transaction open; the caller commits)."""

    def __init__(self, session: Session, r: random.Random, rows: dict[str, int], added: dict[str, list[Column]]):
        self.s = session
        self.r = r
        self.rows = rows
        self.added = added

    def columns(self, table: str) -> list[Column]:
        return [*TABLES[table].columns, *self.added.get(table, [])]

    def existing(self, table: str) -> tuple[str, ...] | None:
        spec = TABLES[table]
        keys = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(k)) for k in spec.key)
        order = sql.SQL(", ").join(sql.Identifier(k) for k in spec.key)
        start = new_key(table, self.r, self.rows[table])
        lower = sql.SQL("({}) >= ({})").format(
            order, sql.SQL(", ").join(sql.SQL("%s::" + spec.key_type(k)) for k in spec.key)
        )
        for where, params in ((lower, list(start)), (sql.SQL("true"), [])):
            row = self.s.run(
                None,
                sql.SQL("select {} from {} where {} order by {} limit 1").format(
                    keys, sql.Identifier(table), where, order
                ),
                params,
            ).fetchone()
            if row is not None:
                return tuple(row)
        return None

    def insert(self, table: str, key: tuple[str, ...] | None = None) -> None:
        spec = TABLES[table]
        columns = self.columns(table)
        key = key or new_key(table, self.r, self.rows[table])
        self.s.run(table, insert_sql(spec, columns, conflict=True), [*key, *[c.gen(self.r) for c in columns]])

    def update(self, table: str, key: tuple[str, ...] | None = None) -> None:
        spec = TABLES[table]
        key = key or self.existing(table)
        if key is None:
            return
        columns = self.r.sample(self.columns(table), self.r.randrange(1, 4))
        if table == "uuid_docs" and self.r.random() < 0.5:  # TOAST body left unchanged
            columns = [c for c in columns if c.name != "body"] or [TABLES[table].columns[0]]
        assignments = sql.SQL(", ").join(sql.SQL("{} = %s::" + c.type).format(sql.Identifier(c.name)) for c in columns)
        self.s.run(
            table,
            sql.SQL("update {} set {} where {}").format(sql.Identifier(table), assignments, key_match(spec)),
            [*[c.gen(self.r) for c in columns], *key],
        )

    def delete(self, table: str, key: tuple[str, ...] | None = None) -> None:
        key = key or self.existing(table)
        if key is not None:
            self.s.run(
                table, sql.SQL("delete from {} where {}").format(sql.Identifier(table), key_match(TABLES[table])), key
            )

    def key_update(self, table: str) -> None:
        spec = TABLES[table]
        old = self.existing(table)
        if old is None:
            return
        new = new_key(table, self.r, self.rows[table])
        if table == "big_items" and self.r.random() < 0.3:
            new = (str(int(old[0]) + 10_000_000),)  # beyond the last planned boundary
        assignments = sql.SQL(", ").join(
            sql.SQL("{} = %s::" + spec.key_type(k)).format(sql.Identifier(k)) for k in spec.key
        )
        self.s.run(
            table,
            sql.SQL("update {} set {} where {} and not exists (select from {} where {})").format(
                sql.Identifier(table), assignments, key_match(spec), sql.Identifier(table), key_match(spec)
            ),
            [*new, *old, *new],
        )

    def toast_chain(self, table: str, commit_between: bool = False) -> None:
        """Issue 24's pattern on a table with a TOASTed column (``uuid_docs.body``, stored external; else the
        table itself): primary-key updates leaving the large value unchanged, one after another (a chain: the row
        moves on), with updates of other columns between them, and each freed key often reused at once by a new row
        with another large value. With ``commit_between`` (a writer's own transactions, never inside a long one)
        the chain's steps are committed apart, so the chain spans transactions and often batches."""
        if table != "uuid_docs" and self.r.random() < 0.7:
            table = "uuid_docs"
        spec = TABLES[table]
        key = self.existing(table)
        if key is None:
            return
        assignments = sql.SQL(", ").join(
            sql.SQL("{} = %s::" + spec.key_type(k)).format(sql.Identifier(k)) for k in spec.key
        )
        others = [c for c in TABLES[table].columns if c.name not in ("body", "blob")]
        for _ in range(self.r.randrange(1, 5)):
            new = new_key(table, self.r, self.rows[table])
            moved = self.s.run(
                table,
                sql.SQL("update {} set {} where {} and not exists (select from {} where {})").format(
                    sql.Identifier(table), assignments, key_match(spec), sql.Identifier(table), key_match(spec)
                ),
                [*new, *key, *new],
            ).rowcount
            if not moved:
                return
            if self.r.random() < 0.6:
                self.update_columns(table, new, [self.r.choice(others)])
            if self.r.random() < 0.5:
                self.insert(table, key)  # the freed key, reused by another row with another large value
            if commit_between and self.r.random() < 0.5:
                self.s.commit()
            key = new

    def update_columns(self, table: str, key: tuple[str, ...], columns: list[Column]) -> None:
        assignments = sql.SQL(", ").join(sql.SQL("{} = %s::" + c.type).format(sql.Identifier(c.name)) for c in columns)
        self.s.run(
            table,
            sql.SQL("update {} set {} where {}").format(sql.Identifier(table), assignments, key_match(TABLES[table])),
            [*[c.gen(self.r) for c in columns], *key],
        )

    def reinsert(self, table: str) -> None:
        key = self.existing(table)
        if key is not None:
            self.delete(table, key)
            self.insert(table, key)

    def multi_update(self, table: str) -> None:
        r = self.r
        if table == "big_items":
            low = r.randrange(1, 3 * self.rows[table])
            self.s.run(table, "update big_items set qty = coalesce(qty, 0) %% 1000 + 1, note = 'multi' "
                       "where id between %s and %s", [low, low + 30])  # fmt: skip
        elif table == "pair_items":
            self.s.run(table, "update pair_items set amount = coalesce(amount, 0) / 2 + 1 where region = %s "
                       "and code like %s", [r.randrange(10), f"c{r.randrange(10)}%"])  # fmt: skip
        elif table == "uuid_docs":
            self.s.run(table, "update uuid_docs set rev = coalesce(rev, 0) %% 1000 + 1 where id < %s::uuid",
                       [g_uuid(r)[:2] + "000000-0000-4000-8000-000000000000"])  # fmt: skip
        else:
            self.s.run(table, "update text_notes set flag = not coalesce(flag, false) where key like %s",
                       [f"k{r.randrange(10)}%"])  # fmt: skip

    def savepoint(self, table: str) -> None:
        """Work before and after a savepoint is kept; the work rolled back to the savepoint never exists."""
        self.update(table)
        kept = Counter(self.s.pending)
        self.s.run(None, "savepoint torture_sp")
        self.delete(self.r.choice(list(TABLES)))
        self.update(table)
        self.key_update(table)
        self.s.run(None, "rollback to savepoint torture_sp")
        self.s.pending = kept
        self.update(self.r.choice(list(TABLES)))

    def random_op(self) -> None:
        table = self.r.choices(list(TABLES), weights=[4, 2, 2, 2])[0]
        op = self.r.choices(
            [
                self.insert,
                self.update,
                self.delete,
                self.key_update,
                self.reinsert,
                self.multi_update,
                self.savepoint,
                self.toast_chain,
            ],
            weights=[4, 6, 2, 2, 1, 1, 1, 1],
        )[0]
        op(table)


# Errors a workload statement must never raise: a malformed query (a bare '%' beside parameters) or an SQL error
# (syntax, undefined column) is a harness bug, so it stops the seed (``WorkloadContext.fatal``) instead of being
# rolled back like a lock timeout, a duplicate key or a source restart. Two multi-row updates with a bare '%' were
# rolled back unnoticed on every call before this.
HARNESS_BUGS = (psycopg.ProgrammingError,)


class Writer(threading.Thread):
    """Short transactions at about ``rate`` per second until stopped; delete-then-reinsert across transactions."""

    def __init__(self, name: str, seed: int, rate: float, ctx: WorkloadContext, database: PostgresSeed) -> None:
        super().__init__(name=name, daemon=True)
        self.ctx = ctx
        self.r = random.Random(f"{seed}:{name}")
        self.session = Session(database.dsn, ctx.tally, ctx.stop)
        self.ops = Ops(self.session, self.r, database.rows, database.added)
        self.interval = 1.0 / rate
        self.done = 0

    def run(self) -> None:
        try:
            next_at = time.monotonic()
            while not self.ctx.stop.is_set():
                try:
                    if self.r.random() < 0.04:  # a chain of key changes leaving TOAST unchanged, across commits
                        self.ops.toast_chain(self.r.choice(list(TABLES)), commit_between=True)
                    elif self.r.random() < 0.03:  # delete, commit, re-insert the same key later
                        table = self.r.choice(list(TABLES))
                        key = self.ops.existing(table)
                        if key is not None:
                            self.ops.delete(table, key)
                            self.session.commit()
                            self.ops.insert(table, key)
                    else:
                        self.ops.random_op()
                    self.session.commit()
                    self.done += 1
                except HARNESS_BUGS:
                    raise
                except psycopg.Error:
                    self.session.rollback()
                next_at += self.interval
                time.sleep(max(0.0, next_at - time.monotonic()))
        except BaseException:
            self.ctx.fatal(f"writer {self.name}: {traceback.format_exc(limit=3)}")
        finally:
            self.session.close()


class LongTransactions(threading.Thread):
    """Transactions open for several seconds (many chunk windows), committed or (sometimes) rolled back."""

    def __init__(self, seed: int, duration: float, ctx: WorkloadContext, database: PostgresSeed) -> None:
        super().__init__(name="long", daemon=True)
        self.ctx = ctx
        self.r = random.Random(f"{seed}:long")
        self.session = Session(database.dsn, ctx.tally, ctx.stop)
        self.ops = Ops(self.session, self.r, database.rows, database.added)
        self.duration = duration
        self.committed = 0

    def run(self) -> None:
        try:
            while not self.ctx.stop.is_set():
                length = self.r.uniform(3, max(4.0, self.duration / 3))
                ends = time.monotonic() + length
                try:
                    while time.monotonic() < ends and not self.ctx.stop.is_set():
                        kept = Counter(self.session.pending)
                        self.session.run(None, "savepoint long_step")
                        try:
                            self.ops.random_op()
                        except HARNESS_BUGS:
                            raise
                        except psycopg.Error:
                            conn = self.session.conn
                            if conn is None or conn.broken or conn.closed:
                                raise
                            self.session.run(None, "rollback to savepoint long_step")  # keep the transaction
                            self.session.pending = kept
                        time.sleep(self.r.uniform(0.2, 1.5))
                    if self.r.random() < 0.85:
                        self.session.commit()
                        self.committed += 1
                    else:
                        self.session.rollback()
                except HARNESS_BUGS:
                    raise
                except psycopg.Error:
                    self.session.rollback()
                time.sleep(self.r.uniform(0, 1))
        except BaseException:
            self.ctx.fatal(f"long transactions: {traceback.format_exc(limit=3)}")
        finally:
            self.session.close()


# ----------------------------------------------------------------------------------------------------------------
# Verification (runs in the stream worker's process, which has a Spark session)


OPS = {"INSERT": "c", "UPDATE": "u", "DELETE": "d", "TRUNCATE": "t"}


def oracle_changes(admin_dsn: str, slot: str, start: int) -> dict[str, Counter[tuple[int, int, str]]]:
    """Per table, the count of changes per (commit end LSN, 32-bit xid, op) that ``test_decoding`` reports."""
    result: dict[str, Counter[tuple[int, int, str]]] = {}
    pending: list[tuple[str, str]] = []
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "select lsn::text, xid::text, left(data, 200) from pg_logical_slot_peek_changes(%s, null, null, "
            "'include-xids', '1', 'skip-empty-xacts', '1')",
            [slot],
        )
        for lsn, xid, data in rows:
            if data.startswith("BEGIN"):
                pending = []
            elif data.startswith("COMMIT"):
                end = parse_lsn(lsn)
                if end > start:
                    for table, op in pending:
                        result.setdefault(table, Counter())[(end, int(xid), op)] += 1
            elif data.startswith("table "):
                names, _, rest = data[len("table ") :].partition(": ")
                op = OPS[rest.split(":", 1)[0]]
                for name in names.split(", "):
                    pending.append((name, op))
    return result


def mirror_rows(frame: Any, names: list[str]) -> set[tuple]:
    """``tests.integration.support.mirror_rows`` through Arrow: PySpark's ``collect()`` cannot convert a timestamp
    at 0001-01-01 UTC (``TimestampType.fromInternal`` raises 'year 0 is out of range'); Arrow can."""
    from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN
    from tests.integration.support import _as_tuples

    selected = frame.select(*[f"`{n}`" for n in [*names, UNREPRESENTABLE_COLUMN]])
    return _as_tuples(selected.toArrow().to_pylist(), names)


def largest_value(row: tuple) -> int:
    """Bytes of a row's largest text or bytea value (text as UTF-8)."""
    sizes = [len(v.encode()) if isinstance(v, str) else len(v) for v in row if isinstance(v, str | bytes)]
    return max(sizes, default=0)


def verify(spark: Any, spec: Mapping[str, Any], admin_dsn: str, oracle_start: int) -> VerifyResult:
    """Mirrors against sources, changelogs against duplicates and against the oracle slot (module docstring)."""
    from pyspark.sql import functions as F

    from cdc_assets.sources.postgres.pg_values import UNREPRESENTABLE_COLUMN
    from cdc_assets.sources.postgres.pipeline import PostgresPipeline
    from tests.integration.support import source_rows

    config = build_config(spec)
    source = config.sources[0]
    pipeline = PostgresPipeline(config, source)
    tables = pipeline.prepare()  # re-described: columns added during the run are compared too
    failures: list[str] = []
    total = 0
    largest = 0
    decoded_totals: dict[str, int] = {}
    oracle = oracle_changes(admin_dsn, f"{source.name}_oracle", oracle_start)
    for name, table in sorted(tables.items()):
        paths = pipeline.lake.table(name)
        names = [c.name for c in table.columns]
        key_at = [names.index(k) for k in table.key_columns]
        frame = spark.read.format("delta").load(paths.mirror)
        missing = [n for n in names if n not in frame.columns]
        if missing:
            failures.append(f"table {name}: the mirror lacks column(s) {missing}")
        else:
            mirror: dict[tuple, tuple] = {}
            for row in mirror_rows(frame, names):
                key = tuple(row[i] for i in key_at)
                if key in mirror:
                    failures.append(
                        f"table {name} key {show_key(key)}: two mirror rows {show(mirror[key])}, {show(row)}"
                    )
                mirror[key] = row
            expected = {tuple(row[i] for i in key_at): row for row in source_rows(source, table)}
            largest = max([largest, *(largest_value(row) for row in expected.values())])
            difference = compare_rows(name, [*names, UNREPRESENTABLE_COLUMN], mirror, expected)
            if difference is not None:
                failures.append(difference)
            count = frame.count()
            if count != len(mirror):
                failures.append(f"table {name}: the mirror has {count} rows but {len(mirror)} distinct rows")
        problems, log = lake_failures(spark, name, frame, paths.changelog, "_cdc_commit_lsn", format_lsn)
        failures += problems
        log_counts: Counter[tuple[int, int, str]] = Counter()
        if log is not None:
            for r in (
                log.where(F.col("_cdc_position") > oracle_start)
                .groupBy("_cdc_position", "_cdc_xid", "_cdc_op")
                .count()
                .collect()
            ):
                log_counts[(r["_cdc_position"], r["_cdc_xid"] % 2**32, r["_cdc_op"])] = r["count"]
        decoded = oracle.get(name, Counter())
        total += sum(log_counts.values())
        decoded_totals[name] = sum(decoded.values())
        for commit in sorted(set(log_counts) | set(decoded)):
            if log_counts[commit] != decoded[commit]:
                end, xid, op = commit
                kind = "gap" if log_counts[commit] < decoded[commit] else "extra"
                failures.append(
                    f"changelog {name}: commit {format_lsn(end)} xid {xid} op {op}: the changelog has "
                    f"{log_counts[commit]} changes, test_decoding {decoded[commit]} ({kind}; "
                    f"{sum(log_counts.values())} vs {sum(decoded.values())} in total)"
                )
                break
    return {"failures": failures, "changes": total, "decoded": decoded_totals, "largest_value": largest}


# ----------------------------------------------------------------------------------------------------------------
# The source as the runner sees it


def _until_done(statement: Callable[[], None], session: Session, ctx: WorkloadContext) -> None:
    """Run a schema event's ``statement`` (it commits) until it succeeds or the workload stops: a lock timeout or a
    source restart rolls it back and it runs again; a harness bug (``HARNESS_BUGS``) stops the seed."""
    while not ctx.stop.is_set():
        try:
            statement()
            return
        except HARNESS_BUGS:
            raise
        except psycopg.Error:
            session.rollback()
            time.sleep(0.5)


@dataclass
class PostgresSeed:
    """One seed's database (``SeedSource``)."""

    cluster: Cluster
    database: str
    spec: dict[str, Any]
    rows: dict[str, int]
    oracle_start: int
    added: dict[str, list[Column]] = field(default_factory=dict)  # columns the schema events added so far

    @property
    def dsn(self) -> str:
        return self.cluster.admin_dsn(self.database)

    @property
    def name(self) -> str:
        return f"database {self.database}"

    def workload(self, ctx: WorkloadContext, seed: int, duration: float, rate: float, writers: int
                 ) -> list[threading.Thread]:  # fmt: skip
        threads: list[threading.Thread] = [
            Writer(f"writer{i}", seed, rate / writers, ctx, self) for i in range(writers)
        ]
        threads.append(LongTransactions(seed, duration, ctx, self))
        return threads

    def schema_events(self, r: random.Random) -> list[tuple[float, str]]:
        return [(r.uniform(0.2, 0.35), "add_column:0"), (r.uniform(0.4, 0.55), "add_column:1"),
                (r.uniform(0.3, 0.7), "truncate")]  # fmt: skip

    def run_event(self, event: str, ctx: WorkloadContext, r: random.Random) -> None:
        session = Session(self.dsn, ctx.tally, ctx.stop)
        try:
            if event.startswith("add_column"):
                self.add_column(ADDED_COLUMNS[int(event.split(":")[1])], session, ctx)
            elif event == "truncate":
                self.truncate(r.choice(["pair_items", "text_notes"]), session, ctx, r)
            else:
                raise ValueError(f"unknown event {event!r}")
        finally:
            session.close()

    def add_column(self, added: tuple[str, Column], session: Session, ctx: WorkloadContext) -> None:
        table, column = added

        def statement() -> None:
            session.run(None, sql.SQL("alter table {} add column {} {}").format(
                sql.Identifier(table), sql.Identifier(column.name), sql.SQL(column.type)))  # fmt: skip
            session.commit()
            self.added.setdefault(table, []).append(column)

        _until_done(statement, session, ctx)

    def truncate(self, table: str, session: Session, ctx: WorkloadContext, r: random.Random) -> None:
        ops = Ops(session, r, self.rows, self.added)

        def statement() -> None:
            session.run(None, sql.SQL("truncate {}").format(sql.Identifier(table)))
            session.pending[table] += 1  # one change per truncated table
            if r.random() < 0.5:
                session.commit()  # re-inserted by a later transaction
            for _ in range(self.rows[table] // 2):
                ops.insert(table)
            session.commit()

        _until_done(statement, session, ctx)

    def verify_args(self) -> dict[str, Any]:
        return {"admin_dsn": self.dsn, "oracle_start": self.oracle_start}

    def drop(self) -> None:
        drop_database(self.cluster, self.database)


class PostgresTorture:
    """The PostgreSQL cluster under torture (``TortureSource``)."""

    kind = "postgres"
    restart_fault = "pg-restart"

    def __init__(self, port: int, state: Path) -> None:
        self.cluster = Cluster(port, state)

    @staticmethod
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument("--pg-port", type=int, default=54339, help="cluster port (54329 is the test suite's)")
        group.add_argument("--pg-state", type=Path, default=ROOT / ".state" / "torture-pg", help="cluster folder")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PostgresTorture:
        return cls(args.pg_port, args.pg_state.resolve())

    def running(self) -> bool:
        return self.cluster.running()

    def start(self) -> None:
        self.cluster.start()

    def stop(self) -> None:
        self.cluster.stop()

    def restart(self) -> None:
        self.cluster.restart()

    def create(self, seed: int, r: random.Random, scale: float, lake: Path, chunk_size: int) -> PostgresSeed:
        database = f"torture_{seed}"
        rows = base_rows(scale)
        oracle_start = create_database(self.cluster, database, r, rows)
        spec = {"db": database, "port": self.cluster.port, "lake": str(lake),
                "chunk_size": chunk_size}  # fmt: skip
        return PostgresSeed(self.cluster, database, spec, rows, oracle_start)

    @staticmethod
    def build_config(spec: Mapping[str, Any]) -> CdcConfig:
        return build_config(spec)

    @staticmethod
    def offset_position(offset: Mapping[str, object]) -> int:
        return parse_lsn(str(offset["lsn"]))

    @staticmethod
    def verify(spark: Any, spec: Mapping[str, Any], args: Mapping[str, Any]) -> VerifyResult:
        return verify(spark, spec, str(args["admin_dsn"]), int(args["oracle_start"]))

    @staticmethod
    def break_settled_rule() -> None:
        from pyspark.sql import functions as F

        from cdc_assets.sources.postgres.watermark import PostgresSettledRule

        def every_transaction_settled(self: PostgresSettledRule) -> Any:
            return F.lit(False)

        PostgresSettledRule.unsettled = every_transaction_settled  # type: ignore[method-assign]
