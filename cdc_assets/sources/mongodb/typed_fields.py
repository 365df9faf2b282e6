"""Declared top-level fields of a collection as typed lake columns: which BSON values fit which type.

Contract:
- ``arrow_type(type_text)``: the Arrow type of a declared type (``cdc_assets.config.FIELD_TYPES``): ``string`` ->
  string, ``int`` -> int32, ``long`` -> int64, ``double`` -> float64, ``decimal(p,s)`` -> decimal128(p,s),
  ``boolean`` -> bool, ``timestamp`` -> timestamp[us, UTC], ``date`` -> date32, ``binary`` -> binary (Spark:
  String, Integer, Long, Double, Decimal(p,s), Boolean, Timestamp, Date, Binary).
- ``convert(value, type_text)`` -> ``(typed, text)``: a value that fits gives its typed value and no text; a missing
  field (``MISSING``) or BSON null gives ``(None, None)``; a value that does not fit gives ``(None, text)``, the
  value's canonical extended JSON (``bson_order.canonical_json``), so nothing is lost. What fits, by BSON type (never
  by parsing text, never rounded, never truncated):
  - ``string``: a BSON string only (a number, a symbol, an ObjectId do not fit);
  - ``int``: Int32; Int64 within -2^31..2^31-1;
  - ``long``: Int32, Int64;
  - ``double``: Double (NaN and infinities too), Int32, Int64 whose value a double holds exactly;
  - ``decimal(p,s)``: a finite Decimal128, Int32 or Int64 with at most ``s`` fractional digits (trailing zeros beyond
    the scale carry no value) and at most ``p - s`` integer digits; a Double never (its decimal text is not its value);
  - ``boolean``: a BSON boolean (not 0/1);
  - ``timestamp``: a BSON date (UTC) in years 1..9999; a BSON Timestamp (the oplog's type) does not fit;
  - ``date``: a BSON date at exactly 00:00:00.000 UTC in years 1..9999 (another time of day would be cut off);
  - ``binary``: BSON binary of the generic subtype 0 (another subtype, e.g. a UUID, would lose its subtype).
  Arrays, documents and every other BSON type fit none.
- ``typed_values(document, fields)`` -> ``(values, unrepresentable)``: each declared field's typed value by name, and
  the texts of the values that do not fit by field name in declared order, or None when every value fits (as
  PostgreSQL's ``_cdc_unrepresentable``: typed NULL without an entry means the value is NULL or missing).
"""

from __future__ import annotations

import datetime as dt
import decimal
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import pyarrow as pa
from bson.binary import Binary
from bson.datetime_ms import DatetimeMS
from bson.decimal128 import Decimal128
from bson.int64 import Int64

from cdc_assets.config import FieldConfig
from cdc_assets.sources.mongodb.bson_order import canonical_json


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()
_DECIMAL = re.compile(r"decimal\((\d+),(\d+)\)")
_INT32 = (-(1 << 31), (1 << 31) - 1)
_SIMPLE: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int": pa.int32(),
    "long": pa.int64(),
    "double": pa.float64(),
    "boolean": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
    "binary": pa.binary(),
}
_EXACT = decimal.Context(prec=100)


def arrow_type(type_text: str) -> pa.DataType:
    match = _DECIMAL.fullmatch(type_text)
    if match is not None:
        return pa.decimal128(int(match.group(1)), int(match.group(2)))
    return _SIMPLE[type_text]


def arrow_fields(fields: Sequence[FieldConfig]) -> list[pa.Field]:
    return [pa.field(f.name, arrow_type(f.type)) for f in fields]


def _integer(value: Any) -> int | None:
    """The value of a BSON Int32 (a Python ``int``) or Int64 (``Int64``); None for anything else (booleans too)."""
    if type(value) is int or type(value) is Int64:
        return int(value)
    return None


def _decimal(value: decimal.Decimal, precision: int, scale: int) -> decimal.Decimal | None:
    if not value.is_finite():
        return None
    if value != 0 and value.adjusted() >= precision - scale:  # more integer digits than p - s
        return None
    try:
        exact = value.quantize(decimal.Decimal(1).scaleb(-scale), context=_EXACT)
    except decimal.InvalidOperation:  # e.g. 1E-6000 to scale 2: more digits than any decimal(p,s) holds
        return None
    if exact != value:  # significant digits beyond the scale
        return None
    return exact.copy_abs() if exact == 0 else exact


def _utc(value: dt.datetime) -> dt.datetime:
    return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


def _fit(value: Any, type_text: str) -> tuple[bool, Any]:
    """(fits, typed value)."""
    if type_text == "string":
        return (True, value) if type(value) is str else (False, None)
    if type_text in ("int", "long"):
        number = _integer(value)
        if number is None or (type_text == "int" and not _INT32[0] <= number <= _INT32[1]):
            return False, None
        return True, number
    if type_text == "double":
        if type(value) is float:
            return True, value
        number = _integer(value)
        if number is not None and int(float(number)) == number:
            return True, float(number)
        return False, None
    if type_text == "boolean":
        return (True, value) if type(value) is bool else (False, None)
    if type_text in ("timestamp", "date"):
        if not isinstance(value, dt.datetime) or isinstance(value, DatetimeMS):
            return False, None
        at = _utc(value)
        if type_text == "timestamp":
            return True, at
        if at.time() != dt.time(0):
            return False, None
        return True, at.date()
    if type_text == "binary":
        if isinstance(value, bytes) and (not isinstance(value, Binary) or value.subtype == 0):
            return True, bytes(value)
        return False, None
    match = _DECIMAL.fullmatch(type_text)
    if match is None:
        raise ValueError(f"not a declared field type: {type_text!r}")
    if isinstance(value, Decimal128):
        exact = value.to_decimal()
    elif (number := _integer(value)) is not None:
        exact = decimal.Decimal(number)
    else:
        return False, None
    typed = _decimal(exact, int(match.group(1)), int(match.group(2)))
    return typed is not None, typed


def convert(value: Any, type_text: str) -> tuple[Any, str | None]:
    """``(typed, text)`` of one field's value (see the module docstring)."""
    if value is MISSING or value is None:
        return None, None
    fits, typed = _fit(value, type_text)
    return (typed, None) if fits else (None, canonical_json(value))


def typed_values(
    document: Mapping[str, Any], fields: Sequence[FieldConfig]
) -> tuple[dict[str, Any], dict[str, str] | None]:
    values: dict[str, Any] = {}
    texts: dict[str, str] = {}
    for declared in fields:
        typed, text = convert(document.get(declared.name, MISSING), declared.type)
        values[declared.name] = typed
        if text is not None:
            texts[declared.name] = text
    return values, texts or None
