"""``filter_query.query_document``: the ``find`` filter of an ad-hoc snapshot, built from the filter's structure with
allow-listed operators only; typed values decoded from extended JSON, JavaScript and regular expressions refused."""

from __future__ import annotations

import datetime

import pytest
from bson import Int64, ObjectId

from cdc_assets.engine.row_filter import RowFilterError, parse_row_filter
from cdc_assets.sources.mongodb.filter_query import query_document


def query(raw: object) -> dict:
    return query_document(parse_row_filter(raw, "shop.products", None))


def test_terms_become_allow_listed_operators_anded() -> None:
    assert query({"column": "status", "value": "open"}) == {"status": {"$eq": "open"}}
    assert query(
        [
            {"column": "qty", "op": "between", "value": [1, 5]},
            {"column": "tags", "op": "not in", "value": ["a", "b"]},
            {"column": "address.city", "op": "is null"},
            {"column": "price", "op": "!=", "value": 2.5},
            {"column": "note", "op": "is not null"},
        ]
    ) == {
        "$and": [
            {"qty": {"$gte": 1, "$lte": 5}},
            {"tags": {"$nin": ["a", "b"]}},
            {"address.city": {"$eq": None}},
            {"price": {"$ne": 2.5}},
            {"note": {"$ne": None}},
        ]
    }
    assert query_document(None) == {}


def test_typed_values_round_trip_from_extended_json() -> None:
    document = query(
        [
            {"column": "_id", "op": "in", "value": [{"$oid": "5f1d7e0c2b4a3c0012345678"}, 7]},
            {"column": "seen", "op": ">=", "value": {"$date": "2024-01-01T00:00:00Z"}},
            {"column": "n", "value": {"$numberLong": "5"}},
        ]
    )
    ids, seen, n = (clause for clause in document["$and"])
    assert ids["_id"]["$in"] == [ObjectId("5f1d7e0c2b4a3c0012345678"), 7]
    assert isinstance(seen["seen"]["$gte"], datetime.datetime) and seen["seen"]["$gte"].year == 2024
    assert type(n["n"]["$eq"]) is Int64


@pytest.mark.parametrize(
    "value",
    [
        {"$code": "function() { return true }"},
        {"$regularExpression": {"pattern": ".*", "options": ""}},
        {"$where": "sleep(1000)"},
        {"$expr": {"$eq": [1, 1]}},
        {"$function": {"body": "x", "args": [], "lang": "js"}},
        {"$oid": "not-an-id"},
    ],
)
def test_operators_or_code_as_a_value_are_refused(value: dict) -> None:
    with pytest.raises(RowFilterError, match=r"table shop.products: filter term 1: value: .*(allowed|not a valid)"):
        query({"column": "status", "value": value})


@pytest.mark.parametrize("column", ["$where", "$expr", "a.$function", "status\x00", "a..b"])
def test_an_operator_as_a_field_name_is_refused_naming_the_field(column: str) -> None:
    with pytest.raises(RowFilterError, match=r"filter term 1: column .* is not a field path; allowed"):
        query({"column": column, "value": 1})
