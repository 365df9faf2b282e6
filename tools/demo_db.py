"""Demo source database: ``setup`` creates it with three tables of different key types; ``workload`` writes to it.

    python tools/demo_db.py setup      # as the local admin (unix socket, OS user postgres)
    python tools/demo_db.py workload   # inserts, updates, deletes, key updates until interrupted
    python tools/demo_db.py extras     # a table added while it runs, 1-64 MB values, a reused key, a burst

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
from collections.abc import Callable

import psycopg
import psycopg.types.json
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
    """Write until SIGTERM or SIGINT. A lost connection (the server restarted or stopped) is said and opened again
    every 2 s: the transaction it cut was rolled back, so the next order id is read again."""
    stop = False

    def handle(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    rng = random.Random(7)
    while not stop:
        try:
            write_transactions(rate, rng, lambda: stop)
        except psycopg.OperationalError as error:
            if stop:
                break
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            print(f"workload: {reason}; connecting again in 2 s", flush=True)
            time.sleep(2)
    print("workload stopped")


def write_transactions(rate: float, rng: random.Random, stopped: Callable[[], bool]) -> None:
    """The workload's transactions of 10 changes at ``rate`` changes/s on one connection until ``stopped()``."""
    with psycopg.connect(f"{ADMIN} dbname=demo", autocommit=True) as conn:
        (next_order,) = conn.execute("select coalesce(max(id), 0) + 1 from orders").fetchone()
        while not stopped():
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


DOCUMENTS = """
create table if not exists documents (
    id bigint primary key, title text, body text, blob bytea, meta jsonb, score numeric, valid_until timestamptz,
    tags text[]
)
"""
# value sizes of the big rows (bytes): PostgreSQL allows 1 GB per value; these are what real documents hold
BIG_VALUES = {1: 1 << 20, 2: 16 << 20, 3: 64 << 20}


def extras(burst: int = 20000) -> None:
    """What a user meets beside the steady workload, each step printed: the table ``documents`` added while the
    demo streams (the planner snapshots it, the stream captures it: the publication is for all tables), rows with
    values of 1, 16 and 64 MB (text, bytea, jsonb) and odd values (numeric NaN, timestamptz infinity), a freed key
    reused (deleted, then inserted again with other values, once in the same transaction and once in the next), and
    a burst of ``burst`` single-row transactions into ``orders`` as fast as one connection sends them."""
    with psycopg.connect(f"{ADMIN} dbname=demo", autocommit=True) as conn:
        conn.execute(DOCUMENTS)
        print("table documents created (added while the demo runs)")
        for key, size in BIG_VALUES.items():
            text = ("lorem ipsum " * (size // 12 + 1))[:size]
            conn.execute(
                "insert into documents values (%s, %s, %s, %s, %s, 'NaN', 'infinity', %s) on conflict (id) do update "
                "set body = excluded.body, blob = excluded.blob, meta = excluded.meta",
                [key, f"doc {key}", text, os.urandom(size), psycopg.types.json.Jsonb({"pad": "x" * (size // 4)}),
                 ["big", str(size)]],
            )  # fmt: skip
            print(f"documents {key}: text and bytea of {size >> 20} MB each, jsonb of {size >> 12} KB")
        conn.execute(
            "insert into documents values (10, 'reused', 'first life', '\\x01', '{}', 1.5, now(), '{a}') "
            "on conflict (id) do nothing"
        )
        conn.execute("delete from documents where id = 10")
        conn.execute("insert into documents values (10, 'reused', 'second life', '\\x02', '{\"life\": 2}', 2.5, "
                     "'-infinity', '{b}')")  # fmt: skip
        with conn.transaction():
            conn.execute("delete from documents where id = 10")
            conn.execute("insert into documents values (10, 'reused', 'third life', '\\x03', '{\"life\": 3}', "
                         "'Infinity', now(), '{c,NULL}')")  # fmt: skip
        print("documents 10: deleted and inserted again twice (the next transaction; the same one)")
        (next_order,) = conn.execute("select coalesce(max(id), 0) + 1000000 from orders").fetchone()
        started = time.monotonic()
        for number in range(burst):  # autocommit: each its own transaction (a pipeline would make them one)
            conn.execute(
                "insert into orders (id, status, total, placed_at) values (%s, 'burst', %s, now())",
                [next_order + number, number % 1000],
            )
        seconds = time.monotonic() - started
        print(f"orders: a burst of {burst} single-row transactions in {seconds:.1f} s ({burst / seconds:,.0f}/s)")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="demo_db.py", description="The demo's source database.")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser("setup", help="create the database, its read-only role and publication")
    create.add_argument("--database", default="demo")
    create.add_argument("--role", default="cdc_reader", help="the read-only role (password: CDC_DEMO_PASSWORD)")
    create.add_argument("--scale", type=float, default=1.0, help="times the demo's rows (20k, 50k, 60k)")
    write = commands.add_parser("workload", help="write to the demo database until interrupted")
    write.add_argument("rate", nargs="?", type=float, default=200.0, help="changes per second")
    more = commands.add_parser("extras", help="add a table with big and odd values, reuse a key, send a burst")
    more.add_argument("--burst", type=int, default=20000, help="single-row transactions sent as fast as they go")
    args = parser.parse_args(argv)
    if args.command == "setup":
        setup(args.database, args.role, args.scale)
    elif args.command == "extras":
        extras(args.burst)
    else:
        workload(args.rate)


if __name__ == "__main__":
    main(sys.argv[1:])
