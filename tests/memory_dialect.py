"""A source that lives in Python lists, and its dialect: the reference dialect that proves the pipeline is generic.

Contract: ``MemoryDatabase`` holds tables (key tuple -> row) and a change log of committed transactions, each with
an integer position (one more per commit) and its changes in order. ``commit`` applies a transaction atomically
under a lock; a read sees every transaction committed before it and none after. ``MemoryDialect`` answers the
pipeline's questions the way a real source would (``cdc_assets.dialect.SourceDialect``):

- watermarks are log positions: the low watermark is the position of the last commit (its text, ``str(position)``),
  the high watermark the position after the reads; a transaction is settled at a low watermark when its position is
  at or below it (``MemorySettledRule``: by position, as a change-stream source such as MongoDB decides, not by
  transaction ids as PostgreSQL does);
- chunk reads copy the rows of each chunk's key range into staged files, one chunk at a time, calling
  ``database.during_read`` between chunks (tests commit there: changes between the low watermark and the reads, and
  between reads and the high watermark);
- ``read_batch`` reads whole transactions after the recorded offset (``{"position": N}``), at most ``max_changes``
  changes unless one transaction is larger, spilled as one Parquet file per table in the changelog format; a
  source that only forgets what was acknowledged (``acknowledge``), as a replication slot does;
- the consistency check's source half (``MemoryCheckSession``): counts and MD5-based row digests over a copy of
  the table taken at the check's first read, computed alike over the mirror on Spark;
- an ad-hoc snapshot of chosen rows reads the rows a Python predicate of the filter keeps (``matches``: SQL's
  rules, a NULL matches no comparison), calling ``database.during_read`` before and after the read; ``row_filter``
  refuses a value that is not of its column's Arrow type;
- no unchanged values, no truncates, no added columns, no partitions: what this source lacks, the pipeline must not
  need.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.dialect import ChangeBatch, Offset, OffsetError, TableChanges
from cdc_assets.engine.chunks import Chunk, ChunkPlan, chunks_from_boundaries
from cdc_assets.engine.row_filter import FilterTerm, RowFilter, RowFilterError, parse_row_filter
from cdc_assets.engine.windows import FILL_CHUNK, ROWS_CHUNK, WindowStart
from cdc_assets.lake import staging
from cdc_assets.lake.digest import mirror_digest, mirror_part, text_digest, text_part
from cdc_assets.lake.files import LakePath
from cdc_assets.lake.schema import UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE, spark_fields
from cdc_assets.source import CapturedTablesChanged, SourceLag

Key = tuple[Any, ...]
Row = dict[str, Any]


@dataclass(frozen=True)
class MemoryTable:
    qualified_name: str
    key_columns: tuple[str, ...]
    schema: pa.Schema  # the source columns, without ``_cdc_unrepresentable``

    def key_of(self, row: Row) -> Key:
        return tuple(row[k] for k in self.key_columns)

    @property
    def arrow_schema(self) -> pa.Schema:
        return self.schema.append(pa.field(UNREPRESENTABLE_COLUMN, UNREPRESENTABLE_TYPE))


@dataclass(frozen=True)
class Change:
    table: str
    op: str  # c, u, d
    before: Row | None
    after: Row | None


@dataclass(frozen=True)
class Transaction:
    position: int
    at: datetime
    changes: tuple[Change, ...]


@dataclass
class MemoryDatabase:
    tables: dict[str, MemoryTable]
    rows: dict[str, dict[Key, Row]] = field(default_factory=dict)
    log: list[Transaction] = field(default_factory=list)
    position: int = 0
    forgotten: int = 0  # the source forgets transactions at or below (acknowledged)
    during_read: Callable[[str, int], None] | None = None  # (table, chunk index) after each chunk's read
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        for name in self.tables:
            self.rows.setdefault(name, {})

    def create_table(self, table: MemoryTable) -> None:
        """A table created while the source is captured (``discover`` lists it from now on)."""
        with self.lock:
            self.tables[table.qualified_name] = table
            self.rows.setdefault(table.qualified_name, {})

    def commit(self, *writes: tuple[str, str, Key | None, Row | None]) -> int:
        """One transaction of ``(table, op, key, row)`` writes: ``insert`` (row), ``update`` (key, row: the row's own
        key may differ: a key change), ``delete`` (key). Raises ``KeyError`` for a write that does not apply."""
        with self.lock:
            changes = []
            for name, op, key, row in writes:
                table, rows = self.tables[name], self.rows[name]
                if op == "insert":
                    assert row is not None
                    new_key = table.key_of(row)
                    if new_key in rows:
                        raise KeyError(f"{name}: duplicate key {new_key}")
                    rows[new_key] = dict(row)
                    changes.append(Change(name, "c", None, dict(row)))
                elif op == "update":
                    assert key is not None and row is not None
                    before = rows.pop(key)
                    new_key = table.key_of(row)
                    if new_key in rows:
                        rows[key] = before
                        raise KeyError(f"{name}: duplicate key {new_key}")
                    rows[new_key] = dict(row)
                    changes.append(Change(name, "u", before, dict(row)))
                elif op == "delete":
                    assert key is not None
                    changes.append(Change(name, "d", rows.pop(key), None))
                else:
                    raise ValueError(op)
            self.position += 1
            self.log.append(Transaction(self.position, datetime.now(UTC), tuple(changes)))
            return self.position

    def snapshot(self, name: str) -> dict[Key, Row]:
        with self.lock:
            return {k: dict(v) for k, v in self.rows[name].items()}


class MemorySettledRule:
    """Settled at a low watermark: committed at or below its position (changelog column ``_cdc_position``)."""

    @property
    def window_fields(self) -> list[T.StructField]:
        return [T.StructField("_w_low", T.LongType())]

    def window_values(self, low_watermark: str) -> tuple[object, ...]:
        return (int(low_watermark),)

    def since(self, low_watermarks: Sequence[str]) -> Column:
        return F.col("_cdc_position") > min(int(text) for text in low_watermarks)

    def since_window(self) -> Column:
        return F.col("_cdc_position") > F.col("_w_low")

    def unsettled(self) -> Column:
        return F.col("_cdc_position") > F.col("_w_low")


def _in_chunk(table: MemoryTable, key: Key, chunk: Chunk) -> bool:
    def bound(values: tuple[str, ...]) -> Key:
        return tuple(type(part)(text) for part, text in zip(key, values, strict=True))

    return (chunk.lo is None or key >= bound(chunk.lo)) and (chunk.hi is None or key < bound(chunk.hi))


def _arrow_rows(table: MemoryTable, rows: Sequence[Row]) -> pa.Table:
    columns = {f.name: pa.array([r[f.name] for r in rows], f.type) for f in table.schema}
    columns[UNREPRESENTABLE_COLUMN] = pa.nulls(len(rows), UNREPRESENTABLE_TYPE)
    return pa.table(columns, schema=table.arrow_schema)


def _term_matches(term: FilterTerm, value: Any) -> bool:
    if term.op == "is null":
        return value is None
    if term.op == "is not null":
        return value is not None
    if value is None:  # SQL: a NULL matches no comparison
        return False
    if term.op == "between":
        low, high = term.value  # type: ignore[misc]
        return low <= value <= high
    if term.op == "in":
        return value in term.value  # type: ignore[operator]
    if term.op == "not in":
        return value not in term.value  # type: ignore[operator]
    compare: dict[str, Callable[[Any, Any], bool]] = {
        "=": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
    }  # fmt: skip
    return compare[term.op](value, term.value)


def matches(row_filter: RowFilter | None, row: Row) -> bool:
    """Whether ``row`` satisfies every term of ``row_filter`` (every row for None)."""
    return row_filter is None or all(_term_matches(t, row[t.column]) for t in row_filter.terms)


class MemoryWindow:
    def __init__(self, database: MemoryDatabase) -> None:
        self.database = database

    def low_watermark(self) -> tuple[int, str]:
        with self.database.lock:
            return self.database.position, str(self.database.position)

    def high_watermark(self) -> int:
        return self.database.position

    def stage_chunks(
        self, spark: SparkSession, table: MemoryTable, chunks: Sequence[Chunk], staging_path: str, attempt: str,
        start: WindowStart,
    ) -> dict[int, int]:  # fmt: skip
        counts = {}
        for chunk in chunks:
            rows = [r for k, r in sorted(self.database.snapshot(table.qualified_name).items())
                    if _in_chunk(table, k, chunk)]  # fmt: skip
            counts[chunk.index] = staging.write_part(
                staging_path,
                attempt,
                chunk.index,
                0,
                [_arrow_rows(table, rows)],
                table.arrow_schema,
                start,
                table.key_columns,
            )
            if self.database.during_read is not None:
                self.database.during_read(table.qualified_name, chunk.index)
        return counts

    def stage_rows_by_key(self, table: MemoryTable, keys: Sequence[tuple], staging_path: str, attempt: str) -> int:
        rows = self.database.snapshot(table.qualified_name)
        found = [rows[tuple(k)] for k in keys if tuple(k) in rows]
        return staging.write_part(staging_path, attempt, FILL_CHUNK, 0, [_arrow_rows(table, found)], table.arrow_schema)

    def stage_rows_matching(
        self, table: MemoryTable, row_filter: RowFilter | None, staging_path: str, attempt: str
    ) -> int:
        if self.database.during_read is not None:  # changes after the low watermark, seen by the read
            self.database.during_read(table.qualified_name, ROWS_CHUNK)
        rows = [r for _, r in sorted(self.database.snapshot(table.qualified_name).items()) if matches(row_filter, r)]
        schema = table.arrow_schema
        staged = staging.write_part(staging_path, attempt, ROWS_CHUNK, 0, [_arrow_rows(table, rows)], schema)
        if self.database.during_read is not None:  # changes after the read, before the high watermark
            self.database.during_read(table.qualified_name, ROWS_CHUNK)
        return staged


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


class MemoryCheckSession:
    """A consistency check's source half: one copy of the table taken at the first read (the consistent view); a
    row's digest is the first 64 bits of the MD5 of its column texts (``<bytes>:<text>``, ``~`` for NULL), which the
    mirror side computes alike on Spark."""

    def __init__(self, database: MemoryDatabase) -> None:
        self.database = database
        self.view: dict[str, dict[Key, Row]] = {}

    def low_watermark(self) -> str:
        return str(self.database.position)

    def current_table(self, table: MemoryTable) -> MemoryTable:
        return table

    def _rows(self, table: MemoryTable, chunk: Chunk) -> list[Row]:
        if table.qualified_name not in self.view:
            self.view[table.qualified_name] = self.database.snapshot(table.qualified_name)
        return [r for k, r in sorted(self.view[table.qualified_name].items()) if _in_chunk(table, k, chunk)]

    def _key_text(self, table: MemoryTable, row: Row) -> str:
        return "".join(text_part(_text(row[k])) for k in table.key_columns)

    def _digest(self, table: MemoryTable, row: Row) -> int:
        return text_digest([_text(row[n]) for n in table.schema.names])

    def summaries(self, table: MemoryTable, chunks: Sequence[Chunk]) -> list[tuple[int, int]]:
        return [
            (len(rows), sum(self._digest(table, r) for r in rows)) for rows in (self._rows(table, c) for c in chunks)
        ]

    def high_watermark(self) -> int:
        return self.database.position

    def summary_of_keys(self, table: MemoryTable, chunk: Chunk, key_texts: list[str]) -> tuple[int, int]:
        wanted = set(key_texts)
        rows = [r for r in self._rows(table, chunk) if self._key_text(table, r) in wanted]
        return len(rows), sum(self._digest(table, r) for r in rows)

    def key_digests(self, table: MemoryTable, chunk: Chunk) -> list[tuple[str, int]]:
        return [(self._key_text(table, r), self._digest(table, r)) for r in self._rows(table, chunk)]

    def row_texts(self, table: MemoryTable, chunk: Chunk, key_text: str) -> dict[str, str | None] | None:
        for row in self._rows(table, chunk):
            if self._key_text(table, row) == key_text:
                return {n: _text(row[n]) for n in table.schema.names}
        return None

    def mirror_row_digest(self, table: MemoryTable) -> Column:
        return mirror_digest([F.col(n).cast("string") for n in table.schema.names])

    def mirror_key_text(self, table: MemoryTable, with_unrepresentable: bool) -> Column:
        return F.concat(*[mirror_part(F.col(k).cast("string")) for k in table.key_columns])

    def mirror_column_texts(self, table: MemoryTable) -> list[Column]:
        return [F.col(n).cast("string").alias(n) for n in table.schema.names]


class MemoryDialect:
    settled_rule = MemorySettledRule()

    def __init__(self, database: MemoryDatabase, chunk_size: int) -> None:
        self.database = database
        self.chunk_size = chunk_size

    def describe(self) -> str:
        return "the in-memory change log"

    def discover(self) -> tuple[list[MemoryTable], list[Any]]:
        return list(self.database.tables.values()), []

    def plan_chunks(self, table: MemoryTable) -> ChunkPlan:
        keys = sorted(self.database.snapshot(table.qualified_name))
        boundaries = [tuple(str(part) for part in key) for key in keys[self.chunk_size :: self.chunk_size]]
        return ChunkPlan(table.qualified_name, table.key_columns, chunks_from_boundaries(boundaries))

    def row_filter(self, table: MemoryTable, raw: object) -> RowFilter:
        row_filter = parse_row_filter(raw, table.qualified_name, table.schema.names)
        for n, term in enumerate(row_filter.terms, 1):
            values = term.value if isinstance(term.value, tuple) else () if term.value is None else (term.value,)
            for value in values:
                try:
                    pa.scalar(value, table.schema.field(term.column).type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as error:
                    raise RowFilterError(
                        f"table {table.qualified_name}: filter term {n}: value {value!r} is not of column "
                        f"{term.column}'s type {table.schema.field(term.column).type}: {error}"
                    ) from None
        return row_filter

    @contextmanager
    def window(self) -> Iterator[MemoryWindow]:
        yield MemoryWindow(self.database)

    def read_batch(
        self, recorded: Offset | None, tables: Mapping[str, MemoryTable], spill_dir: LakePath, max_changes: int,
        max_bytes: int,
    ) -> ChangeBatch:  # fmt: skip
        database = self.database
        with database.lock:
            if recorded is not None:
                database.forgotten = max(database.forgotten, self.position(recorded))
            head = database.position
            waiting = [t for t in database.log if t.position > database.forgotten]
        taken: list[Transaction] = []
        count = 0
        for transaction in waiting:
            if taken and count + len(transaction.changes) > max_changes:
                break
            taken.append(transaction)
            count += len(transaction.changes)
        cut = len(taken) < len(waiting)
        applied = taken[-1].position if cut else head
        per_table: dict[str, list[dict[str, Any]]] = {}
        with database.lock:
            existing = set(database.tables)
        newly_captured = sorted({c.table for t in taken for c in t.changes if c.table not in tables} & existing)
        if newly_captured:  # created since the run resolved its tables: they are captured now
            raise CapturedTablesChanged(newly_captured)
        for transaction in taken:
            for seq, change in enumerate(transaction.changes):
                per_table.setdefault(change.table, []).append(
                    {"_cdc_op": change.op, "_cdc_position": transaction.position, "_cdc_seq": seq,
                     "_cdc_ts": transaction.at, "_cdc_before_key_only": False, "_cdc_unchanged": [],
                     "after": change.after, "before": change.before}
                )  # fmt: skip
        spills: dict[str, TableChanges] = {}
        for name, changes in per_table.items():
            table = tables[name]
            image = pa.struct(list(table.arrow_schema))
            schema = pa.schema([
                ("_cdc_op", pa.string()), ("_cdc_position", pa.int64()), ("_cdc_seq", pa.int64()),
                ("_cdc_ts", pa.timestamp("us", tz="UTC")), ("_cdc_before_key_only", pa.bool_()),
                ("_cdc_unchanged", pa.list_(pa.string())), ("after", image), ("before", image),
            ])  # fmt: skip
            path = spill_dir / name / "part-00000.parquet"
            path.parent.mkdir()
            pq.write_table(pa.Table.from_pylist(changes, schema=schema), path.path, filesystem=path.filesystem)
            spills[name] = TableChanges(changes=len(changes), bytes=path.size(), parts=1, frame=_reader(path))
        return ChangeBatch(
            applied=applied,
            offset={"position": applied},
            tables=spills,
            changes=count,
            transactions=len(taken),
            bytes=sum(s.bytes for s in spills.values()),
            cut=cut,
            last_commit_ts=taken[-1].at if taken else None,
            lag_bytes=sum(len(t.changes) for t in waiting[len(taken) :]),
        )

    def position(self, offset: Offset) -> int:
        return int(str(offset["position"]))

    def format_position(self, position: int) -> str:
        return str(position)

    def acknowledge(self, offset: Offset) -> int:
        with self.database.lock:
            self.database.forgotten = max(self.database.forgotten, self.position(offset))
            return self.database.forgotten

    def validate_offset(self, requested: Mapping[str, str]) -> dict[str, object]:
        text = requested.get("position", "")
        if not text.isdigit() or not self.database.forgotten <= int(text) <= self.database.position:
            raise OffsetError(f"position: {text!r} is not in [{self.database.forgotten}, {self.database.position}]")
        return {"position": int(text)}

    def pending(self, lag: SourceLag | None) -> tuple[str | None, int]:
        lag = lag or self.lag()
        return ("changes waiting" if lag.changes_waiting else None), self.database.position

    def lag(self) -> SourceLag:
        with self.database.lock:
            waiting = [t for t in self.database.log if t.position > self.database.forgotten]
        return SourceLag(sum(len(t.changes) for t in waiting), 0.0, bool(waiting))

    def spark_fields(self, table: MemoryTable, added: Sequence[object] = ()) -> list[T.StructField]:
        return spark_fields(table.arrow_schema)

    def column_names(self, table: MemoryTable) -> list[str]:
        return list(table.schema.names)

    def partitions(self, table: MemoryTable) -> list[str]:
        return []

    def filled_without_changes(self, table: MemoryTable, names: Sequence[str]) -> list[str]:
        return []

    @contextmanager
    def check_session(self) -> Iterator[MemoryCheckSession]:
        yield MemoryCheckSession(self.database)

    def is_permanent(self, error: BaseException) -> bool:
        return False


def _reader(path: LakePath) -> Callable[[SparkSession], DataFrame]:
    def frame(spark: SparkSession) -> DataFrame:
        return spark.read.parquet(path.uri)

    return frame
