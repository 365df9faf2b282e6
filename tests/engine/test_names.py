"""The name mapping: valid, stable, collision-free Dagster names and lake folders for any PostgreSQL name."""

import itertools
import re

import pytest

from cdc_assets.engine.names import (
    dagster_part,
    file_token,
    from_file_token,
    lake_folder,
    qualify,
    split_qualified,
    table_slug,
)

DAGSTER_NAME = re.compile(r"^[A-Za-z0-9_]+$")
ODD_NAMES = [
    "orders", "Orders", "order items", "order_items", "Order Items", "order-items", 'say "hi"', "a.b", "a", "b.c",
    "a__b", "b__c", "_a", "a_", "Größe", "Grösse", "注文", "x" * 63, "x" * 62 + "y", "é" * 31, "order_items_0123456789",
    "", " ", "__", "a.b.c", "1st", "ÄÖÜ" * 10,
]  # fmt: skip
SCHEMAS = ["public", "Sales", "a.b", "a", "my schema", "a__b"]


def test_ordinary_names_are_unchanged() -> None:
    assert qualify("public", "orders") == "public.orders"
    assert dagster_part("orders") == "orders"
    assert dagster_part("Orders") == "Orders"
    assert table_slug("public", "order_lines") == "public__order_lines"
    assert lake_folder("public", "orders") == "public.orders"
    assert file_token("public.orders") == "public.orders"


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("name", ODD_NAMES)
def test_every_name_maps_to_valid_names_and_back(schema: str, name: str) -> None:
    qualified = qualify(schema, name)
    assert split_qualified(qualified) == (schema, name)
    assert from_file_token(file_token(qualified)) == qualified
    assert "/" not in file_token(qualified)
    for text in (dagster_part(schema), dagster_part(name), table_slug(schema, name)):
        assert DAGSTER_NAME.match(text), text
        assert len(text) <= 2 * 40 + 2 + 11 or text in (schema, name, f"{schema}__{name}")
    assert "/" not in lake_folder(schema, name)
    # stable: a pure function of the name, whatever else exists
    assert dagster_part(name) == dagster_part(name) and table_slug(schema, name) == table_slug(schema, name)


def test_no_two_names_collide() -> None:
    pairs = list(itertools.product(SCHEMAS, ODD_NAMES))
    for mapping in (
        lambda s, n: qualify(s, n),
        table_slug,
        lake_folder,
        lambda s, n: (dagster_part(s), dagster_part(n)),
    ):
        mapped = [mapping(s, n) for s, n in pairs]
        assert len(set(mapped)) == len(pairs)


def test_a_name_that_looks_like_a_hashed_one_is_hashed_too() -> None:
    hashed = dagster_part("order items")
    assert hashed != "order_items" and hashed.startswith("order_items_")
    assert dagster_part(hashed) != hashed  # a table really named like the hashed form gets its own part
    assert table_slug("public", "a__b") != table_slug("public__a", "b")
    assert table_slug("a_", "_b") != table_slug("a", "__b")


def test_the_63_byte_limit_and_long_names_stay_short() -> None:
    assert len(dagster_part("é" * 31)) == 31 + 1 + 10  # 62 bytes in PostgreSQL, 31 characters
    assert len(dagster_part("x" * 62 + " ")) == 40 + 1 + 10
    assert len(table_slug("s" * 63, "t" * 63 + " ")) <= 2 * 40 + 2 + 11


@pytest.mark.parametrize("bad", ["orders", "a.b.c", '"a.b', 'a"b.c', ".a", "a.", '"a"x.b'])
def test_split_refuses_what_is_not_a_qualified_name(bad: str) -> None:
    with pytest.raises(ValueError):
        split_qualified(bad)
