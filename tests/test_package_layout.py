"""The package layout (docs/layout.md): the generic packages import no database driver and no source package, and
no module of ``cdc_assets`` imports another in a circle. Read from the source text (every ``import`` statement,
also inside functions and ``if TYPE_CHECKING:``), so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cdc_assets"
SOURCES = "cdc_assets.sources"
FORBIDDEN_IN_GENERIC = ("psycopg", "pymongo", SOURCES)
# the Dagster glue and the command line open a source through the registry (``cdc_assets.sources.open_source``),
# nothing below it
REGISTRY_USERS = {"cdc_assets.build": {SOURCES}, "cdc_assets.cli": {SOURCES}}


def generic(name: str) -> bool:
    """Every module of ``cdc_assets`` outside ``cdc_assets/sources/``: the engine, the lake, the generic pipeline
    and dialect interface, the Dagster glue."""
    return name != SOURCES and not name.startswith(SOURCES + ".")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported_names(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports: ``from a.b import c`` names ``a.b.c`` when that is a module, else ``a.b``;
    relative imports resolved against ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    names = set(known)
    return {name: {m for m in imported_names(path, name, names) if m in names} for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_cdc_assets_imports_another_in_a_circle() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_circle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_generic_packages_import_no_driver_and_no_source_package() -> None:
    offending = {}
    for name, path in modules().items():
        if not generic(name):
            continue
        text_imports = imported_names(path, name, set()) - REGISTRY_USERS.get(name, set())
        bad = sorted(m for m in text_imports if m.startswith(FORBIDDEN_IN_GENERIC))
        if bad:
            offending[name] = bad
    assert offending == {}


def test_the_generic_modules_are_the_whole_package_but_the_sources() -> None:
    names = set(modules())
    assert {"cdc_assets.pipeline", "cdc_assets.dialect", "cdc_assets.assets", "cdc_assets.offsets",
            "cdc_assets.lake.mirror", "cdc_assets.engine.windows"} <= {n for n in names if generic(n)}  # fmt: skip
    assert not any(generic(n) for n in names if n.startswith("cdc_assets.sources.postgres"))


def test_the_source_packages_are_where_the_drivers_are() -> None:
    """The check above reads real imports: the PostgreSQL package does import its driver."""
    known = modules()
    catalog = "cdc_assets.sources.postgres.catalog"
    assert any(m.startswith("psycopg") for m in imported_names(known[catalog], catalog, set()))
