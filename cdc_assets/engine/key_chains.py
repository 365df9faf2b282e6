"""Chains of primary-key changes within one stream batch, for unchanged TOAST values (``cdc_assets.lake.mirror``).

Contract: ``chain_roots(links)``. A link ``(column, pp, ps, to_pp, to_ps)`` says that the key change at position
``(pp, ps)`` (``_cdc_position``, ``_cdc_seq``) found, for that column, no value on its old key since an earlier key
change at ``(to_pp, to_ps)`` brought the row there: its value is that earlier key change's. The result maps every
linked key change to the first key change of its chain (per column): the one whose old key had a value of its own
or none at all. Links always point back in commit order, so every chain ends; a chain of any length resolves in one
pass over the links (each key change is visited once).
"""

from __future__ import annotations

from collections.abc import Iterable

Position = tuple[int, int]


def chain_roots(links: Iterable[tuple[str, int, int, int, int]]) -> dict[tuple[str, int, int], Position]:
    step = {(name, pp, ps): (to_pp, to_ps) for name, pp, ps, to_pp, to_ps in links}
    roots: dict[tuple[str, int, int], Position] = {}
    for start in step:
        name = start[0]
        path = [start]
        target = step[start]
        while (name, *target) in step and (name, *target) not in roots:
            path.append((name, *target))
            target = step[(name, *target)]
        target = roots.get((name, *target), target)
        for item in path:
            roots[item] = target
    return roots
