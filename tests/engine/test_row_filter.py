"""``cdc_assets.engine.row_filter``: a structured filter is validated without a database; anything else (free text,
an injection attempt in any field, an unknown operator, a bad value) is refused with a message naming the table, the
term, the field and the allowed values."""

from __future__ import annotations

import pytest

from cdc_assets.engine.row_filter import (
    MAX_LIST_VALUES,
    MAX_TERMS,
    OPERATORS,
    FilterTerm,
    RowFilter,
    RowFilterError,
    SnapshotRowsRefused,
    parse_row_filter,
)

COLUMNS = ["id", "status", "amount", "note"]


def parse(raw: object, columns: list[str] | None = COLUMNS) -> RowFilter:
    return parse_row_filter(raw, "public.orders", columns)


def test_one_term_and_a_list_of_terms_parse_into_terms_anded() -> None:
    assert parse({"column": "status", "op": "=", "value": "open"}) == RowFilter(
        "public.orders", (FilterTerm("status", "=", "open"),)
    )
    parsed = parse(
        [
            {"column": "id", "op": "between", "value": [10, 20]},
            {"column": "status", "op": "NOT  IN", "value": ["closed", "void"]},
            {"column": "note", "op": "is not null"},
            {"column": "amount", "value": 2.5},  # op defaults to =
        ]
    )
    assert parsed.terms == (
        FilterTerm("id", "between", (10, 20)),
        FilterTerm("status", "not in", ("closed", "void")),
        FilterTerm("note", "is not null"),
        FilterTerm("amount", "=", 2.5),
    )
    assert parsed.describe() == (
        'id between 10 and 20 and status not in ("closed", "void") and note is not null and amount = 2.5'
    )
    assert parsed.to_json()[1] == {"column": "status", "op": "not in", "value": ["closed", "void"]}
    assert parsed.to_json()[2] == {"column": "note", "op": "is not null"}


@pytest.mark.parametrize(
    "column",
    ["id = 1; drop table t", "1=1 or true", "id) or (1=1", 'status" or "1"="1', "ID", "status ", ""],
)
def test_text_in_the_column_field_is_refused_naming_the_field_and_the_columns(column: str) -> None:
    with pytest.raises(RowFilterError) as refused:
        parse({"column": column, "op": "=", "value": 1})
    message = str(refused.value)
    assert message.startswith("table public.orders: filter term 1: column")
    if column:
        assert repr(column) in message and "one of id, status, amount, note" in message


def test_a_free_text_filter_is_refused() -> None:
    with pytest.raises(RowFilterError, match=r"table public.orders: filter: expected a term .* never free text"):
        parse("status = 'open' or 1=1")
    with pytest.raises(RowFilterError, match=r"filter term 2: expected a term .*got str"):
        parse([{"column": "id", "value": 1}, "1=1 or true"])


@pytest.mark.parametrize("op", ["or", "; drop table t", "like", "=~", "$where", "$expr", "==", 1])
def test_an_operator_outside_the_allow_list_is_refused_naming_the_allowed_ones(op: object) -> None:
    with pytest.raises(RowFilterError) as refused:
        parse({"column": "status", "op": op, "value": "x"})
    assert f"filter term 1: op {op!r} is not allowed; allowed: {', '.join(OPERATORS)}" in str(refused.value)


def test_an_unknown_field_of_a_term_is_refused() -> None:
    with pytest.raises(RowFilterError, match=r"term 1: unknown field condition, sql; allowed: column, op, value"):
        parse({"column": "id", "value": 1, "sql": "1=1", "condition": "true"})
    with pytest.raises(RowFilterError, match=r"term 1: column is missing"):
        parse({"op": "=", "value": 1})


@pytest.mark.parametrize(
    ("term", "said"),
    [
        ({"column": "status", "op": "=", "value": None}, "value is missing or null for op '='.*use op 'is null'"),
        ({"column": "status", "op": "!="}, "use op 'is not null'"),
        ({"column": "note", "op": "is null", "value": "x"}, "op 'is null' takes no value"),
        ({"column": "id", "op": "in", "value": 3}, "op 'in' takes a list of values"),
        ({"column": "id", "op": "in", "value": []}, "op 'in' takes a non-empty list"),
        ({"column": "id", "op": "in", "value": [1, None]}, "value 2 is null"),
        ({"column": "id", "op": "between", "value": [1]}, "op 'between' takes exactly two values"),
        ({"column": "id", "op": "between", "value": 5}, "exactly two: the low and the high bound"),
        ({"column": "id", "op": "=", "value": [1, 2]}, r"value: \[1, 2\] is not a value; allowed: a string"),
        ({"column": "id", "op": "=", "value": {"a": 1, "b": 2}}, "is not a value"),
        ({"column": "id", "op": "=", "value": {"where": "1"}}, "is not a value"),
        ({"column": "amount", "op": ">", "value": float("nan")}, "a number must be finite"),
        ({"column": "id", "op": "in", "value": [[1]]}, r"value 1: \[1\] is not a value"),
    ],
)
def test_a_bad_value_is_refused_naming_the_term_and_the_allowed_form(term: dict, said: str) -> None:
    with pytest.raises(RowFilterError, match=r"table public.orders: filter term 1: .*" + said):
        parse(term)


def test_bounds_on_terms_and_list_values() -> None:
    with pytest.raises(RowFilterError, match=rf"at most {MAX_TERMS} are allowed"):
        parse([{"column": "id", "value": n} for n in range(MAX_TERMS + 1)])
    with pytest.raises(RowFilterError, match=rf"at most {MAX_LIST_VALUES} values"):
        parse({"column": "id", "op": "in", "value": list(range(MAX_LIST_VALUES + 1))})
    with pytest.raises(RowFilterError, match="an empty list of terms"):
        parse([])


def test_document_field_paths_without_a_fixed_schema() -> None:
    parsed = parse({"column": "address.city", "value": "Bern"}, columns=None)
    assert parsed.terms == (FilterTerm("address.city", "=", "Bern"),)
    assert parse({"column": "_id", "value": {"$oid": "5f1d7e0c2b4a3c0012345678"}}, columns=None).terms[0].value == {
        "$oid": "5f1d7e0c2b4a3c0012345678"
    }
    for column in ["$where", "a.$gt", "$expr", "a..b", ".a", "a\x00b", "x" * 300]:
        with pytest.raises(RowFilterError, match=r"term 1: column .* is not a field path; allowed: .*'\$'"):
            parse({"column": column, "value": 1}, columns=None)


def test_a_filter_error_is_a_refused_snapshot() -> None:
    assert issubclass(RowFilterError, SnapshotRowsRefused) and issubclass(SnapshotRowsRefused, ValueError)
