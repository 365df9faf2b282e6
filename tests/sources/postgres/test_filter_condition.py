"""``snapshot.filter_condition``: an ad-hoc snapshot's filter composed by psycopg (identifiers quoted, values as
escaped literals cast to the column's declared type, operators from a fixed map), never pasted into SQL."""

from __future__ import annotations

import pytest

from cdc_assets.engine.row_filter import RowFilterError, parse_row_filter
from cdc_assets.sources.postgres.catalog import CapturedTable
from cdc_assets.sources.postgres.pg_values import PgColumn
from cdc_assets.sources.postgres.snapshot import filter_condition, rows_matching_select

COLUMNS = (
    PgColumn("id", 20, -1, "bigint", "N", None, None, True),
    PgColumn("status", 25, -1, "text", "S", None, None, False),
    PgColumn('odd "name"', 1700, -1, "numeric(10,2)", "N", None, None, False),
    PgColumn("due", 1082, -1, "date", "D", None, None, False),
)
TABLE = CapturedTable("src", "public", "orders", COLUMNS, ("id",), True, True, 1000)


def condition(raw: object) -> str:
    row_filter = parse_row_filter(raw, TABLE.qualified_name, [c.name for c in COLUMNS])
    return filter_condition(TABLE, row_filter).as_string(None)


def test_every_operator_composes_identifiers_and_cast_literals() -> None:
    assert condition({"column": "status", "op": "=", "value": "open"}) == "(\"status\" = cast('open' as text))"
    assert condition(
        [
            {"column": "id", "op": "between", "value": [1, 9]},
            {"column": "status", "op": "not in", "value": ["a", "b"]},
            {"column": 'odd "name"', "op": ">=", "value": 2.5},
            {"column": "due", "op": "is null"},
            {"column": "id", "op": "!=", "value": True},
        ]
    ) == (
        "(\"id\" between cast('1' as bigint) and cast('9' as bigint)) and "
        "(\"status\" not in (cast('a' as text), cast('b' as text))) and "
        '("odd ""name""" >= cast(\'2.5\' as numeric(10,2))) and '
        '("due" is null) and '
        "(\"id\" <> cast('true' as bigint))"
    )


@pytest.mark.parametrize(
    "value",
    ["1; drop table public.orders; --", "1' or '1'='1", "x'); delete from public.orders where ('1'='1"],
)
def test_an_injection_attempt_in_a_value_is_one_quoted_literal(value: str) -> None:
    composed = condition({"column": "status", "op": "=", "value": value})
    quoted = "'" + value.replace("'", "''") + "'"
    assert composed == f'("status" = cast({quoted} as text))'


def test_a_backslash_before_a_quote_cannot_end_the_literal() -> None:
    # without a connection psycopg writes an escape string, in which it doubles the backslash and the quote
    assert condition({"column": "status", "value": "\\' or true --"}) == (
        "(\"status\" = cast( E'\\\\'' or true --' as text))"
    )


def test_no_filter_selects_every_row_and_a_filter_restricts_the_select() -> None:
    assert rows_matching_select(TABLE, None).as_string(None).endswith('from "public"."orders" where true')
    row_filter = parse_row_filter({"column": "id", "op": "in", "value": [3, 4]}, TABLE.qualified_name, ["id"])
    assert rows_matching_select(TABLE, row_filter).as_string(None) == (
        'select "id", "status", "odd ""name""", "due" from "public"."orders" where '
        "(\"id\" in (cast('3' as bigint), cast('4' as bigint)))"
    )


def test_a_typed_value_or_a_column_the_table_lost_is_refused() -> None:
    typed = {"column": "id", "value": {"$oid": "5f1d7e0c2b4a3c0012345678"}}
    row_filter = parse_row_filter(typed, "public.orders", None)
    with pytest.raises(RowFilterError, match=r"term 1: value: .* is a typed value .*MongoDB.*string, a number"):
        filter_condition(TABLE, row_filter)
    gone = parse_row_filter({"column": "dropped", "value": 1}, "public.orders", None)
    with pytest.raises(RowFilterError, match=r"column 'dropped' is not a column of the table \(now\); one of id"):
        filter_condition(TABLE, gone)
