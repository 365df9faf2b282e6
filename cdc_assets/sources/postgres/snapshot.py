"""Chunk planning queries, the read-only watermark window, and chunk read queries for PostgreSQL.

Contract:
- ``plan_chunks`` returns a ``ChunkPlan`` for a captured table: an even split for a dense single integer key,
  otherwise boundaries found by ordered ``LIMIT`` scans over the key (uses the primary-key index).
- ``take_low_watermark`` returns ``pg_current_snapshot()`` (step 1 of the window) and ``take_high_watermark``
  returns ``pg_current_wal_insert_lsn()`` (``pg_last_wal_replay_lsn()`` on a standby) (step 3). Both assign no xid
  and write nothing.
- ``chunk_select`` is the SELECT of one chunk (or a sub-range of it) for ``COPY (...) TO STDOUT``: all columns,
  ``lo <= key < hi`` as a row comparison, bound values cast to the key column types. For text keys whose collation
  is not byte-ordered the comparisons use ``COLLATE "C"``, so that PostgreSQL and Spark agree on chunk membership.
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
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.lsn import parse_lsn
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
    key_text = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c.name)) for c in table.key)
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
    function = "pg_last_wal_replay_lsn" if in_recovery(conn) else "pg_current_wal_insert_lsn"
    (lsn,) = conn.execute(f"select {function}()::text").fetchone()
    return parse_lsn(lsn)


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
