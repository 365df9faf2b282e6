"""MongoDB query documents of ad-hoc snapshot filters (``cdc_assets.engine.row_filter``).

Contract: ``query_document(row_filter)`` is the ``find`` filter of a ``RowFilter``, built from its structure only:
each term becomes ``{<field path>: {<operator>: <value>}}`` with the operator taken from ``QUERY_OPERATORS`` (``$eq``,
``$ne``, ``$lt``, ``$lte``, ``$gt``, ``$gte``, ``$in``, ``$nin``; ``between`` is ``$gte`` and ``$lte``; ``is null``
is ``$eq: null`` and ``is not null`` ``$ne: null``, which in MongoDB also match, or not, a missing field), and
several terms are ANDed with ``$and``. No other operator can come in: ``$where``, ``$function``, ``$expr`` and
the like are neither operators of the allow-list nor accepted as field names (``parse_row_filter`` refuses a
field path with a part starting with ``$`` or a NUL). A value is a JSON scalar, or a typed value in extended JSON
(``{"$oid": ...}``, ``{"$date": ...}``, ``{"$numberLong": ...}``, ``{"$numberDecimal": ...}``, ``{"$uuid": ...}``,
``{"$binary": ...}``, ``{"$timestamp": ...}``) decoded by ``bson.json_util`` so its type round-trips; anything that
does not decode to one of ``VALUE_TYPES`` (JavaScript code, a regular expression, a DBRef, a document) raises
``RowFilterError`` naming the term and the allowed forms. Comparisons follow MongoDB's (type bracketing: ``$gt: 5``
matches numbers only). ``None`` (no filter) is ``{}``: every document.
"""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

from bson import Binary, Code, Decimal128, Int64, ObjectId, Regex, Timestamp, json_util
from bson.errors import InvalidId

from cdc_assets.engine.row_filter import RowFilter, RowFilterError

QUERY_OPERATORS = {"=": "$eq", "!=": "$ne", "<": "$lt", "<=": "$lte", ">": "$gt", ">=": "$gte", "in": "$in",
                   "not in": "$nin"}  # fmt: skip
VALUE_TYPES = (bool, int, float, str, Int64, Decimal128, ObjectId, datetime.datetime, Binary, uuid.UUID, Timestamp)
TYPED_FORMS = '{"$oid": ...}, {"$date": ...}, {"$numberLong": ...}, {"$numberDecimal": ...}, {"$uuid": ...}, ' \
              '{"$binary": ...}, {"$timestamp": ...}'  # fmt: skip


def bson_value(value: object, where: str) -> Any:
    """A filter value as the BSON value it stands for (see the module docstring)."""
    if not isinstance(value, dict):
        return value
    try:
        decoded = json_util.loads(json.dumps(value), json_options=json_util.CANONICAL_JSON_OPTIONS)
    except (ValueError, TypeError, InvalidId) as error:
        raise RowFilterError(f"{where}: {json.dumps(value)} is not a valid typed value: {error}") from None
    # Code is a str: JavaScript is never a value
    if isinstance(decoded, dict | Code | Regex) or not isinstance(decoded, VALUE_TYPES):
        raise RowFilterError(
            f"{where}: {json.dumps(value)} is not an allowed typed value; allowed: a JSON scalar or one of "
            f"{TYPED_FORMS} (extended JSON)"
        )
    return decoded


def query_document(row_filter: RowFilter | None) -> dict[str, Any]:
    if row_filter is None:
        return {}
    where = f"table {row_filter.table}: filter"
    clauses: list[dict[str, Any]] = []
    for n, term in enumerate(row_filter.terms, 1):
        label = f"{where} term {n}"
        if term.op == "is null":
            condition: dict[str, Any] = {"$eq": None}
        elif term.op == "is not null":
            condition = {"$ne": None}
        elif term.op == "between":
            low, high = (bson_value(v, f"{label}: value {i}") for i, v in enumerate(term.value, 1))  # type: ignore[arg-type]
            condition = {"$gte": low, "$lte": high}
        elif isinstance(term.value, tuple):
            values = [bson_value(v, f"{label}: value {i}") for i, v in enumerate(term.value, 1)]
            condition = {QUERY_OPERATORS[term.op]: values}
        else:
            condition = {QUERY_OPERATORS[term.op]: bson_value(term.value, f"{label}: value")}
        clauses.append({term.column: condition})
    return clauses[0] if len(clauses) == 1 else {"$and": clauses}
