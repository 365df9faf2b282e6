"""Row filters of an ad-hoc snapshot of chosen rows (Debezium's ``execute-snapshot`` signal with
``additional-conditions``), validated without a database.

Contract:
- A filter is structured, never free text: one term ``{"column": ..., "op": ..., "value": ...}`` or a list of such
  terms, all of which a row must satisfy (AND). ``parse_row_filter(raw, table, columns)`` returns a ``RowFilter`` or
  raises ``RowFilterError`` whose message names the table, the term (1-based) and the field, and the allowed values.
- ``op`` is one of ``OPERATORS``. ``=``, ``!=``, ``<``, ``<=``, ``>``, ``>=`` take one value; ``in`` and ``not in`` a
  non-empty list of at most ``MAX_LIST_VALUES`` values; ``between`` a list of exactly two (both bounds included);
  ``is null`` and ``is not null`` no value (``value`` absent or null). A value is a string, an integer, a finite
  number, a boolean, or a one-key mapping whose key starts with ``$`` (a typed value in MongoDB's extended JSON,
  e.g. ``{"$oid": "..."}``; a source kind that has no such values refuses it when it composes the filter). A null
  value with a comparison is refused (it matches no row in SQL): ``is null`` says it.
- ``column`` must be one of ``columns`` (the table's columns; the message lists them) when ``columns`` is given.
  Without ``columns`` (a source without a fixed schema: MongoDB documents) it is a field path: dot-separated
  non-empty parts, none starting with ``$``, no NUL character, at most ``MAX_NAME_LENGTH`` characters. So text such
  as ``"id = 1; drop table t"`` or ``"1=1 or true"`` in ``column`` is refused, naming the field and the allowed
  form; a filter never carries text that a source would read as a condition or an operator.
- A filter holds at most ``MAX_TERMS`` terms. An empty list is refused (no filter at all is ``None``, the caller's
  "every row").
- How a source applies a filter is the source's (PostgreSQL: identifiers and literals composed by psycopg, each
  value cast to its column's type; MongoDB: a query document of ``$eq``/``$ne``/... only); the values are never
  pasted into query text.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

OPERATORS = ("=", "!=", "<", "<=", ">", ">=", "in", "not in", "between", "is null", "is not null")
COMPARISONS = ("=", "!=", "<", "<=", ">", ">=")
LIST_OPERATORS = ("in", "not in")
NO_VALUE_OPERATORS = ("is null", "is not null")
TERM_FIELDS = ("column", "op", "value")
MAX_TERMS = 20
MAX_LIST_VALUES = 1000
MAX_NAME_LENGTH = 256
FORM = '{"column": <a column of the table>, "op": <operator>, "value": <value>}'

Scalar = str | int | float | bool | dict[str, object]


class SnapshotRowsRefused(ValueError):
    """An ad-hoc snapshot of rows that cannot start (nothing was read or recorded); the message says why and what to
    do."""


class RowFilterError(SnapshotRowsRefused):
    """A filter that cannot be applied; the message names the table, the term, the field and the allowed values."""


@dataclass(frozen=True)
class FilterTerm:
    """One condition: ``column op value``; ``value`` is a scalar, a tuple of scalars (``in``, ``not in``,
    ``between``) or None (``is null``, ``is not null``)."""

    column: str
    op: str
    value: Scalar | tuple[Scalar, ...] | None = None

    def describe(self) -> str:
        if self.op in NO_VALUE_OPERATORS:
            return f"{self.column} {self.op}"
        if self.op == "between":
            low, high = self.value  # type: ignore[misc]
            return f"{self.column} between {_text(low)} and {_text(high)}"
        if self.op in LIST_OPERATORS:
            return f"{self.column} {self.op} ({', '.join(_text(v) for v in self.value)})"  # type: ignore[union-attr]
        return f"{self.column} {self.op} {_text(self.value)}"  # type: ignore[arg-type]

    def to_json(self) -> dict[str, object]:
        term: dict[str, object] = {"column": self.column, "op": self.op}
        if self.op not in NO_VALUE_OPERATORS:
            term["value"] = list(self.value) if isinstance(self.value, tuple) else self.value
        return term


@dataclass(frozen=True)
class RowFilter:
    """The terms a row must all satisfy, of one table."""

    table: str
    terms: tuple[FilterTerm, ...]

    def describe(self) -> str:
        return " and ".join(t.describe() for t in self.terms)

    def to_json(self) -> list[dict[str, object]]:
        return [t.to_json() for t in self.terms]


def _text(value: object) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)


def parse_row_filter(raw: object, table: str, columns: Sequence[str] | None) -> RowFilter:
    """The filter ``raw`` (one term, or a list of terms ANDed) of ``table``, validated against ``columns`` (None: a
    field path of a document, see the module docstring)."""
    where = f"table {table}: filter"
    if isinstance(raw, Mapping):
        raw = [raw]
    if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
        raise RowFilterError(
            f"{where}: expected a term {FORM} or a list of such terms (all must hold), got {type(raw).__name__}; "
            "a filter is never free text"
        )
    if not raw:
        raise RowFilterError(f"{where}: an empty list of terms; give at least one term {FORM}, or no filter at all")
    if len(raw) > MAX_TERMS:
        raise RowFilterError(f"{where}: {len(raw)} terms; at most {MAX_TERMS} are allowed")
    return RowFilter(table, tuple(_parse_term(item, f"{where} term {n}", columns) for n, item in enumerate(raw, 1)))


def _parse_term(item: object, where: str, columns: Sequence[str] | None) -> FilterTerm:
    if not isinstance(item, Mapping):
        raise RowFilterError(f"{where}: expected a term {FORM}, got {type(item).__name__}; a filter is never free text")
    unknown = sorted(str(k) for k in item if k not in TERM_FIELDS)
    if unknown:
        raise RowFilterError(f"{where}: unknown field {', '.join(unknown)}; allowed: {', '.join(TERM_FIELDS)}")
    if "column" not in item:
        raise RowFilterError(f"{where}: column is missing; a term is {FORM}")
    column = _column(item["column"], where, columns)
    op = item.get("op", "=")
    if not isinstance(op, str) or " ".join(op.lower().split()) not in OPERATORS:
        raise RowFilterError(f"{where}: op {op!r} is not allowed; allowed: {', '.join(OPERATORS)}")
    op = " ".join(op.lower().split())
    value = item.get("value")
    if op in NO_VALUE_OPERATORS:
        if value is not None:
            raise RowFilterError(f"{where}: op {op!r} takes no value, got value {_text(value)}")
        return FilterTerm(column, op)
    if op in COMPARISONS:
        if value is None:
            hint = "is null" if op == "=" else "is not null" if op == "!=" else "is null / is not null"
            raise RowFilterError(f"{where}: value is missing or null for op {op!r} (a null compares to no row); "
                                 f"to match NULLs use op {hint!r}")  # fmt: skip
        return FilterTerm(column, op, _scalar(value, f"{where}: value"))
    if not isinstance(value, list | tuple):
        raise RowFilterError(
            f"{where}: op {op!r} takes a list of values"
            + (" (exactly two: the low and the high bound, both included)" if op == "between" else "")
            + f", got {_text(value) if value is not None else 'none'}"
        )
    if op == "between" and len(value) != 2:
        raise RowFilterError(f"{where}: op 'between' takes exactly two values (low, high), got {len(value)}")
    if not value:
        raise RowFilterError(f"{where}: op {op!r} takes a non-empty list of values")
    if len(value) > MAX_LIST_VALUES:
        raise RowFilterError(f"{where}: op {op!r} takes at most {MAX_LIST_VALUES} values, got {len(value)}")
    values = []
    for n, element in enumerate(value, 1):
        if element is None:
            raise RowFilterError(f"{where}: value {n} is null (a null compares to no row); use op 'is null'")
        values.append(_scalar(element, f"{where}: value {n}"))
    return FilterTerm(column, op, tuple(values))


def _column(column: object, where: str, columns: Sequence[str] | None) -> str:
    if not isinstance(column, str) or not column:
        raise RowFilterError(f"{where}: column must be a non-empty name, got {_text(column)}")
    if columns is not None:
        if column not in columns:
            shown = ", ".join(columns[:50]) + (f", ... ({len(columns)} in all)" if len(columns) > 50 else "")
            raise RowFilterError(
                f"{where}: column {column!r} is not a column of the table; a term names one column "
                f"(no expression, no condition): one of {shown}"
            )
        return column
    parts = column.split(".")
    if len(column) > MAX_NAME_LENGTH or "\x00" in column or any(not part or part.startswith("$") for part in parts):
        raise RowFilterError(
            f"{where}: column {column!r} is not a field path; allowed: field names separated by '.', none empty, "
            f"none starting with '$', no NUL character, at most {MAX_NAME_LENGTH} characters (no expression, no "
            "operator)"
        )
    return column


def _scalar(value: object, where: str) -> Scalar:
    if isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowFilterError(f"{where}: {value} is not allowed; a number must be finite")
        return value
    if isinstance(value, Mapping) and len(value) == 1:
        (key,) = value
        if isinstance(key, str) and key.startswith("$"):
            return dict(value)
    raise RowFilterError(
        f"{where}: {_text(value) if not isinstance(value, bytes) else repr(value)} is not a value; allowed: a string, "
        'an integer, a finite number, a boolean, or a typed value of one key such as {"$oid": "..."} (MongoDB)'
    )
