"""The PostgreSQL half of the per-chunk consistency check (the check itself: ``cdc_assets.consistency``).

Contract: ``PostgresCheckSession`` (a ``cdc_assets.dialect.CheckSession``) holds two connections of the pipeline's
role: one takes the watermarks (``pg_current_snapshot()`` as the low watermark, the WAL insert position as the high
watermark) and reads the catalog; the other runs one ``REPEATABLE READ, READ ONLY`` transaction, opened after the low
watermark, in which PostgreSQL computes each chunk's row count and checksum (the sum of
``row_digest.source_row_digest`` over the key range), the count and digests of keys the check leaves out (a hash
join with an array, not a temporary table: the check writes nothing), and the key digests and column texts that name
the first difference. The transaction is rolled back when the session ends. The mirror side is ``row_digest``'s
Spark half, computed alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psycopg
from psycopg import sql
from pyspark.sql import Column

from cdc_assets.engine.chunks import Chunk
from cdc_assets.sources.postgres import catalog, snapshot
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.row_digest import (
    mirror_column_texts,
    mirror_key_text,
    mirror_row_digest,
    source_column_texts,
    source_key_text,
    source_row_digest,
)


class PostgresCheckSession:
    def __init__(self, conn: psycopg.Connection, reader: psycopg.Connection) -> None:
        self.conn, self.reader = conn, reader

    def low_watermark(self) -> str:
        text = snapshot.take_low_watermark(self.conn).text()
        self.reader.execute("start transaction isolation level repeatable read, read only")
        return text

    def current_table(self, table: CapturedTable) -> CapturedTable:
        return catalog.with_current_columns(self.conn, table)

    def summaries(self, table: CapturedTable, chunks: Sequence[Chunk]) -> list[tuple[int, int]]:
        """Count and digest sum per chunk, in the transaction's snapshot (taken by its first statement)."""
        results = []
        for chunk in chunks:
            query = sql.SQL("select count(*), coalesce(sum({}), 0) from {} where {}").format(
                source_row_digest(table.columns), table.identifier, snapshot.range_predicate(table, chunk.lo, chunk.hi)
            )
            count, total = self.reader.execute(query).fetchone()
            results.append((int(count), int(total)))
        return results

    def high_watermark(self) -> int:
        return snapshot.take_high_watermark(self.conn)

    def summary_of_keys(self, table: CapturedTable, chunk: Chunk, key_texts: list[str]) -> tuple[int, int]:
        query = sql.SQL(
            "select count(*), coalesce(sum(r.digest), 0) from (select {} as key_text, {} as digest from {} where {}) r "
            "join unnest({}::text[]) as k(key_text) using (key_text)"
        ).format(
            source_key_text(table.columns, table.key_columns), source_row_digest(table.columns), table.identifier,
            snapshot.range_predicate(table, chunk.lo, chunk.hi), sql.Literal(key_texts),
        )  # fmt: skip
        count, total = self.reader.execute(query).fetchone()
        return int(count), int(total)

    def key_digests(self, table: CapturedTable, chunk: Chunk) -> list[tuple[str, int]]:
        query = sql.SQL("select {}, {} from {} where {}").format(
            source_key_text(table.columns, table.key_columns), source_row_digest(table.columns), table.identifier,
            snapshot.range_predicate(table, chunk.lo, chunk.hi),
        )  # fmt: skip
        return [(k, int(d)) for k, d in self.reader.execute(query).fetchall()]

    def row_texts(self, table: CapturedTable, chunk: Chunk, key_text: str) -> dict[str, str | None] | None:
        query = sql.SQL("select {} from {} where {} and {} = {}").format(
            sql.SQL(", ").join(source_column_texts(table.columns)), table.identifier,
            snapshot.range_predicate(table, chunk.lo, chunk.hi), source_key_text(table.columns, table.key_columns),
            sql.Literal(key_text),
        )  # fmt: skip
        found = self.reader.execute(query).fetchone()
        return None if found is None else dict(zip([c.name for c in table.columns], found, strict=True))

    def mirror_row_digest(self, table: CapturedTable) -> Column:
        return mirror_row_digest(table.columns)

    def mirror_key_text(self, table: CapturedTable, with_unrepresentable: bool) -> Column:
        return mirror_key_text(table.columns, table.key_columns, with_unrepresentable)

    def mirror_column_texts(self, table: CapturedTable) -> list[Column]:
        texts = mirror_column_texts(table.columns)
        return [t.alias(c.name) for t, c in zip(texts, table.columns, strict=True)]


@contextmanager
def check_session(conn: psycopg.Connection, reader: psycopg.Connection) -> Iterator[PostgresCheckSession]:
    """A check's session on two open connections; the reader's transaction is rolled back at the end."""
    try:
        yield PostgresCheckSession(conn, reader)
    finally:
        if not reader.broken and reader.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            reader.execute("rollback")
