"""``cdc_assets.sources.mongodb.bson_order`` without a server: canonical extended JSON keeps every BSON value, and
``sort_key`` orders like a comparator written here directly from MongoDB's documented BSON comparison order
(https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import math
import random
import re
import uuid
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from bson import json_util
from bson.binary import Binary
from bson.code import Code
from bson.datetime_ms import DatetimeMS
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.son import SON
from bson.timestamp import Timestamp

from cdc_assets.sources.mongodb.bson_order import (
    TypeBracket,
    canonical_json,
    from_canonical_json,
    sort_key,
    type_bracket,
)

# ---------------------------------------------------------------------------------------------------------------
# the reference: MongoDB's documented order, written without the module's encoding
# ---------------------------------------------------------------------------------------------------------------

# the documented table, lowest first: (rank, test)
DOCUMENTED_TYPES: list[tuple[str, Any]] = [
    ("MinKey", lambda v: isinstance(v, MinKey)),
    ("Null", lambda v: v is None),
    ("Numbers", lambda v: isinstance(v, int | float | Decimal128) and not isinstance(v, bool)),
    ("String", lambda v: isinstance(v, str)),
    ("Object", lambda v: isinstance(v, dict)),
    ("Array", lambda v: isinstance(v, list)),
    ("BinData", lambda v: isinstance(v, bytes)),
    ("ObjectId", lambda v: isinstance(v, ObjectId)),
    ("Boolean", lambda v: isinstance(v, bool)),
    ("Date", lambda v: isinstance(v, dt.datetime)),
    ("Timestamp", lambda v: isinstance(v, Timestamp)),
    ("Regular Expression", lambda v: isinstance(v, Regex)),
    ("MaxKey", lambda v: isinstance(v, MaxKey)),
]


def reference_rank(value: Any) -> int:
    (rank,) = [rank for rank, (_, test) in enumerate(DOCUMENTED_TYPES) if test(value)]
    return rank


def sign(number: int | Fraction) -> int:
    return (number > 0) - (number < 0)


def number_value(value: int | float | Decimal128) -> tuple[int, Fraction]:
    """(class, value): NaN lowest, then -inf, finite by exact value, +inf."""
    number = value.to_decimal() if isinstance(value, Decimal128) else Decimal(value)
    if number.is_nan():
        return (0, Fraction(0))
    if number.is_infinite():
        return (1 if number < 0 else 3, Fraction(0))
    return (2, Fraction(number))


def compare_tuples(a: tuple[Any, ...], b: tuple[Any, ...]) -> int:
    return (a > b) - (a < b)


def reference_compare(a: Any, b: Any) -> int:
    """-1, 0 or 1 as MongoDB's documentation orders ``a`` and ``b``."""
    rank_a, rank_b = reference_rank(a), reference_rank(b)
    if rank_a != rank_b:
        return sign(rank_a - rank_b)
    name = DOCUMENTED_TYPES[rank_a][0]
    if name in ("MinKey", "Null", "MaxKey"):
        return 0
    if name == "Numbers":
        return compare_tuples(number_value(a), number_value(b))
    if name == "String":  # simple collation: binary comparison of UTF-8
        return compare_tuples((a.encode(),), (b.encode(),))
    if name == "Object":  # field by field: type, then name, then value; then the shorter first
        for (name_a, value_a), (name_b, value_b) in zip(a.items(), b.items(), strict=False):
            if reference_rank(value_a) != reference_rank(value_b):
                return sign(reference_rank(value_a) - reference_rank(value_b))
            if name_a != name_b:
                return compare_tuples((name_a.encode(),), (name_b.encode(),))
            result = reference_compare(value_a, value_b)
            if result:
                return result
        return sign(len(a) - len(b))
    if name == "Array":  # element by element, then the shorter first
        for item_a, item_b in zip(a, b, strict=False):
            result = reference_compare(item_a, item_b)
            if result:
                return result
        return sign(len(a) - len(b))
    if name == "BinData":  # length, then subtype, then bytes
        subtype_a, subtype_b = getattr(a, "subtype", 0), getattr(b, "subtype", 0)
        return compare_tuples((len(a), subtype_a, bytes(a)), (len(b), subtype_b, bytes(b)))
    if name == "ObjectId":
        return compare_tuples((a.binary,), (b.binary,))
    if name == "Boolean":
        return sign(int(a) - int(b))
    if name == "Date":
        return sign(int(DatetimeMS(a)) - int(DatetimeMS(b)))
    if name == "Timestamp":
        return compare_tuples((a.time, a.inc), (b.time, b.inc))
    if name == "Regular Expression":  # pattern, then options (as BSON writes them)
        return compare_tuples(regex_parts(a), regex_parts(b))
    raise AssertionError(name)


def regex_parts(regex: Regex) -> tuple[bytes, bytes]:
    text = json_util.dumps(regex, json_options=json_util.CANONICAL_JSON_OPTIONS)
    parsed = json.loads(text)["$regularExpression"]
    return parsed["pattern"].encode(), parsed["options"].encode()


def key_compare(a: Any, b: Any) -> int:
    key_a, key_b = sort_key(a), sort_key(b)
    return (key_a > key_b) - (key_a < key_b)


# ---------------------------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------------------------

EDGE_NUMBERS: list[Any] = [
    float("nan"),
    Decimal128("NaN"),
    float("-inf"),
    Decimal128("-Infinity"),
    -(2**63),
    Int64(-(2**63)),
    -1e300,
    -2.5,
    -1,
    Decimal128("-1.0000000000000000000000000000001"),
    -5e-324,
    0,
    -0.0,
    Decimal128("-0"),
    Decimal128("0E-6176"),
    Decimal128("1E-6176"),
    5e-324,
    0.1,
    Decimal128("0.1"),
    Decimal128("0.1000000000000000055511151231257827"),
    1,
    Int64(1),
    1.0,
    Decimal128("1.00"),
    Decimal128("1.0000000000000000000000000000001"),
    Decimal128("1.0000000000000000000000000000002"),
    2**53,
    float(2**53),
    Int64(2**53 + 1),
    2**63 - 1,
    1e300,
    Decimal128("9.999999999999999999999999999999999E+6144"),
    float("inf"),
    Decimal128("Infinity"),
]
EDGE_VALUES: list[Any] = [
    MinKey(),
    None,
    *EDGE_NUMBERS,
    "",
    "a",
    "a\x00",
    "a\x00b",
    "ab",
    "Z",
    "é",
    "\uffff",
    "\U0001f600",
    {},
    {"a": None},
    {"a": 1},
    {"a": 1.0, "b": None},
    {"aa": 0},
    {"b": 0},
    {"a": "x"},
    {"a": {}},
    {"a": []},
    {"a": [1]},
    {"a": [1, 2]},
    {"a": [1, "x"]},
    {"a": [[]]},
    {"a": b""},
    {"a": True},
    {"a": MaxKey()},
    Binary(b"", 0),
    b"\xff",
    Binary(b"\x00", 128),
    b"\x00\x00",
    Binary(uuid.UUID(int=0).bytes, 4),
    Binary(uuid.UUID(int=1).bytes, 3),
    ObjectId("000000000000000000000000"),
    ObjectId("000000000000000000000001"),
    ObjectId("ffffffffffffffffffffffff"),
    False,
    True,
    dt.datetime(1900, 1, 1),
    dt.datetime(1969, 12, 31, 23, 59, 59, 999000),
    dt.datetime(1970, 1, 1),
    dt.datetime(2024, 2, 29, 12, 0, 0, 1000),
    Timestamp(0, 0),
    Timestamp(0, 1),
    Timestamp(1, 0),
    Timestamp(2**32 - 1, 2**32 - 1),
    Regex("a", ""),
    Regex("a", "i"),
    Regex("a", "im"),
    Regex("ab", ""),
    Regex("b", ""),
    MaxKey(),
]


def random_number(rng: random.Random) -> Any:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randint(-(2**31), 2**31 - 1)
    if kind == 1:
        return Int64(rng.randint(-(2**63), 2**63 - 1))
    if kind == 2:
        return rng.choice([-1, 1]) * rng.random() * 10 ** rng.randint(-30, 30)
    if kind == 3:  # 34 digits, beyond a double's precision
        digits = "".join(rng.choice("0123456789") for _ in range(34))
        return Decimal128(f"{rng.choice('-+')}{digits}E{rng.randint(-60, 30)}")
    return rng.choice([0, 1, -1, 2, 0.5, 1.5, Int64(2), Decimal128("2"), Decimal128("0.5")])


def random_string(rng: random.Random) -> str:
    alphabet = ["a", "b", "A", "\x00", "é", "ж", "\uffff", "\U0001f600", "z"]
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(4)))


def random_scalar(rng: random.Random) -> Any:
    kind = rng.randrange(11)
    if kind == 0:
        return random_number(rng)
    if kind == 1:
        return random_string(rng)
    if kind == 2:
        return Binary(rng.randbytes(rng.randrange(3)), rng.choice([0, 0, 4, 128]))
    if kind == 3:
        return ObjectId(rng.randbytes(12))
    if kind == 4:
        return rng.random() < 0.5
    if kind == 5:
        return dt.datetime(1970, 1, 1) + dt.timedelta(milliseconds=rng.randint(-(10**12), 10**12))
    if kind == 6:
        return Timestamp(rng.randrange(3), rng.randrange(3))
    if kind == 7:
        return Regex(rng.choice(["a", "b", "ab"]), rng.choice(["", "i", "m", "im"]))
    if kind == 8:
        return rng.choice([None, MinKey(), MaxKey()])
    if kind == 9:
        return random_document(rng, depth=1)
    return random_number(rng)


def random_document(rng: random.Random, depth: int) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for _ in range(rng.randrange(3)):
        name = rng.choice(["a", "b", "ab", "é"])
        if depth < 2 and rng.random() < 0.2:
            document[name] = [random_scalar(rng) for _ in range(rng.randrange(3))]
        elif depth < 2 and rng.random() < 0.2:
            document[name] = random_document(rng, depth + 1)
        else:
            document[name] = random_scalar(rng)
    return document


def mixed_values(seed: int, count: int) -> list[Any]:
    rng = random.Random(seed)
    values = [*EDGE_VALUES, *(random_scalar(rng) for _ in range(count))]
    rng.shuffle(values)
    return values


# ---------------------------------------------------------------------------------------------------------------
# sort_key
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sort_key_orders_like_the_documented_comparison(seed: int) -> None:
    values = mixed_values(seed, 400)
    by_key = sorted(values, key=sort_key)
    by_reference = sorted(values, key=functools.cmp_to_key(reference_compare))
    # both sorts are stable and start from the same shuffled list: agreeing comparators give the same sequence
    assert [canonical_json(v) for v in by_key] == [canonical_json(v) for v in by_reference]


def test_sort_key_agrees_with_the_reference_on_every_pair_of_edge_values() -> None:
    disagreements = [
        (a, b, reference_compare(a, b), key_compare(a, b))
        for a in EDGE_VALUES
        for b in EDGE_VALUES
        if reference_compare(a, b) != key_compare(a, b)
    ]
    assert disagreements == []


def test_the_documented_type_order_of_one_value_per_bracket() -> None:
    one_each = [
        MinKey(),
        None,
        -(10**18),
        "",
        {},
        b"",
        ObjectId("000000000000000000000000"),
        False,
        dt.datetime(1, 1, 1),
        Timestamp(0, 0),
        Regex("", ""),
        MaxKey(),
    ]
    keys = [sort_key(v) for v in one_each]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    assert [type_bracket(v) for v in one_each] == [b for b in TypeBracket if b is not TypeBracket.ARRAY]


@pytest.mark.parametrize(
    "equal",
    [
        [1, Int64(1), 1.0, Decimal128("1.00"), Decimal128("1E0"), Decimal128("0.001E3")],
        [0, -0.0, 0.0, Int64(0), Decimal128("-0"), Decimal128("0E-6176"), Decimal128("0E+6111")],
        [float("nan"), Decimal128("NaN"), Decimal128("-NaN"), -float("nan")],
        [float("-inf"), Decimal128("-Infinity")],
        [2**53, float(2**53), Int64(2**53), Decimal128("9007199254740992")],
        [{"a": 1}, {"a": 1.0}, {"a": Int64(1)}],
        [b"x", Binary(b"x", 0)],
        [dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 1, tzinfo=dt.UTC), DatetimeMS(1577836800000)],
    ],
)
def test_values_mongodb_compares_equal_get_equal_keys(equal: list[Any]) -> None:
    assert {sort_key(v) for v in equal} == {sort_key(equal[0])}


@pytest.mark.parametrize(
    ("lower", "higher"),
    [
        (1, Decimal128("1.0000000000000000000000000000001")),
        (Decimal128("1.0000000000000000000000000000001"), Decimal128("1.0000000000000000000000000000002")),
        (Decimal128("0.1"), 0.1),  # the double nearest 0.1 is 0.1000000000000000055511151231257827...
        (0.1, Decimal128("0.1000000000000000055511151231257828")),
        (float(2**53), Int64(2**53 + 1)),
        (Int64(2**63 - 2), 2**63 - 1),
        (float("nan"), float("-inf")),
        (-1e300, -5e-324),
        (-5e-324, 0),
        (Decimal128("-1E+6144"), Decimal128("-1E-6176")),
        (-0.125, -0.12),
        (0.12, 0.125),
        ("a", "a\x00"),
        ("a\x00", "a\x00b"),
        ("a\x00b", "ab"),
        ("\uffff", "\U0001f600"),  # UTF-8 byte order (UTF-16 code units would order them the other way)
        ({"a": 1}, {"a": 1, "b": MinKey()}),
        ({"b": 0}, {"a": "x"}),  # the field type is compared before the field name
        ({"a": [1]}, {"a": [1, 2]}),
        ({"a": [2]}, {"a": [10]}),
        (b"\xff", b"\x00\x00"),  # length before content
        (Binary(b"\xff", 0), Binary(b"\x00", 128)),  # subtype before content
        (dt.datetime(1969, 1, 1), dt.datetime(1970, 1, 1)),
        (Timestamp(1, 2**32 - 1), Timestamp(2, 0)),
        (Regex("a", "m"), Regex("a", "mx")),
    ],
)
def test_order_within_a_bracket(lower: Any, higher: Any) -> None:
    assert sort_key(lower) < sort_key(higher)
    assert reference_compare(lower, higher) == -1


def test_sort_key_refuses_a_top_level_array_naming_it() -> None:
    with pytest.raises(ValueError, match=r"array cannot be an _id.*\[1, 'x'\]"):
        sort_key([1, "x"])
    assert type_bracket([1, "x"]) is TypeBracket.ARRAY


def test_sort_key_refuses_values_outside_the_table() -> None:
    with pytest.raises(TypeError, match="JavaScript code"):
        sort_key(Code("return 1"))
    with pytest.raises(TypeError, match="complex"):
        sort_key(1j)
    with pytest.raises(ValueError, match="outside Int64"):
        sort_key(2**63)


def test_other_python_spellings_of_bson_values() -> None:
    assert sort_key(uuid.UUID(int=7)) == sort_key(Binary.from_uuid(uuid.UUID(int=7)))
    assert sort_key(SON([("b", 1), ("a", 2)])) == sort_key({"b": 1, "a": 2}) != sort_key({"a": 2, "b": 1})
    assert sort_key(re.compile("a", re.IGNORECASE)) == sort_key(Regex("a", "iu"))  # str patterns carry re.UNICODE
    assert sort_key({"a": (1, 2)}) == sort_key({"a": [1, 2]})


# ---------------------------------------------------------------------------------------------------------------
# canonical extended JSON
# ---------------------------------------------------------------------------------------------------------------

ROUND_TRIP_VALUES: list[Any] = [
    1,
    -(2**31),
    Int64(1),
    Int64(2**63 - 1),
    1.0,
    -0.0,
    float("nan"),
    float("inf"),
    Decimal128("1.10"),
    Decimal128("-0"),
    Decimal128("NaN"),
    Decimal128("9.999999999999999999999999999999999E+6144"),
    "text é \U0001f600 \x00",
    None,
    True,
    dt.datetime(2024, 2, 29, 12, 30, 1, 123000),
    dt.datetime(1, 1, 1),
    DatetimeMS(-(2**62)),  # outside Python's datetime range
    b"\x00\xff",
    Binary(b"\x01", 128),
    Binary(uuid.UUID(int=5).bytes, 4),
    Binary(b"\x01\x02", 5),
    ObjectId("0123456789abcdef01234567"),
    Timestamp(2**32 - 1, 7),
    Regex("^a.*$", "imsx"),
    MinKey(),
    MaxKey(),
    Code("function () { return 1 }"),
    {"z": 1, "a": {"y": Int64(2), "b": [1, 1.0, Int64(1), Decimal128("1")]}, "": None},
    [{"_id": ObjectId("0123456789abcdef01234567")}, [], [[Int64(3)]]],
]


@pytest.mark.parametrize("value", ROUND_TRIP_VALUES, ids=lambda v: type(v).__name__)
def test_canonical_json_round_trips(value: Any) -> None:
    text = canonical_json(value)
    back = from_canonical_json(text)
    assert canonical_json(back) == text
    assert type(back) is type(value) or (isinstance(value, bytes) and type(back) in (bytes, Binary))
    if not (isinstance(value, float) and math.isnan(value)) and not isinstance(value, Decimal128):
        assert back == value


def test_canonical_json_keeps_number_types_apart() -> None:
    texts = {canonical_json(v) for v in (1, Int64(1), 1.0, Decimal128("1"), Decimal128("1.0"))}
    assert texts == {
        '{"$numberInt":"1"}',
        '{"$numberLong":"1"}',
        '{"$numberDouble":"1.0"}',
        '{"$numberDecimal":"1"}',
        '{"$numberDecimal":"1.0"}',
    }
    assert type(from_canonical_json('{"$numberInt":"1"}')) is int
    assert type(from_canonical_json('{"$numberLong":"1"}')) is Int64
    assert type(from_canonical_json('{"$numberDouble":"1.0"}')) is float


def test_canonical_json_is_compact_and_keeps_document_order() -> None:
    document = {"_id": 1, "x": Int64(2), "y": 1.5, "d": dt.datetime(1970, 1, 1, 0, 0, 1), "b": {"z": None, "a": []}}
    assert canonical_json(document) == (
        '{"_id":{"$numberInt":"1"},"x":{"$numberLong":"2"},"y":{"$numberDouble":"1.5"},'
        '"d":{"$date":{"$numberLong":"1000"}},"b":{"z":null,"a":[]}}'
    )
    assert list(from_canonical_json(canonical_json(SON([("b", 1), ("a", 2)])))) == ["b", "a"]
