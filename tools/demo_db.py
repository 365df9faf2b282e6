"""Demo source database: ``setup`` creates it with three tables of different key types; ``workload`` writes to it.

    python tools/demo_db.py setup      # as the local admin (unix socket, OS user postgres)
    python tools/demo_db.py workload   # inserts, updates, deletes, key updates until interrupted

``setup --database NAME --role ROLE --scale F`` makes another database of the same shape (the browser test's is
``--scale 0.01``: 200 customers, 500 orders, 600 order lines) with its own read-only role, beside the demo's.

Environment: CDC_PG_SOCKET, CDC_PG_PORT, CDC_DEMO_PASSWORD (password of the read-only role, default cdc_reader).
"""

from __future__ import annotations

import argparse
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
from generate_series(1, {customers}) g;
insert into orders
select g, md5('c' || (g % {customers} + 1))::uuid, (array['new','paid','shipped'])[g % 3 + 1], (g % 500) + 0.99,
       now() - g * interval '1 minute', current_date - (g % 30), case when g % 7 = 0 then 'fragile' end,
       array['t' || (g % 5)]
from generate_series(1, {orders}) g;
insert into order_lines
select o, l, 'SKU-' || ((o * l) % 997), l, (o % 90) + 0.5
from generate_series(1, {lined_orders}) o, generate_series(1, 3) l;
"""
# rows at scale 1 (the demo): customers, orders, orders with three lines each
ROWS = {"customers": 20000, "orders": 50000, "lined_orders": 20000}


def setup(database: str = "demo", role: str = "cdc_reader", scale: float = 1.0) -> None:
    """Create ``database`` (kept when it exists) with the three tables at ``scale`` times the demo's rows, the
    read-only ``role`` (password ``CDC_DEMO_PASSWORD``) and the publication ``cdc_demo`` for all its tables."""
    password = os.environ["CDC_DEMO_PASSWORD"]
    reader = sql.Identifier(role)
    with psycopg.connect(f"{ADMIN} dbname=postgres", autocommit=True) as root:
        exists = root.execute("select 1 from pg_database where datname = %s", [database]).fetchone()
        if exists:
            print(f"{database} database exists; keeping it")
        else:
            root.execute(sql.SQL("create database {}").format(sql.Identifier(database)))
        found = root.execute("select 1 from pg_roles where rolname = %s", [role]).fetchone()
        statement = "alter role {} password {}" if found else "create role {} login replication password {}"
        root.execute(sql.SQL(statement).format(reader, sql.Literal(password)))
        root.execute(sql.SQL("alter role {} set default_transaction_read_only = on").format(reader))
    if exists:
        return
    rows = {name: max(1, round(count * scale)) for name, count in ROWS.items()}
    with psycopg.connect(f"{ADMIN} dbname={database}", autocommit=True) as conn:
        conn.execute(SCHEMA.format(**rows))
        conn.execute(sql.SQL("grant select on all tables in schema public to {}").format(reader))
        conn.execute(sql.SQL("alter default privileges in schema public grant select on tables to {}").format(reader))
        # the administrator creates the publication (the read-only role owns no table); the slot is left to the
        # pipeline, which may create it (REPLICATION attribute)
        conn.execute("create publication cdc_demo for all tables")
    print(
        f"{database} database created: customers (uuid key, {rows['customers']} rows), orders (bigint key, "
        f"{rows['orders']} rows), order_lines (composite key, {3 * rows['lined_orders']} rows)"
    )


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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="demo_db.py", description="The demo's source database.")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("setup", help="create the database, its read-only role and publication")
    create.add_argument("--database", default="demo")
    create.add_argument("--role", default="cdc_reader", help="the read-only role (password: CDC_DEMO_PASSWORD)")
    create.add_argument("--scale", type=float, default=1.0, help="times the demo's rows (20k, 50k, 60k)")
    write = commands.add_parser("workload", help="write to the demo database until interrupted")
    write.add_argument("rate", nargs="?", type=float, default=200.0, help="changes per second")
    args = parser.parse_args(argv)
    if args.command == "setup":
        setup(args.database, args.role, args.scale)
    else:
        workload(args.rate)


if __name__ == "__main__":
    main(sys.argv[1:])
