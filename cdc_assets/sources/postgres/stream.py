"""Reading one bounded batch of changes from the replication slot and spilling it to Parquet.

Contract:
- ``read_batch`` peeks (never consumes) the slot with ``pg_logical_slot_peek_binary_changes`` over a server-side
  cursor, bounded by ``upto_lsn`` = the server's flush LSN taken first, by ``upto_nchanges`` (which stops only at
  a transaction boundary) and by ``max_bytes``: after the first commit at which the captured tables' change
  messages of the batch reach ``max_bytes``, it stops reading (also a transaction boundary; a single transaction
  larger than the bound is read whole, spilled). It decodes pgoutput, and writes every change of a captured table
  to Parquet files under ``spill_dir/<table>/`` in parts of at most ``spill_rows`` rows and about ``spill_bytes``
  bytes of messages (a message larger than that is a part of its own); each part is one Parquet row group, so a
  reader of a part holds at most one part. Driver memory stays bounded whatever the size of one transaction or one
  value (a value is held whole, a few times over while it is decoded). Rows are fetched from the cursor in
  numbers that keep one fetch at about ``spill_bytes / 4`` at the message sizes seen so far (doubling from one
  row). A row change is kept as its message until its part is written, then the part's messages are
  decoded together, column by column (``cdc_assets.sources.postgres.row_images``). Values are decoded with the
  same codec as the snapshot path. Parts are decoded and written on ``SPILL_WRITER_THREADS`` threads while the
  next messages are read (``PartWriter``): the parts in flight hold at most that many times ``spill_bytes`` of
  messages, or one part larger than that alone; every part is written before ``read_batch`` returns, and a part
  that failed fails the read with its own error.
- Each spilled change carries ``_cdc_commit_lsn`` (the commit record's start, known at Begin) and ``_cdc_seq`` (order
  within its transaction); ``spill_dir/transactions.parquet`` maps each commit to its ``end_lsn`` (the change's
  ``_cdc_position``), 64-bit xid and commit time.
- ``applied_lsn`` of the result: every transaction whose commit record ends at or before it is in this batch or in
  an earlier one. It is the flush LSN when the batch was not cut by ``upto_nchanges`` or ``max_bytes``, else the
  last commit's end. ``bytes`` of the result: the captured tables' change messages it holds.
- Partitions: a change pgoutput reports under a leaf partition's name (a publication without
  ``publish_via_partition_root``) belongs to the captured root table (``pg_partition_root`` of the relation's oid,
  looked up once per relation and batch; a partition attached while streaming is found the same way). A
  ``TRUNCATE`` that lists every current partition of a captured root truncates the root; a partition truncated
  alone is not applied (its rows stay in the root's mirror until its chunks are read again). A change of a table
  that is not captured (a skipped table in a ``FOR ALL TABLES`` publication) is not spilled.
- A table the run does not capture but ``would_capture(schema, name)`` says the source captures now (created in a
  ``FOR ALL TABLES`` publication, or newly matching the include patterns, while the run was in flight): the read
  stops with ``CapturedTablesChanged`` naming it and returns nothing, so the caller resolves its tables again and
  reads the batch again. Before, such a table's changes were left out and the slot moved past them: a change made
  after the new table's snapshot read and before the run ended was lost from its mirror.
- An unchanged TOAST value is recorded in ``_cdc_unchanged`` (column names) and its typed value is NULL; when the
  old tuple carries the full old row (replica identity FULL) the old value is used instead.
- One session at a time: PostgreSQL refuses a peek of a slot another session is using ("replication slot ... is
  active for PID ..."), and the streaming sensor's lag probe, a stream run's poll and its batch read meet there now
  and then. ``when_slot_free`` runs a peek again until the slot is free, for up to ``SLOT_BUSY_SECONDS``.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cdc_assets.engine.names import lake_folder, qualify
from cdc_assets.lake.files import LakePath
from cdc_assets.source import CapturedTablesChanged, PermanentBatchError
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.lsn import format_lsn, parse_lsn
from cdc_assets.sources.postgres.pg_values import PgColumn, columns_from_catalog, decode_text_table
from cdc_assets.sources.postgres.pgoutput import Begin, Commit, PgOutputDecoder, Relation, Truncate
from cdc_assets.sources.postgres.row_images import decode_row_images
from cdc_assets.sources.postgres.snapshot import in_recovery
from cdc_assets.sources.postgres.watermark import widen_xid

ROW_CHANGE_TYPES = frozenset(b"IUD")  # Insert, Update, Delete
_RELATION_ID = struct.Struct("!I")  # after a row change's type byte
_UNRESOLVED = object()
SPILL_WRITER_THREADS = 2  # parts decoded and written at once beside the read (bench/RESULTS.md, "read phase")
# how long a peek waits for a slot that another session is using (a probe takes milliseconds, a batch read longer)
SLOT_BUSY_SECONDS = 30.0
SLOT_BUSY_PAUSE_SECONDS = 0.2
T = TypeVar("T")
META_COLUMNS = ("_cdc_op", "_cdc_commit_lsn", "_cdc_seq", "_cdc_before_key_only", "_cdc_unchanged")


class SchemaChangeError(PermanentBatchError):
    """An incompatible change of a captured table's schema; the stream stops."""


@dataclass
class TableSpill:
    table: CapturedTable
    columns: list[PgColumn]
    directory: LakePath
    parts: list[LakePath] = field(default_factory=list)
    messages: list[bytes] = field(default_factory=list)  # row changes, decoded column-wise when flushed
    commit_lsns: list[int] = field(default_factory=list)  # of each message
    seqs: list[int] = field(default_factory=list)  # of each message: its order within its transaction
    truncate_positions: list[tuple[int, int]] = field(default_factory=list)  # not flushed yet
    unchanged_columns: set[str] = field(default_factory=set)
    truncations: list[tuple[int, int]] = field(default_factory=list)  # (commit_lsn, seq), the whole batch
    changes: int = 0
    bytes: int = 0  # the messages of its row changes, the whole batch
    pending_bytes: int = 0  # the messages not flushed yet
    added_columns: list[PgColumn] = field(default_factory=list)
    writer: PartWriter | None = None  # None: each part is written by ``flush`` itself

    @property
    def pending(self) -> int:
        return len(self.messages) + len(self.truncate_positions)

    def flush(self) -> None:
        """Write the pending changes as the next part (by the spill's ``writer`` when it has one), then hold none."""
        if not self.pending:
            return
        path = self.directory / f"part-{len(self.parts):05d}.parquet"
        messages, commit_lsns, seqs, truncates, columns, size = (
            self.messages, self.commit_lsns, self.seqs, self.truncate_positions, self.columns, self.pending_bytes
        )  # fmt: skip
        self.parts.append(path)
        self.messages, self.commit_lsns, self.seqs, self.truncate_positions = [], [], [], []
        self.pending_bytes = 0
        if self.writer is None:
            self._write_part(path, columns, messages, commit_lsns, seqs, truncates)
        else:
            self.writer.submit(lambda: self._write_part(path, columns, messages, commit_lsns, seqs, truncates), size)

    def _write_part(
        self, path: LakePath, columns: list[PgColumn], messages: list[bytes], commit_lsns: list[int], seqs: list[int],
        truncate_positions: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        names = [c.name for c in columns]
        images = decode_row_images(messages, len(names))
        truncates = len(truncate_positions)
        unchanged = images.new.unchanged.copy()
        full_old = images.old.present & ~images.old_is_key_only
        after_texts: dict[str, pa.Array] = {}
        for index, name in enumerate(names):
            value = images.new.values[index]
            # an unchanged TOAST value takes the value of the full old row (replica identity FULL) when it has one
            old_value = images.old.values[index]
            from_old = unchanged[:, index] & full_old & old_value.is_valid().to_numpy(zero_copy_only=False)
            if from_old.any():
                value = pc.if_else(pa.array(from_old), old_value, value)
                unchanged[from_old, index] = False
            after_texts[name] = pa.concat_arrays([value, pa.nulls(truncates, pa.string())])
        before_texts = {
            name: pa.concat_arrays([images.old.values[i], pa.nulls(truncates, pa.string())])
            for i, name in enumerate(names)
        }
        self.unchanged_columns |= {names[i] for i in np.flatnonzero(unchanged.any(axis=0))}
        after = decode_text_table(columns, pa.table(after_texts))
        before = decode_text_table(columns, pa.table(before_texts))
        no_image, no_columns = np.zeros(truncates, bool), np.zeros((truncates, len(names)), bool)
        truncate_commits, truncate_seqs = zip(*truncate_positions, strict=True) if truncates else ((), ())
        commits, seqs = [*commit_lsns, *truncate_commits], [*seqs, *truncate_seqs]
        part = pa.table(
            {
                "_cdc_op": pa.array(np.concatenate([images.ops, np.full(truncates, "t")]), pa.string()),
                "_cdc_commit_lsn": pa.array(commits, pa.int64()),
                "_cdc_seq": pa.array(seqs, pa.int64()),
                "_cdc_before_key_only": pa.array(np.concatenate([images.old_is_key_only, no_image])),
                "_cdc_unchanged": _name_lists(names, np.concatenate([unchanged, no_columns])),
                "after": _struct(after, pa.array(np.concatenate([images.new.present, no_image]))),
                "before": _struct(before, pa.array(np.concatenate([images.old.present, no_image]))),
            }
        )
        self.directory.mkdir()
        # one row group: a reader (Spark's Parquet reader) holds one part's bytes at most, never more; a part is
        # read whole, once, without a filter: no statistics and no dictionaries to compute (a part of 50,000
        # update-heavy changes is written in about half the time)
        pq.write_table(
            part, path.path, row_group_size=max(1, part.num_rows), use_dictionary=False, write_statistics=False,
            filesystem=path.filesystem,
        )  # fmt: skip


class PartWriter:
    """Writes spill parts on ``threads`` threads beside the reading of the next messages.

    Contract: ``submit(write, size)`` first waits (oldest part first) until fewer than ``threads`` parts are in
    flight and their messages' bytes with this part's ``size`` are at most ``max_bytes``, or none is, and raises
    the error of any part it waited for. So parts of one large value are written one at a time, as before, and the
    parts being written hold at most ``max_bytes`` of messages or one part. ``wait()`` waits for every part in
    flight, oldest first, and raises the first error; ``close()`` waits for them without raising (a read that failed
    keeps its own error) and ends the threads. Decoding and writing a part is numpy, Arrow and Parquet work that
    mostly runs outside the GIL, while reading the messages is Python's."""

    def __init__(self, threads: int, max_bytes: int) -> None:
        self.threads, self.max_bytes = threads, max_bytes
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="spill-part")
        self._in_flight: deque[tuple[Future[None], int]] = deque()
        self._in_flight_bytes = 0

    def submit(self, write: Callable[[], None], size: int) -> None:
        while self._in_flight and (
            len(self._in_flight) >= self.threads or self._in_flight_bytes + size > self.max_bytes
        ):
            self._wait_oldest()
        self._in_flight.append((self._executor.submit(write), size))
        self._in_flight_bytes += size

    def wait(self) -> None:
        while self._in_flight:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        oldest, size = self._in_flight.popleft()
        self._in_flight_bytes -= size
        oldest.result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)


def _name_lists(names: list[str], marked: np.ndarray) -> pa.ListArray:
    """Per row, the names of its marked columns (in column order); an empty list where none is marked."""
    _, columns = np.nonzero(marked)
    offsets = np.zeros(len(marked) + 1, np.int32)
    np.cumsum(marked.sum(axis=1), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(names, pa.string()).take(pa.array(columns)))


def _struct(table: pa.Table, present: pa.Array) -> pa.StructArray:
    arrays = [column.combine_chunks() if column.num_chunks else pa.array([], column.type) for column in table.columns]
    return pa.StructArray.from_arrays(arrays, names=table.column_names, mask=pc.invert(present))


@dataclass
class Batch:
    start_lsn: int
    flush_lsn: int
    applied_lsn: int
    cut_by_change_limit: bool
    transactions: int
    changes: int
    last_commit_lsn: int | None
    last_end_lsn: int | None
    last_xid: int | None
    last_commit_ts: datetime | None
    spills: dict[str, TableSpill]
    transactions_path: LakePath | None
    bytes: int = 0
    cut_by_byte_limit: bool = False


def current_flush_lsn(conn: psycopg.Connection) -> int:
    function = "pg_last_wal_replay_lsn" if in_recovery(conn) else "pg_current_wal_flush_lsn"
    return parse_lsn(conn.execute(f"select {function}()::text").fetchone()[0])


def slot_position(conn: psycopg.Connection, slot: str) -> tuple[int, int]:
    """``(confirmed_flush_lsn, restart_lsn)`` of the slot."""
    row = conn.execute(
        "select confirmed_flush_lsn::text, restart_lsn::text from pg_replication_slots where slot_name = %s", [slot]
    ).fetchone()
    if row is None:
        raise RuntimeError(f"replication slot {slot!r} does not exist")
    return parse_lsn(row[0]), parse_lsn(row[1])


def advance_slot(conn: psycopg.Connection, slot: str, lsn: int) -> int:
    (end,) = conn.execute(
        "select end_lsn::text from pg_replication_slot_advance(%s, %s::pg_lsn)", [slot, format_lsn(lsn)]
    ).fetchone()
    return parse_lsn(end)


def when_slot_free(peek: Callable[[], T], seconds: float = SLOT_BUSY_SECONDS) -> T:
    """``peek()``, run again while it fails because another session is using the slot, for up to ``seconds``; then
    that failure. Only for a peek that fails before it reads anything (a slot is taken when the peek starts) on an
    autocommit connection, or inside a transaction block it leaves."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return peek()
        except psycopg.errors.ObjectInUse:
            if time.monotonic() >= deadline:
                raise
            time.sleep(SLOT_BUSY_PAUSE_SECONDS)


def has_pending_changes(conn: psycopg.Connection, slot: str, publication: str) -> bool:
    """Whether the slot holds at least one change for the publication (decodes up to one transaction)."""
    row = when_slot_free(
        lambda: conn.execute(
            "select 1 from pg_logical_slot_peek_binary_changes(%s, null, 1, 'proto_version', '1', "
            "'publication_names', %s) limit 1",
            [slot, publication],
        ).fetchone()
    )
    return row is not None


def oldest_pending_commit(conn: psycopg.Connection, slot: str, publication: str) -> datetime | None:
    """The commit time of the oldest transaction the slot holds for the publication, None when it holds none
    (decodes up to one transaction: its first message is its Begin)."""
    row = when_slot_free(
        lambda: conn.execute(
            "select data from pg_logical_slot_peek_binary_changes(%s, null, 1, 'proto_version', '1', "
            "'publication_names', %s) limit 1",
            [slot, publication],
            binary=True,
        ).fetchone()
    )
    if row is None:
        return None
    message = PgOutputDecoder().decode(row[0])
    return message.commit_ts if isinstance(message, Begin) else None


def read_batch(
    conn: psycopg.Connection,
    slot: str,
    publication: str,
    tables: dict[str, CapturedTable],
    spill_dir: LakePath,
    max_changes: int,
    spill_rows: int,
    max_bytes: int | None = None,
    spill_bytes: int = 32 << 20,
    would_capture: Callable[[str, str], bool] | None = None,
) -> Batch:
    """Read one bounded batch (see module docstring)."""
    start_lsn, _ = slot_position(conn, slot)
    flush_lsn = current_flush_lsn(conn)
    (reference_xid,) = conn.execute("select pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()
    reader = _BatchReader(conn, tables, spill_dir, spill_rows, spill_bytes, max_bytes, would_capture, reference_xid)
    try:
        # binary: the messages arrive as they are, not hex-encoded by the server and decoded again here
        with conn.transaction(), conn.cursor(name="cdc_peek", binary=True) as cursor:
            cursor.execute(
                "select data from pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, %s, "
                "'proto_version', '1', 'publication_names', %s)",
                [slot, format_lsn(flush_lsn), max_changes, publication],
            )
            for messages in _fetches(cursor, max(1, spill_bytes // 4)):
                if not reader.take(messages):
                    break
        for spill in reader.spills.values():
            spill.flush()
        reader.writer.wait()
    finally:
        reader.writer.close()
    spills, transactions = reader.spills, reader.transactions
    rows_read, changes, batch_bytes, cut_by_bytes = reader.rows_read, reader.changes, reader.bytes, reader.cut_by_bytes
    cut = rows_read >= max_changes or cut_by_bytes
    last = transactions[-1] if transactions else None
    applied = last[1] if cut and last else max(flush_lsn, start_lsn)
    transactions_path = None
    if transactions:
        spill_dir.mkdir()
        transactions_path = spill_dir / "transactions.parquet"
        commit_lsn, end_lsn, xid, commit_ts = zip(*transactions, strict=True)
        pq.write_table(
            pa.table(
                {
                    "_cdc_commit_lsn": pa.array(commit_lsn, pa.int64()),
                    "_cdc_position": pa.array(end_lsn, pa.int64()),
                    "_cdc_xid": pa.array(xid, pa.int64()),
                    "_cdc_ts": pa.array(commit_ts, pa.timestamp("us", tz="UTC")),
                }
            ),
            transactions_path.path,
            filesystem=transactions_path.filesystem,
        )
    return Batch(
        start_lsn=start_lsn,
        flush_lsn=flush_lsn,
        applied_lsn=applied,
        cut_by_change_limit=cut,
        transactions=len(transactions),
        changes=changes,
        last_commit_lsn=last[0] if last else None,
        last_end_lsn=last[1] if last else None,
        last_xid=last[2] if last else None,
        last_commit_ts=last[3] if last else None,
        spills=spills,
        transactions_path=transactions_path,
        bytes=batch_bytes,
        cut_by_byte_limit=cut_by_bytes,
    )


FETCH_ROWS_MAX = 5000


def _fetches(cursor: psycopg.ServerCursor, fetch_bytes: int) -> Iterator[list[bytes]]:
    """The cursor's messages, fetched in numbers that keep one fetch at about ``fetch_bytes`` at the largest message
    size of the previous fetch: from one row, at most doubling per fetch, up to ``FETCH_ROWS_MAX`` rows."""
    rows = 1
    while True:
        messages = [data for (data,) in cursor.fetchmany(rows)]
        if not messages:
            return
        largest = max(map(len, messages))
        yield messages
        del messages
        rows = max(1, min(2 * rows, FETCH_ROWS_MAX, fetch_bytes // max(1, largest)))


class _BatchReader:
    """The messages of one batch, taken a fetch at a time, kept per captured table (see the module docstring).

    Contract: ``take(messages)`` keeps what the messages say, in order: every row change of a captured table in its
    table's spill with its commit and its order in its transaction, the transactions' commits, truncations, a
    spill's columns switched where a Relation message changed them; it returns False once a commit reached
    ``max_bytes`` (the messages after it are not taken). Which spill a relation's changes go to is decided once
    per Relation message (``relation_spills``), not once per change: a row change costs a few dictionary and list
    operations until its part is written."""

    def __init__(
        self, conn: psycopg.Connection, tables: dict[str, CapturedTable], spill_dir: LakePath, spill_rows: int,
        spill_bytes: int, max_bytes: int | None, would_capture: Callable[[str, str], bool] | None, reference_xid: int,
    ) -> None:  # fmt: skip
        self.conn, self.tables, self.spill_dir = conn, tables, spill_dir
        self.spill_rows, self.spill_bytes, self.max_bytes = spill_rows, spill_bytes, max_bytes
        self.would_capture, self.reference_xid = would_capture, reference_xid
        self.decoder = PgOutputDecoder()
        self.spills: dict[str, TableSpill] = {}
        self.transactions: list[tuple[int, int, int, datetime]] = []
        self.relation_columns: dict[int, list[PgColumn]] = {}
        self.roots: dict[int, str | None] = {}  # relation oid -> captured table it is or is a partition of
        self.relation_spills: dict[int, TableSpill | None] = {}  # until the relation's next Relation message
        self.rows_read = self.changes = self.bytes = 0
        self.seq = 0  # the next change's order within its transaction: (commit lsn, seq) is unique and stable
        self.xid = 0
        self.cut_by_bytes = False
        self.writer = PartWriter(SPILL_WRITER_THREADS, SPILL_WRITER_THREADS * spill_bytes)

    def take(self, messages: list[bytes]) -> bool:
        relation_spills, relation_columns = self.relation_spills, self.relation_columns
        spill_rows, spill_bytes = self.spill_rows, self.spill_bytes
        for data in messages:
            self.rows_read += 1
            if data[0] not in ROW_CHANGE_TYPES:
                if not self._take_other(data):
                    return False
                continue
            (relation_id,) = _RELATION_ID.unpack_from(data, 1)
            spill = relation_spills.get(relation_id, _UNRESOLVED)
            if spill is _UNRESOLVED:
                spill = self._spill_of(relation_id, data)
            if spill is None:
                continue
            if spill.columns is not relation_columns[relation_id]:  # the spill's changes switched relation
                _switch_columns(spill, relation_columns[relation_id])
            begin = self.decoder.transaction()
            size = len(data)
            spill.messages.append(data)
            spill.commit_lsns.append(begin.final_lsn)
            spill.seqs.append(self.seq)
            self.seq += 1
            self.changes += 1
            self.bytes += size
            spill.changes += 1
            spill.bytes += size
            spill.pending_bytes += size
            if spill.pending >= spill_rows or spill.pending_bytes >= spill_bytes:
                spill.flush()
        return True

    def _spill_of(self, relation_id: int, message: bytes) -> TableSpill | None:
        """The spill of a relation's row changes (None: not captured), decided at its first change after its
        Relation message."""
        spill = self._captured_spill(self.decoder.relation_of(message), self.would_capture)
        self.relation_spills[relation_id] = spill
        return spill

    def _captured_spill(
        self, relation: Relation, would_capture: Callable[[str, str], bool] | None
    ) -> TableSpill | None:
        """``_spill_for`` over this read's state; the spill writes its parts with this read's writer."""
        spill = _spill_for(
            relation, self.tables, self.spills, self.spill_dir, self.relation_columns, self.conn, self.roots,
            would_capture,
        )  # fmt: skip
        if spill is not None:
            spill.writer = self.writer
        return spill

    def _take_other(self, data: bytes) -> bool:
        message = self.decoder.decode(data)
        if isinstance(message, Begin):
            self.xid = widen_xid(message.xid, self.reference_xid)
            self.seq = 0
        elif isinstance(message, Commit):
            self.transactions.append((message.commit_lsn, message.end_lsn, self.xid, message.commit_ts))
            if self.max_bytes is not None and self.bytes >= self.max_bytes:
                self.cut_by_bytes = True  # a transaction boundary: the rest waits for the next batch
                return False
        elif isinstance(message, Truncate):
            for relation in _truncated(message.relations, self.tables, self.conn, self.roots, self.would_capture):
                spill = self._captured_spill(relation, None)
                if spill is not None:
                    self.changes += 1
                    spill.changes += 1
                    spill.truncations.append((message.begin.final_lsn, self.seq))
                    spill.truncate_positions.append((message.begin.final_lsn, self.seq))
                    self.seq += 1
        elif isinstance(message, Relation):
            self.relation_columns.pop(message.relation_id, None)
            self.relation_spills.pop(message.relation_id, None)
        return True


def _spill_for(
    relation: Relation,
    tables: dict[str, CapturedTable],
    spills: dict[str, TableSpill],
    spill_dir: LakePath,
    relation_columns: dict[int, list[PgColumn]],
    conn: psycopg.Connection,
    roots: dict[int, str | None],
    would_capture: Callable[[str, str], bool] | None,
) -> TableSpill | None:
    name = _captured_name(relation, tables, conn, roots, would_capture)
    if name is None:
        return None
    table = tables[name]
    spill = spills.get(name)
    if spill is None:
        spill = TableSpill(table, list(table.columns), spill_dir / lake_folder(table.schema, table.name))
        spills[name] = spill
    if relation.relation_id not in relation_columns:
        relation_columns[relation.relation_id] = _columns_for_relation(relation, spill, conn)
    columns = relation_columns[relation.relation_id]
    if columns is not spill.columns:
        _switch_columns(spill, columns)
    return spill


def _switch_columns(spill: TableSpill, columns: list[PgColumn]) -> None:
    """Make ``columns`` (a relation's, from its last Relation message) the spill's: the changes kept under other
    column names are written first. Done where a spill's changes switch relation, not once per change."""
    if [c.name for c in columns] != [c.name for c in spill.columns]:
        spill.flush()
        known = {c.name for c in spill.table.columns} | {c.name for c in spill.added_columns}
        spill.added_columns += [c for c in columns if c.name not in known]
    spill.columns = columns


def _captured_name(
    relation: Relation,
    tables: dict[str, CapturedTable],
    conn: psycopg.Connection,
    roots: dict[int, str | None],
    would_capture: Callable[[str, str], bool] | None = None,
) -> str | None:
    """The captured table a relation's changes belong to: itself, or the root of the partition it is (None: not
    captured). Raises ``CapturedTablesChanged`` when that table is not captured but ``would_capture(schema, name)``
    says the source captures it now. Decided once per relation and batch (``roots``)."""
    if relation.qualified_name in tables:
        return relation.qualified_name
    if relation.relation_id not in roots:
        row = conn.execute(
            """
            select n.nspname, c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
            where c.oid = pg_partition_root(%s::oid::regclass) and c.oid <> %s::oid
            """,
            [relation.relation_id, relation.relation_id],
        ).fetchone()
        schema, name = (relation.schema, relation.name) if row is None else (row[0], row[1])
        owner = qualify(schema, name)
        if owner not in tables and would_capture is not None and would_capture(schema, name):
            raise CapturedTablesChanged([owner])
        roots[relation.relation_id] = owner if owner in tables else None
    return roots[relation.relation_id]


def _truncated(
    relations: tuple[Relation, ...] | list[Relation],
    tables: dict[str, CapturedTable],
    conn: psycopg.Connection,
    roots: dict[int, str | None],
    would_capture: Callable[[str, str], bool] | None = None,
) -> list[Relation]:
    """The relations of a ``TRUNCATE`` to apply: captured tables as they are, and, for a partitioned root, one of its
    partitions when the message lists every partition the root has now (the root was truncated); a partition
    truncated alone is left out (its rows are not the whole root's)."""
    applied: list[Relation] = []
    leaves_by_root: dict[str, list[Relation]] = {}
    for relation in relations:
        name = _captured_name(relation, tables, conn, roots, would_capture)
        if name is None:
            continue
        if name == relation.qualified_name:
            applied.append(relation)
        else:
            leaves_by_root.setdefault(name, []).append(relation)
    for root, leaves in leaves_by_root.items():
        table = tables[root]
        rows = conn.execute(
            "select count(*) from pg_partition_tree(%s::regclass) where isleaf",
            [table.identifier.as_string(conn)],
        ).fetchone()
        if rows is not None and len({r.relation_id for r in leaves}) >= rows[0]:
            applied.append(leaves[0])
    return applied


def _columns_for_relation(relation: Relation, spill: TableSpill, conn: psycopg.Connection) -> list[PgColumn]:
    """The relation's columns, typed from the captured table or (for new columns) from the current catalog."""
    known = {c.name: c for c in [*spill.table.columns, *spill.added_columns]}
    catalog: dict[str, PgColumn] | None = None
    columns = []
    for column in relation.columns:
        existing = known.get(column.name)
        if existing is None:
            if catalog is None:
                catalog = {c.name: c for c in columns_from_catalog(conn, relation.schema, relation.name)}
            existing = catalog.get(column.name)
            if existing is None:
                raise SchemaChangeError(
                    f"table {relation.qualified_name}: column {column.name!r} arrived in the stream but is no "
                    "longer in the catalog; it was added and dropped again while the stream lagged"
                )
        elif (existing.domain_oid or existing.type_oid) != column.type_oid or existing.typmod != column.typmod:
            raise SchemaChangeError(
                f"table {relation.qualified_name}: column {column.name!r} changed type from {existing.type_name} "
                f"(oid {existing.type_oid}, typmod {existing.typmod}) to oid {column.type_oid} typmod "
                f"{column.typmod}; incompatible type changes stop the stream: re-create the mirror or revert"
            )
        columns.append(existing)
    return columns
