"""Decoder for PostgreSQL's ``pgoutput`` logical replication messages (protocol version 1).

Contract: ``PgOutputDecoder.decode(message)`` takes one message as returned by
``pg_logical_slot_peek_binary_changes(..., 'proto_version', '1', 'publication_names', ...)`` and returns a typed
message object. Column values are PostgreSQL's text output (``str``), ``None`` for NULL, or ``UNCHANGED_TOAST``
for an unchanged TOASTed value that the server did not send. The decoder keeps the relation cache (Relation
messages precede the first change of a relation in every session, and again after a schema change) and the
current transaction (Begin precedes changes, Commit ends them), so every ``RowChange`` it returns carries the
relation and the transaction it belongs to. It does no I/O and never guesses: an unknown message type or a change
for a relation it has not seen raises ``PgOutputError``.

Messages: Begin (B), Commit (C), Origin (O), Relation (R), Type (Y), Insert (I), Update (U), Delete (D),
Truncate (T), logical decoding Message (M).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from cdc_assets.engine.names import qualify

UNCHANGED_TOAST: Final = type("UnchangedToast", (), {"__repr__": lambda self: "UNCHANGED_TOAST"})()
"""Marker for an unchanged TOAST value: keep the value the mirror already has."""

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)

_INT8 = struct.Struct("!q")
_UINT32 = struct.Struct("!I")
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!BQQq")
_INT16 = struct.Struct("!h")
_INT32 = struct.Struct("!i")
_RELATION_COLUMN_TAIL = struct.Struct("!Ii")

Value = str | None | object


class PgOutputError(ValueError):
    """A message the decoder cannot interpret."""


def pg_timestamp(microseconds: int) -> datetime:
    """PostgreSQL's internal timestamp (microseconds since 2000-01-01 UTC) as an aware datetime."""
    return PG_EPOCH + timedelta(microseconds=microseconds)


@dataclass(frozen=True, slots=True)
class RelationColumn:
    name: str
    type_oid: int
    typmod: int
    part_of_key: bool


@dataclass(frozen=True, slots=True)
class Relation:
    relation_id: int
    schema: str
    name: str
    replica_identity: str
    columns: tuple[RelationColumn, ...]

    @property
    def qualified_name(self) -> str:
        return qualify(self.schema, self.name)


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_ts: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    commit_lsn: int
    end_lsn: int
    commit_ts: datetime


@dataclass(frozen=True, slots=True)
class RowChange:
    """Insert ('c'), update ('u') or delete ('d') of one row.

    ``new`` is the new row (insert, update); ``old`` is the old key ('K', when an update changed the key, or on
    delete with the default replica identity) or the whole old row ('O', replica identity FULL), else ``None``.
    """

    op: str
    relation: Relation
    new: tuple[Value, ...] | None
    old: tuple[Value, ...] | None
    old_is_key_only: bool
    begin: Begin


@dataclass(frozen=True, slots=True)
class Truncate:
    relations: tuple[Relation, ...]
    cascade: bool
    restart_identity: bool
    begin: Begin


@dataclass(frozen=True, slots=True)
class TypeMessage:
    type_oid: int
    schema: str
    name: str


@dataclass(frozen=True, slots=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class LogicalMessage:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


Message = Begin | Commit | Relation | RowChange | Truncate | TypeMessage | Origin | LogicalMessage


class PgOutputDecoder:
    """Stateful decoder of one stream of pgoutput messages (see module docstring)."""

    def __init__(self) -> None:
        self.relations: dict[int, Relation] = {}
        self.types: dict[int, TypeMessage] = {}
        self.current: Begin | None = None

    def decode(self, message: bytes | memoryview) -> Message:
        data = memoryview(message)
        kind = data[0]
        if kind == 0x49:  # I
            return self._insert(data)
        if kind == 0x55:  # U
            return self._update(data)
        if kind == 0x44:  # D
            return self._delete(data)
        if kind == 0x42:  # B
            final_lsn, commit_ts, xid = _BEGIN.unpack_from(data, 1)
            self.current = Begin(final_lsn, pg_timestamp(commit_ts), xid)
            return self.current
        if kind == 0x43:  # C
            _flags, commit_lsn, end_lsn, commit_ts = _COMMIT.unpack_from(data, 1)
            self.current = None
            return Commit(commit_lsn, end_lsn, pg_timestamp(commit_ts))
        if kind == 0x52:  # R
            return self._relation(data)
        if kind == 0x54:  # T
            return self._truncate(data)
        if kind == 0x59:  # Y
            (type_oid,) = _UINT32.unpack_from(data, 1)
            schema, offset = _cstring(data, 5)
            name, _ = _cstring(data, offset)
            message = TypeMessage(type_oid, schema, name)
            self.types[type_oid] = message
            return message
        if kind == 0x4F:  # O
            (lsn,) = _INT8.unpack_from(data, 1)
            name, _ = _cstring(data, 9)
            return Origin(lsn, name)
        if kind == 0x4D:  # M
            transactional = data[1] != 0
            (lsn,) = _INT8.unpack_from(data, 2)
            prefix, offset = _cstring(data, 10)
            (length,) = _INT32.unpack_from(data, offset)
            return LogicalMessage(transactional, lsn, prefix, bytes(data[offset + 4 : offset + 4 + length]))
        raise PgOutputError(f"unknown pgoutput message type {chr(kind)!r} (0x{kind:02x})")

    def transaction(self) -> Begin:
        """The transaction a row change belongs to (the last Begin); ``PgOutputError`` outside one."""
        if self.current is None:
            raise PgOutputError("row change outside a transaction (no Begin message before it)")
        return self.current

    def relation_of(self, data: bytes | memoryview) -> Relation:
        """The relation of an Insert, Update or Delete message (its row images are decoded elsewhere:
        ``cdc_assets.sources.postgres.row_images`` decodes many at once); ``PgOutputError`` for one not announced."""
        (relation_id,) = _UINT32.unpack_from(data, 1)
        relation = self.relations.get(relation_id)
        if relation is None:
            raise PgOutputError(f"change for relation {relation_id} before its Relation message")
        return relation

    def _relation(self, data: memoryview) -> Relation:
        (relation_id,) = _UINT32.unpack_from(data, 1)
        schema, offset = _cstring(data, 5)
        name, offset = _cstring(data, offset)
        replica_identity = chr(data[offset])
        (count,) = _INT16.unpack_from(data, offset + 1)
        offset += 3
        columns = []
        for _ in range(count):
            flags = data[offset]
            column_name, offset = _cstring(data, offset + 1)
            type_oid, typmod = _RELATION_COLUMN_TAIL.unpack_from(data, offset)
            offset += 8
            columns.append(RelationColumn(column_name, type_oid, typmod, bool(flags & 1)))
        relation = Relation(relation_id, schema, name, replica_identity, tuple(columns))
        self.relations[relation_id] = relation
        return relation

    def _insert(self, data: memoryview) -> RowChange:
        relation = self.relation_of(data)
        if data[5] != 0x4E:  # N
            raise PgOutputError(f"insert into {relation.qualified_name}: expected new tuple marker 'N'")
        new, _ = _tuple(data, 6)
        return RowChange("c", relation, new, None, False, self.transaction())

    def _update(self, data: memoryview) -> RowChange:
        relation = self.relation_of(data)
        old = None
        marker = data[5]
        offset = 6
        key_only = False
        if marker in (0x4B, 0x4F):  # K, O
            key_only = marker == 0x4B
            old, offset = _tuple(data, 6)
            marker = data[offset]
            offset += 1
        if marker != 0x4E:
            raise PgOutputError(f"update of {relation.qualified_name}: expected new tuple marker 'N'")
        new, _ = _tuple(data, offset)
        return RowChange("u", relation, new, old, key_only, self.transaction())

    def _delete(self, data: memoryview) -> RowChange:
        relation = self.relation_of(data)
        marker = data[5]
        if marker not in (0x4B, 0x4F):
            raise PgOutputError(f"delete from {relation.qualified_name}: expected old tuple marker 'K' or 'O'")
        old, _ = _tuple(data, 6)
        return RowChange("d", relation, None, old, marker == 0x4B, self.transaction())

    def _truncate(self, data: memoryview) -> Truncate:
        (count,) = _UINT32.unpack_from(data, 1)
        options = data[5]
        relations = []
        for index in range(count):
            (relation_id,) = _UINT32.unpack_from(data, 6 + 4 * index)
            relation = self.relations.get(relation_id)
            if relation is None:
                raise PgOutputError(f"truncate of relation {relation_id} before its Relation message")
            relations.append(relation)
        return Truncate(tuple(relations), bool(options & 1), bool(options & 2), self.transaction())


def _cstring(data: memoryview, offset: int) -> tuple[str, int]:
    end = offset
    while data[end] != 0:
        end += 1
    return bytes(data[offset:end]).decode("utf-8"), end + 1


def _tuple(data: memoryview, offset: int) -> tuple[tuple[Value, ...], int]:
    (count,) = _INT16.unpack_from(data, offset)
    offset += 2
    values: list[Value] = []
    append = values.append
    for _ in range(count):
        kind = data[offset]
        if kind == 0x74:  # t
            (length,) = _INT32.unpack_from(data, offset + 1)
            start = offset + 5
            append(str(data[start : start + length], "utf-8"))
            offset = start + length
        elif kind == 0x6E:  # n
            append(None)
            offset += 1
        elif kind == 0x75:  # u
            append(UNCHANGED_TOAST)
            offset += 1
        else:
            raise PgOutputError(f"unknown tuple value kind {chr(kind)!r}: only text format is requested")
    return tuple(values), offset
