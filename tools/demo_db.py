"""Demo source database: ``setup`` creates it with three tables of different key types; ``workload`` writes to it.

    python tools/demo_db.py setup      # as the local admin (unix socket, OS user postgres)
    python tools/demo_db.py workload   # inserts, updates, deletes, key updates until interrupted

Environment: CDC_PG_SOCKET, CDC_PG_PORT, CDC_DEMO_PASSWORD (password of the read-only role cdc_reader).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time

import psycopg
from psycopg import sql

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOCKET = os.environ.get("CDC_PG_SOCKET", os.path.join(ROOT, ".state", "pg", "sock"))
PORT = os.environ.get("CDC_PG_PORT", "54329")
ADMIN = f"host={SOCKET} port={PORT} user=postgres"

SCHEMA = """
create table customers (
    id uuid primary key, email text not null, name text, tier text, balance numeric(14, 2),
    signed_up timestamptz, profile jsonb
);
create table orders (
    id bigint primary key, customer_id uuid, status text, total numeric(12, 2), placed_at timestamptz,
    ship_date date, notes text, tags text[]
);
create table order_lines (
    order_id bigint, line_no int, sku text, qty int, unit_price numeric(10, 2), primary key (order_id, line_no)
);
insert into customers
select md5('c' || g)::uuid, 'user' || g || '@example.com', 'Customer ' || g, (array['free','pro','team'])[g % 3 + 1],
       (g % 1000) * 1.5, now() - g * interval '1 hour', jsonb_build_object('n', g)
from generate_series(1, 20000) g;
insert into orders
select g, md5('c' || (g % 20000 + 1))::uuid, (array['new','paid','shipped'])[g % 3 + 1], (g % 500) + 0.99,
       now() - g * interval '1 minute', current_date - (g % 30), case when g % 7 = 0 then 'fragile' end,
       array['t' || (g % 5)]
from generate_series(1, 50000) g;
insert into order_lines
select o, l, 'SKU-' || ((o * l) % 997), l, (o % 90) + 0.5 from generate_series(1, 20000) o, generate_series(1, 3) l;
"""


def setup() -> None:
    password = os.environ["CDC_DEMO_PASSWORD"]
    with psycopg.connect(f"{ADMIN} dbname=postgres", autocommit=True) as root:
        exists = root.execute("select 1 from pg_database where datname = 'demo'").fetchone()
        if exists:
            print("demo database exists; keeping it")
        else:
            root.execute("create database demo")
        role = root.execute("select 1 from pg_roles where rolname = 'cdc_reader'").fetchone()
        statement = "alter role cdc_reader" if role else "create role cdc_reader login replication"
        root.execute(sql.SQL(statement + " password {}").format(sql.Literal(password)))
        root.execute("alter role cdc_reader set default_transaction_read_only = on")
    if exists:
        return
    with psycopg.connect(f"{ADMIN} dbname=demo", autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute("grant select on all tables in schema public to cdc_reader")
        conn.execute("alter default privileges in schema public grant select on tables to cdc_reader")
        # the administrator creates the publication (the read-only role owns no table); the slot is left to the
        # pipeline, which may create it (REPLICATION attribute)
        conn.execute("create publication cdc_demo for all tables")
    print("demo database created: customers (uuid key), orders (bigint key), order_lines (composite key)")


def workload(rate: float = 200.0) -> None:
    stop = False

    def handle(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    rng = random.Random(7)
    with psycopg.connect(f"{ADMIN} dbname=demo", autocommit=True) as conn:
        (next_order,) = conn.execute("select coalesce(max(id), 0) + 1 from orders").fetchone()
        while not stop:
            started = time.monotonic()
            with conn.transaction():
                for _ in range(10):
                    action = rng.random()
                    order = rng.randint(1, next_order)
                    if action < 0.35:
                        conn.execute(
                            "insert into orders (id, customer_id, status, total, placed_at) "
                            "values (%s, md5('c' || %s)::uuid, 'new', %s, now())",
                            [next_order, rng.randint(1, 20000), rng.randint(1, 999)],
                        )
                        conn.execute(
                            "insert into order_lines values (%s, 1, 'SKU-1', 1, 9.99) on conflict do nothing",
                            [next_order],
                        )
                        next_order += 1
                    elif action < 0.75:
                        conn.execute("update orders set status = 'paid', total = total + 1 where id = %s", [order])
                        conn.execute(
                            "update customers set balance = balance + 1 where id = md5('c' || %s)::uuid",
                            [rng.randint(1, 20000)],
                        )
                    elif action < 0.9:
                        conn.execute("delete from order_lines where order_id = %s", [order])
                        conn.execute("delete from orders where id = %s", [order])
                    else:
                        conn.execute(
                            "update order_lines set line_no = line_no + 100 where order_id = %s and line_no < 100",
                            [order],
                        )
            time.sleep(max(0.0, 10 / rate - (time.monotonic() - started)))
    print("workload stopped")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "setup":
        setup()
    elif command == "workload":
        workload(float(sys.argv[2]) if len(sys.argv) > 2 else 200.0)
    else:
        sys.exit("usage: demo_db.py setup | workload [changes_per_second]")
