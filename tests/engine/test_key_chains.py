"""``chain_roots``: a key change whose old key got its row from an earlier key change of the same batch takes its
unchanged value from the first key change of the chain."""

from __future__ import annotations

from cdc_assets.engine.key_chains import chain_roots


def test_every_key_change_of_a_chain_points_to_its_first() -> None:
    links = [("big", 30, 0, 20, 0), ("big", 20, 0, 10, 0), ("big", 40, 1, 30, 0), ("other", 30, 0, 25, 0)]
    assert chain_roots(links) == {
        ("big", 30, 0): (10, 0), ("big", 20, 0): (10, 0), ("big", 40, 1): (10, 0), ("other", 30, 0): (25, 0),
    }  # fmt: skip


def test_columns_chain_separately_and_order_of_links_does_not_matter() -> None:
    chain = [("c", p, 0, p - 1, 0) for p in range(2, 500)]
    for links in (chain, list(reversed(chain))):
        roots = chain_roots(links)
        assert set(roots.values()) == {(1, 0)}
        assert len(roots) == 498
    assert chain_roots([("a", 5, 1, 5, 0), ("b", 5, 1, 4, 2)]) == {("a", 5, 1): (5, 0), ("b", 5, 1): (4, 2)}


def test_no_links_no_roots() -> None:
    assert chain_roots([]) == {}
