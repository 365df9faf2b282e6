"""Chunk planning queries, the read-only watermark window, and chunk read queries for PostgreSQL.

Contract:
- ``plan_chunks`` returns a ``ChunkPlan`` for a captured table: an even split for a dense single integer key,
  otherwise boundaries found by ordered ``LIMIT`` scans over the key (uses the primary-key index).
- ``take_low_watermark`` returns ``pg_current_snapshot()`` (step 1 of the window) and ``take_high_watermark``
  returns the end of the WAL inserted so far: ``pg_current_wal_insert_lsn()``, except that where it points past an
  empty page's header it is the page's start (``lsn.end_of_inserted_wal``; ``pg_last_wal_replay_lsn()`` on a standby)
  (step 3). Both assign no xid and write nothing.
- ``chunk_select`` is the SELECT of one chunk (or a sub-range of it) for ``COPY (...) TO STDOUT``: all columns,
  ``lo <= key < hi`` as a row comparison, bound values cast to the key column types. For text keys whose collation
  is not byte-ordered the comparisons use ``COLLATE "C"``, so that PostgreSQL and Spark agree on chunk membership.
- ``filter_condition(table, row_filter)`` is the WHERE condition of an ad-hoc snapshot's ``RowFilter``
  (``cdc_assets.engine.row_filter``), composed by psycopg: each column an ``Identifier`` of a column the table has,
  each operator from a fixed map of the allowed ones, each value a ``Literal`` (quoted and escaped by psycopg) cast to
  its column's declared type, so ``"1; drop table t"`` is a string the cast refuses, never SQL. ``COPY`` takes no
  server-side parameters, hence literals composed client-side. A typed value (``{"$oid": ...}``) or a column the
  table no longer has raises ``RowFilterError``. ``rows_matching_select`` is the SELECT of every column of the rows
  matching it (every row for ``None``).
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from cdc_assets.engine.chunks import (
    Chunk,
    ChunkPlan,
    KeyBound,
    chunks_from_boundaries,
    plan_even_integer_chunks,
)
from cdc_assets.engine.row_filter import NO_VALUE_OPERATORS, FilterTerm, RowFilter, RowFilterError
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.lsn import end_of_inserted_wal, parse_lsn
from cdc_assets.sources.postgres.watermark import LowWatermark

INTEGER_TYPES = {"smallint", "integer", "bigint"}


def _key_parts(table: CapturedTable) -> list[sql.Composable]:
    parts: list[sql.Composable] = []
    for column in table.key:
        identifier = sql.Identifier(column.name)
        if not table.byte_ordered_key and column.category == "S":
            parts.append(sql.SQL('{} collate "C"').format(identifier))
        else:
            parts.append(identifier)
    return parts


def _key_expression(table: CapturedTable) -> sql.Composable:
    parts = _key_parts(table)
    return sql.SQL("({})").format(sql.SQL(", ").join(parts)) if len(parts) > 1 else parts[0]


def _bound_expression(table: CapturedTable, bound: KeyBound) -> sql.Composable:
    parts = []
    for column, value in zip(table.key, bound, strict=True):
        cast = sql.SQL("cast({} as {})").format(sql.Literal(value), sql.SQL(column.type_name))
        if not table.byte_ordered_key and column.category == "S":
            cast = sql.SQL('{} collate "C"').format(cast)
        parts.append(cast)
    return sql.SQL("({})").format(sql.SQL(", ").join(parts)) if len(parts) > 1 else parts[0]


def range_predicate(table: CapturedTable, lo: KeyBound | None, hi: KeyBound | None) -> sql.Composable:
    key = _key_expression(table)
    clauses: list[sql.Composable] = []
    if lo is not None:
        clauses.append(sql.SQL("{} >= {}").format(key, _bound_expression(table, lo)))
    if hi is not None:
        clauses.append(sql.SQL("{} < {}").format(key, _bound_expression(table, hi)))
    return sql.SQL(" and ").join(clauses) if clauses else sql.SQL("true")


def chunk_select(table: CapturedTable, lo: KeyBound | None, hi: KeyBound | None) -> sql.Composable:
    columns = sql.SQL(", ").join(sql.Identifier(c.name) for c in table.columns)
    return sql.SQL("select {} from {} where {}").format(columns, table.identifier, range_predicate(table, lo, hi))


def plan_chunks(conn: psycopg.Connection, table: CapturedTable) -> ChunkPlan:
    key_columns = tuple(c.name for c in table.key)
    if len(table.key) == 1 and table.key[0].type_name in INTEGER_TYPES:
        key = sql.Identifier(table.key[0].name)
        minimum, maximum = conn.execute(
            sql.SQL("select min({0}), max({0}) from {1}").format(key, table.identifier)
        ).fetchone()
        rows = _row_estimate(conn, table)
        if minimum is None:
            return ChunkPlan(table.qualified_name, key_columns, chunks_from_boundaries([]))
        even = plan_even_integer_chunks(minimum, maximum, rows, table.chunk_size)
        if even is not None:
            return ChunkPlan(table.qualified_name, key_columns, even)
    return ChunkPlan(table.qualified_name, key_columns, chunks_from_boundaries(_scan_boundaries(conn, table)))


def _row_estimate(conn: psycopg.Connection, table: CapturedTable) -> int:
    (estimate,) = conn.execute(
        "select reltuples::bigint from pg_class where oid = %s::regclass", [table.identifier.as_string(conn)]
    ).fetchone()
    if estimate is not None and estimate > 0:
        return int(estimate)
    (count,) = conn.execute(sql.SQL("select count(*) from {}").format(table.identifier)).fetchone()
    return int(count)


def _scan_boundaries(conn: psycopg.Connection, table: CapturedTable) -> list[KeyBound]:
    """The first key of every chunk after the first: each ``chunk_size`` keys further in key order.

    Each step is an index scan from the previous boundary (Flink CDC's uneven splitting), so planning reads the
    key index once in total.
    """
    # the bounds' text under names no column has: ``order by id`` names the output column ``id`` when there is one,
    # and would sort by its text (1200 composite integer keys: a first chunk of 935 rows instead of 300)
    key_text = sql.SQL(", ").join(
        sql.SQL("{}::text as {}").format(sql.Identifier(c.name), sql.Identifier(f"_cdc_bound_{i}"))
        for i, c in enumerate(table.key)
    )
    order = sql.SQL(", ").join(_key_parts(table))
    boundaries: list[KeyBound] = []
    previous: KeyBound | None = None
    while True:
        query = sql.SQL("select {} from {} where {} order by {} offset {} limit 1").format(
            key_text,
            table.identifier,
            range_predicate(table, previous, None),
            order,
            sql.Literal(table.chunk_size),
        )
        row = conn.execute(query).fetchone()
        if row is None:
            return boundaries
        previous = tuple(str(v) for v in row)
        boundaries.append(previous)


def in_recovery(conn: psycopg.Connection) -> bool:
    return bool(conn.execute("select pg_is_in_recovery()").fetchone()[0])


def take_low_watermark(conn: psycopg.Connection) -> LowWatermark:
    (snapshot,) = conn.execute("select pg_current_snapshot()::text").fetchone()
    return LowWatermark.parse(snapshot)


def take_insert_lsn(conn: psycopg.Connection) -> int:
    """The WAL position just before the low watermark, recorded with the window for diagnosis. Not a bound on the
    unsettled transactions' commits: one listed in ``xip`` may have written its commit record already (it waits for
    the WAL flush or a synchronous standby before it leaves the process array)."""
    return take_high_watermark(conn)


class PostgresWatermarks:
    """The ``Watermarks`` of a window (``cdc_assets.lake.watermark_window``) on one connection: the low watermark is
    ``pg_current_snapshot()`` (its text), with the WAL insert position taken just before it; the high watermark the
    WAL insert position (replay position on a standby) after the reads."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def low_watermark(self) -> tuple[int, str]:
        position = take_insert_lsn(self.conn)
        return position, take_low_watermark(self.conn).text()

    def high_watermark(self) -> int:
        return take_high_watermark(self.conn)


def max_integer_key(conn: psycopg.Connection, table: CapturedTable) -> int | None:
    """The largest key of a single-integer-key table (to split the open-ended last chunk), else ``None``."""
    if len(table.key) != 1 or table.key[0].type_name not in INTEGER_TYPES:
        return None
    key = sql.Identifier(table.key[0].name)
    (value,) = conn.execute(sql.SQL("select max({}) from {}").format(key, table.identifier)).fetchone()
    return value


def take_high_watermark(conn: psycopg.Connection) -> int:
    """The end of the WAL inserted so far (``end_of_inserted_wal``: a stream on an idle server reaches it), or on a
    standby the end of the last record replayed."""
    if in_recovery(conn):
        (lsn,) = conn.execute("select pg_last_wal_replay_lsn()::text").fetchone()
        return parse_lsn(lsn)
    return take_inserted_wal_end(conn)


def take_inserted_wal_end(conn: psycopg.Connection) -> int:
    """``end_of_inserted_wal`` of the primary's ``pg_current_wal_insert_lsn()``, in one statement."""
    lsn, block_size, segment_size = conn.execute(
        "select pg_current_wal_insert_lsn()::text, current_setting('wal_block_size')::int, "
        "(select setting::bigint from pg_settings where name = 'wal_segment_size')"
    ).fetchone()
    return end_of_inserted_wal(parse_lsn(lsn), int(block_size), int(segment_size))


def sub_ranges(table: CapturedTable, chunk: Chunk, parts: int, observed_max: int | None) -> list[Chunk]:
    """Split a chunk of a single integer key into ``parts`` sub-ranges for parallel reads (else the chunk)."""
    if parts <= 1 or len(table.key) != 1 or table.key[0].type_name not in INTEGER_TYPES:
        return [chunk]
    low = int(chunk.lo[0]) if chunk.lo is not None else None
    high = int(chunk.hi[0]) if chunk.hi is not None else (observed_max + 1 if observed_max is not None else None)
    if low is None or high is None or high - low < parts * 2:
        return [chunk]
    step = (high - low) // parts
    edges: list[KeyBound | None] = [chunk.lo]
    edges += [(str(low + step * i),) for i in range(1, parts)]
    edges.append(chunk.hi)
    return [Chunk(chunk.index, edges[i], edges[i + 1]) for i in range(parts)]


def rows_by_key_select(table: CapturedTable, keys: list[tuple]) -> sql.Composable:
    """SELECT of all columns of the rows whose key is one of ``keys`` (values cast to the key column types)."""
    key = sql.SQL("({})").format(sql.SQL(", ").join(sql.Identifier(c.name) for c in table.key))
    values = sql.SQL(", ").join(
        sql.SQL("({})").format(
            sql.SQL(", ").join(
                sql.SQL("cast({} as {})").format(sql.Literal(str(v)), sql.SQL(c.type_name))
                for c, v in zip(table.key, row, strict=True)
            )
        )
        for row in keys
    )
    columns = sql.SQL(", ").join(sql.Identifier(c.name) for c in table.columns)
    return sql.SQL("select {} from {} where {} in ({})").format(columns, table.identifier, key, values)


SQL_OPERATORS = {"=": "=", "!=": "<>", "<": "<", "<=": "<=", ">": ">", ">=": ">=", "in": "in", "not in": "not in",
                 "between": "between", "is null": "is null", "is not null": "is not null"}  # fmt: skip


def _value_text(value: object, where: str) -> str:
    """A filter value as the text PostgreSQL casts to the column's type."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | str):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    raise RowFilterError(
        f"{where}: {value!r} is a typed value (MongoDB extended JSON); a PostgreSQL filter value is a string, a "
        "number or a boolean, cast to the column's type"
    )


def _term_condition(table: CapturedTable, term: FilterTerm, where: str) -> sql.Composable:
    columns = {c.name: c for c in table.columns}
    column = columns.get(term.column)
    if column is None:
        raise RowFilterError(
            f"{where}: column {term.column!r} is not a column of the table (now); one of {', '.join(columns)}"
        )
    identifier = sql.Identifier(column.name)
    operator = sql.SQL(SQL_OPERATORS[term.op])
    if term.op in NO_VALUE_OPERATORS:
        return sql.SQL("{} {}").format(identifier, operator)

    def literal(value: object, label: str) -> sql.Composable:
        text = _value_text(value, f"{where}: {label}")
        return sql.SQL("cast({} as {})").format(sql.Literal(text), sql.SQL(column.type_name))

    if isinstance(term.value, tuple):
        values = [literal(v, f"value {n}") for n, v in enumerate(term.value, 1)]
        if term.op == "between":
            return sql.SQL("{} between {} and {}").format(identifier, values[0], values[1])
        return sql.SQL("{} {} ({})").format(identifier, operator, sql.SQL(", ").join(values))
    return sql.SQL("{} {} {}").format(identifier, operator, literal(term.value, "value"))


def filter_condition(table: CapturedTable, row_filter: RowFilter | None) -> sql.Composable:
    if row_filter is None:
        return sql.SQL("true")
    where = f"table {table.qualified_name}: filter"
    return sql.SQL(" and ").join(
        sql.SQL("({})").format(_term_condition(table, term, f"{where} term {n}"))
        for n, term in enumerate(row_filter.terms, 1)
    )


def rows_matching_select(table: CapturedTable, row_filter: RowFilter | None) -> sql.Composable:
    """SELECT of all columns of the rows matching ``row_filter`` (every row for None)."""
    columns = sql.SQL(", ").join(sql.Identifier(c.name) for c in table.columns)
    return sql.SQL("select {} from {} where {}").format(columns, table.identifier, filter_condition(table, row_filter))
