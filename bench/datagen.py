"""Benchmark data in database ``bench``: wide tables of generated rows and a server-side write workload.

- ``ensure_table(name, rows)``: table ``name`` with ``rows`` rows (ids 1..rows) and 10 columns of mixed types
  (bigint primary key, int, numeric(12,2), float8, text, text, timestamptz, date, bool, uuid; about 130 bytes per
  row on disk), loaded by two parallel sessions, then primary key, ``VACUUM (FREEZE, ANALYZE)`` (so that reading it
  sets no hint bits). A table with the same row count and layout version is reused (marked in its comment).
- ``install_workload()``: procedure ``bench_workload(table, n_tx, tx_size, changes, insert_share, delete_share)``
  that commits ``n_tx`` transactions of ``tx_size`` changes each: ``round(tx_size * insert_share)`` inserts (new ids
  above the live range), ``round(tx_size * delete_share)`` deletes (oldest ids), the rest updates of a contiguous live
  id range at a random place (4 columns changed). The live ids stay dense, so every statement changes exactly the
  rows it names. ``changes`` returns the number of rows changed. ``MIXES``: the shares of the named mixes
  (``update-heavy``, the default: 0.25 and 0.15, which at 10 changes per transaction is 3 inserts, 2 deletes and 5
  updates; ``insert-heavy``: 0.9 and 0.04, at 10 changes 9 inserts and 1 update).
- ``PacedWorkload``: calls the procedure from a thread at a target rate of changes per second.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from bench.common import admin_connect, grant_select

LAYOUT_VERSION = 1

ROW_SQL = """
    g, mod(g * 7919, 100000)::int, (mod(g * 37, 1000000) / 100.0)::numeric(12,2), g * 0.001,
    (array['new','paid','shipped','cancelled'])[1 + mod(g, 4)::int], 'note ' || md5(g::text),
    timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second', date '2024-01-01' + mod(g, 3650)::int,
    mod(g, 3) = 0, md5('r' || g)::uuid
"""  # no '%': the text goes into psycopg queries and into plpgsql format()

CREATE_SQL = """
create table {table} (
    id bigint {pk}, account_id integer not null, amount numeric(12,2), price double precision, status text,
    note text, created_at timestamptz, due_date date, active boolean, ref uuid
)
"""

COLUMNS = 10

WORKLOAD_SQL = """
drop procedure if exists bench_workload(text, int, int, bigint);
create or replace procedure bench_workload(
    tbl text, n_tx int, tx_size int, inout changes bigint default 0, insert_share numeric default 0.25,
    delete_share numeric default 0.15
)
language plpgsql as $$
declare
    lo bigint; hi bigint; n_ins int; n_del int; n_upd int; rc bigint; base bigint;
begin
    execute format('select coalesce(min(id), 1), coalesce(max(id), 0) + 1 from %I', tbl) into lo, hi;
    n_ins := round(tx_size * insert_share); n_del := round(tx_size * delete_share); n_upd := tx_size - n_ins - n_del;
    changes := 0;
    for k in 1..n_tx loop
        execute format('insert into %I select ROW_SQL from generate_series($1::bigint, $2::bigint) g', tbl)
            using hi, hi + n_ins - 1;
        get diagnostics rc = row_count; changes := changes + rc; hi := hi + n_ins;
        execute format('delete from %I where id >= $1 and id < $2', tbl) using lo, lo + n_del;
        get diagnostics rc = row_count; changes := changes + rc; lo := lo + n_del;
        base := lo + floor(random() * greatest(1, hi - lo - n_upd))::bigint;
        execute format('update %I set amount = amount + 1, status = ''upd'', note = ''upd '' || md5(random()::text),'
                       ' created_at = clock_timestamp() where id >= $1 and id < $2', tbl) using base, base + n_upd;
        get diagnostics rc = row_count; changes := changes + rc;
        commit;
    end loop;
end $$;
"""


def _marker(rows: int) -> str:
    return f"bench rows={rows} layout={LAYOUT_VERSION}"


def ensure_table(name: str, rows: int, force: bool = False) -> bool:
    """Make table ``name`` hold exactly the generated ``rows`` rows; returns True when it had to be (re)built."""
    assert name.startswith("bench"), name
    with admin_connect() as conn:
        row = conn.execute("select obj_description(to_regclass(%s), 'pg_class')", [f"public.{name}"]).fetchone()
        if not force and row is not None and row[0] == _marker(rows):
            grant_select(conn, name)
            return False
        conn.execute(sql.SQL("drop table if exists {} cascade").format(sql.Identifier(name)))
        conn.execute(sql.SQL(CREATE_SQL).format(table=sql.Identifier(name), pk=sql.SQL("")))
    insert = sql.SQL("insert into {} select " + ROW_SQL + " from generate_series(%s::bigint, %s::bigint) g").format(
        sql.Identifier(name)
    )
    half = rows // 2
    ranges = [(1, half), (half + 1, rows)] if rows >= 2 else [(1, rows)]
    errors: list[BaseException] = []

    def load(lo: int, hi: int) -> None:
        try:
            with admin_connect() as session:
                session.execute("set synchronous_commit = off")
                session.execute(insert, [lo, hi])
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=load, args=r) for r in ranges if r[0] <= r[1]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    with admin_connect() as conn:
        conn.execute(sql.SQL("alter table {} add primary key (id)").format(sql.Identifier(name)))
        conn.execute(sql.SQL("vacuum (freeze, analyze) {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("comment on table {} is {}").format(sql.Identifier(name), sql.Literal(_marker(rows))))
        grant_select(conn, name)
    return True


def create_hot_table(name: str, rows: int) -> None:
    """A fresh table ``name`` of ``rows`` generated rows that the workload then changes (never reused)."""
    with admin_connect() as conn:
        conn.execute(sql.SQL("drop table if exists {} cascade").format(sql.Identifier(name)))
        conn.execute(sql.SQL(CREATE_SQL).format(table=sql.Identifier(name), pk=sql.SQL("primary key")))
        conn.execute(
            sql.SQL("insert into {} select " + ROW_SQL + " from generate_series(1, %s::bigint) g").format(
                sql.Identifier(name)
            ),
            [rows],
        )
        conn.execute(sql.SQL("vacuum (freeze, analyze) {}").format(sql.Identifier(name)))
        grant_select(conn, name)


def install_workload() -> None:
    with admin_connect() as conn:
        conn.execute(WORKLOAD_SQL.replace("ROW_SQL", " ".join(ROW_SQL.split()).replace("'", "''")))


MIXES = {"update-heavy": (0.25, 0.15), "insert-heavy": (0.9, 0.04)}  # (insert share, delete share)


def run_workload(conn: psycopg.Connection, table: str, n_tx: int, tx_size: int, mix: str = "update-heavy") -> int:
    """Commit ``n_tx`` transactions of ``tx_size`` changes of ``mix`` on ``table``; returns the number of changed
    rows."""
    inserts, deletes = MIXES[mix]
    (changes,) = conn.execute(
        "call bench_workload(%s, %s, %s, null, %s::numeric, %s::numeric)", [table, n_tx, tx_size, inserts, deletes]
    ).fetchone()
    return int(changes)


@dataclass
class PacedWorkload:
    """Writes ``rate`` changes per second (transactions of ``tx_size``) into ``table`` from a thread, in steps of
    ``tick`` seconds, until ``stop()``. ``series`` holds ``(monotonic time, cumulative changes)``."""

    table: str
    rate: float
    tx_size: int = 10
    tick: float = 0.1
    changes: int = 0
    series: list[tuple[float, int]] = field(default_factory=list)
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> PacedWorkload:
        self._thread = threading.Thread(target=self._run, name="bench-workload", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with admin_connect() as conn:
                conn.execute("set synchronous_commit = on")
                started = time.monotonic()
                transactions = 0
                while not self._stop.is_set():
                    due = int((time.monotonic() - started) * self.rate / self.tx_size) - transactions
                    if due > 0:
                        self.changes += run_workload(conn, self.table, due, self.tx_size)
                        transactions += due
                        self.series.append((time.monotonic(), self.changes))
                        self.after_step(conn)
                    self._stop.wait(self.tick)
        except BaseException as error:  # surfaced by stop()
            self.error = error

    def after_step(self, conn: psycopg.Connection) -> None:
        """Called after each step's transactions committed, on the workload's connection."""

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.changes
