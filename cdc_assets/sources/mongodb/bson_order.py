"""BSON values as text and as order keys: what the MongoDB source stores in the lake for ``_id`` and documents.

Contract:

- ``canonical_json(value)`` is canonical extended JSON (MongoDB Extended JSON v2, canonical mode) without
  whitespace, keys in document order. Nothing a BSON value holds is lost: ``int`` (Int32), ``Int64``, ``float``
  (Double) and ``Decimal128`` stay apart (``1``, ``Int64(1)`` and ``1.0`` give three texts), as do dates, binary
  subtypes, ObjectIds, timestamps, regular expressions and MinKey/MaxKey, nested at any depth.
  ``from_canonical_json(text)`` reads it back to the same BSON value (a Python ``int`` beyond Int32 comes back as
  ``Int64``: BSON stores it as Int64 anyway; a date outside Python's ``datetime`` range comes back as ``DatetimeMS``).
- ``sort_key(value)`` is a byte string whose bytewise order is MongoDB's BSON comparison order
  (https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/) for ``_id`` values: two values get
  equal keys exactly when MongoDB compares them equal (``1``, ``1.0``, ``Int64(1)``, ``Decimal128("1.00")``; ``0`` and
  ``-0.0``; every NaN), which is also when they are the same ``_id``. A top-level array has no key (it cannot be an
  ``_id``; MongoDB sorts an array field by its elements, not as a value): ``ValueError``. Values outside the
  documented table (JavaScript code, ``DBPointer``, undefined decoded otherwise than as ``None``) raise ``TypeError``.
- ``type_bracket(value)`` is the value's position in that table (``TypeBracket``): values of different brackets
  compare by bracket alone, so a chunk of one bracket can be read with a range on that bracket's values.

The key's encoding: one bracket byte (``TypeBracket`` + 1), then a payload that orders within the bracket and is
self-delimiting, so that keys of nested values concatenate without changing order:

- numbers: a class byte (NaN < -inf < negative < zero < positive < +inf), then for finite non-zero values the exact
  magnitude (``Decimal`` of the double, integer or Decimal128: exact, no precision lost) as a decimal exponent (2 bytes,
  offset) and its significant digits (one byte each, 1..10, ended by 0), all bytes inverted for negative values;
- strings: UTF-8 bytes with 0x00 escaped as 0x00 0xFF, ended by 0x00 0x00 (simple binary collation; a prefix first);
- objects: per field its bracket byte, its escaped name and its payload, ended by 0x00 (fewer fields first); arrays
  inside an object likewise without names;
- binary: length (4 bytes), subtype, bytes; ObjectId: its 12 bytes; booleans: 0/1; dates: milliseconds since the
  epoch with the sign bit flipped (8 bytes); timestamps: seconds then increment (4 + 4 bytes, unsigned); regular
  expressions: pattern then options, each as a string; MinKey, null and MaxKey: no payload.
"""

from __future__ import annotations

import datetime as dt
import re
import struct
import uuid
from collections.abc import Mapping
from decimal import Decimal
from enum import IntEnum
from typing import Any

from bson import json_util
from bson.binary import Binary
from bson.code import Code
from bson.datetime_ms import DatetimeMS
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.json_util import CANONICAL_JSON_OPTIONS, DatetimeConversion, JSONOptions
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp

__all__ = ["TypeBracket", "canonical_json", "from_canonical_json", "sort_key", "type_bracket"]

# reading: dates outside Python's datetime range come back as DatetimeMS instead of failing
_READ_OPTIONS: JSONOptions = CANONICAL_JSON_OPTIONS.with_options(datetime_conversion=DatetimeConversion.DATETIME_AUTO)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_EXPONENT_OFFSET = 1 << 15  # decimal exponents of Decimal128 (about -6200..6200) and doubles fit in 16 bits
_REGEX_OPTION_ORDER = "ilmsux"  # the order in which BSON writes regular expression options


class TypeBracket(IntEnum):
    """MongoDB's BSON comparison order of types (the documented table, lowest first)."""

    MIN_KEY = 0
    NULL = 1
    NUMBER = 2
    STRING = 3  # and Symbol
    OBJECT = 4
    ARRAY = 5
    BINARY = 6
    OBJECT_ID = 7
    BOOLEAN = 8
    DATE = 9
    TIMESTAMP = 10
    REGEX = 11
    MAX_KEY = 12


def canonical_json(value: Any) -> str:
    """Canonical extended JSON of a BSON value or document, compact (``","`` and ``":"``), keys in document order."""
    return json_util.dumps(value, json_options=CANONICAL_JSON_OPTIONS, separators=(",", ":"))


def from_canonical_json(text: str) -> Any:
    """The BSON value of a ``canonical_json`` text (documents as ``dict``, naive UTC datetimes)."""
    return json_util.loads(text, json_options=_READ_OPTIONS)


def type_bracket(value: Any) -> TypeBracket:
    """The bracket of ``value`` in MongoDB's BSON comparison order; ``TypeError`` for a value outside that table."""
    # bool before int (bool is an int in Python); Code before str (Code is a str); DBRef is an embedded document
    if isinstance(value, MinKey):
        return TypeBracket.MIN_KEY
    if value is None:
        return TypeBracket.NULL
    if isinstance(value, bool):
        return TypeBracket.BOOLEAN
    if isinstance(value, int | float | Decimal128):
        return TypeBracket.NUMBER
    if isinstance(value, Code):
        raise TypeError(f"no BSON comparison order is documented for JavaScript code: {value!r}")
    if isinstance(value, str):
        return TypeBracket.STRING
    if isinstance(value, Mapping | DBRef):
        return TypeBracket.OBJECT
    if isinstance(value, list | tuple):
        return TypeBracket.ARRAY
    if isinstance(value, bytes | uuid.UUID):  # Binary is bytes; a bare uuid.UUID is written as subtype 4
        return TypeBracket.BINARY
    if isinstance(value, ObjectId):
        return TypeBracket.OBJECT_ID
    if isinstance(value, dt.datetime | DatetimeMS):
        return TypeBracket.DATE
    if isinstance(value, Timestamp):
        return TypeBracket.TIMESTAMP
    if isinstance(value, Regex | re.Pattern):
        return TypeBracket.REGEX
    if isinstance(value, MaxKey):
        return TypeBracket.MAX_KEY
    raise TypeError(f"not a BSON value with a documented comparison order: {value!r} ({type(value).__name__})")


def sort_key(value: Any) -> bytes:
    """Bytes whose bytewise order is MongoDB's BSON comparison order of ``_id`` values (see the module docstring).

    ``ValueError`` for a top-level array (never an ``_id``) and for an integer outside Int64;
    ``TypeError`` for a value outside the documented table."""
    if type_bracket(value) is TypeBracket.ARRAY:
        raise ValueError(f"an array cannot be an _id and has no _id sort key: {value!r}")
    return _key(value)


def _key(value: Any) -> bytes:
    bracket = type_bracket(value)
    return bytes((bracket + 1,)) + _payload(bracket, value)


def _payload(bracket: TypeBracket, value: Any) -> bytes:
    if bracket in (TypeBracket.MIN_KEY, TypeBracket.NULL, TypeBracket.MAX_KEY):
        return b""
    if bracket is TypeBracket.NUMBER:
        return _number(value)
    if bracket is TypeBracket.STRING:
        return _string(value)
    if bracket is TypeBracket.OBJECT:
        fields = value.as_doc() if isinstance(value, DBRef) else value
        parts = []
        for name, item in fields.items():
            item_bracket = type_bracket(item)
            parts.append(bytes((item_bracket + 1,)) + _string(name) + _payload(item_bracket, item))
        return b"".join(parts) + b"\x00"
    if bracket is TypeBracket.ARRAY:  # inside an object: element by element, fewer elements first
        return b"".join(_key(item) for item in value) + b"\x00"
    if bracket is TypeBracket.BINARY:
        if isinstance(value, uuid.UUID):
            value = Binary.from_uuid(value)
        subtype = value.subtype if isinstance(value, Binary) else 0
        return struct.pack(">IB", len(value), subtype) + bytes(value)
    if bracket is TypeBracket.OBJECT_ID:
        return value.binary
    if bracket is TypeBracket.BOOLEAN:
        return b"\x01" if value else b"\x00"
    if bracket is TypeBracket.DATE:
        return struct.pack(">Q", _millis(value) + (1 << 63))
    if bracket is TypeBracket.TIMESTAMP:
        return struct.pack(">II", value.time, value.inc)
    if bracket is TypeBracket.REGEX:
        regex = Regex.from_native(value) if isinstance(value, re.Pattern) else value
        return _string(regex.pattern) + _string(_regex_options(regex.flags))
    raise AssertionError(f"unhandled bracket {bracket!r}")


def _string(text: str) -> bytes:
    return text.encode("utf-8").replace(b"\x00", b"\x00\xff") + b"\x00\x00"


def _regex_options(flags: int | str) -> str:
    if isinstance(flags, str):
        return "".join(sorted(flags, key=_REGEX_OPTION_ORDER.index))
    native = {"i": re.IGNORECASE, "l": re.LOCALE, "m": re.MULTILINE, "s": re.DOTALL, "u": re.UNICODE, "x": re.VERBOSE}
    return "".join(option for option in _REGEX_OPTION_ORDER if flags & native[option])


def _millis(value: dt.datetime | DatetimeMS) -> int:
    if isinstance(value, DatetimeMS):
        return int(value)
    if value.tzinfo is None:  # naive datetimes are UTC, as pymongo reads and writes them
        value = value.replace(tzinfo=dt.UTC)
    delta = value - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


# number classes, in order
_NAN, _NEG_INF, _NEGATIVE, _ZERO, _POSITIVE, _POS_INF = range(1, 7)


def _number(value: int | float | Decimal128) -> bytes:
    if isinstance(value, Decimal128):
        exact = value.to_decimal()  # exact: a Decimal holds every Decimal128
    elif isinstance(value, float):
        exact = Decimal(value)  # exact: the binary fraction's full decimal expansion
    else:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"an integer outside Int64 is not a BSON value: {value!r}")
        exact = Decimal(int(value))
    if exact.is_nan():
        return bytes((_NAN,))
    if exact.is_infinite():
        return bytes((_NEG_INF if exact < 0 else _POS_INF,))
    if exact.is_zero():
        return bytes((_ZERO,))
    magnitude = _magnitude(exact)
    if exact < 0:
        return bytes((_NEGATIVE,)) + bytes(255 - b for b in magnitude)
    return bytes((_POSITIVE,)) + magnitude


def _magnitude(value: Decimal) -> bytes:
    """``|value|`` (finite, not zero) as ``0.d1 d2 ... dn * 10**e`` with ``d1 != 0`` and ``dn != 0``: ``e`` in two
    bytes (offset), then the digits as bytes 1..10, then 0."""
    _, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    significant = list(digits)
    while significant[-1] == 0:
        significant.pop()
        exponent += 1
    return (
        struct.pack(">H", len(significant) + exponent + _EXPONENT_OFFSET) + bytes(d + 1 for d in significant) + b"\x00"
    )
