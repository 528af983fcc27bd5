"""The floors of the code point only down: no library module imports a folder above its own, and nothing
imports in a circle, between folders or between modules.

FLOORS is the layout, bottom first (docs/architecture.md draws it). A folder is a top-level package
(`reference`, `fixtures`) or an area under `conformance/`; its sub-packages belong to it
(`conformance/adapters/sglang` is `conformance/adapters`). Test modules (`test_*.py`, `conftest.py`) and
the harness's self-tests (`conformance/meta/`) sit above everything and may import any floor; nothing
imports them. Every import in a library module counts, also one inside a function or under
TYPE_CHECKING: a lazy import up a floor is still a dependency the wrong way.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reference", "fixtures", "conformance")
FLOORS = (   # bottom first; each floor imports only the floors before it
    "reference",                 # the arbiter: EAGLE-3 as training means it, read top to bottom
    "conformance/core",          # Trace, stages, tolerances, registry and matching, compare, findings, sections
    "conformance/checkpoints",   # every on-disk format read and written, one tensor schema
    "fixtures",                  # generated test material: tiny configs and weights, cases, targets, real configs
    "conformance/loading",       # weight accounting: what the adapters fill while their loader runs
    "conformance/adapters",      # one adapter per implementation behind one Protocol
    "conformance/draft",         # the check areas, each over the adapters ...
    "conformance/wiring",
    "conformance/settings",
    "conformance/acceptance",
    "conformance/engine",
    "conformance/throughput",
    "conformance/versions",
    "conformance/session",       # the stores, the runner, the report and its rendering, the support matrix
    "conformance/user",          # the user's draft: its checks and the verdict
    "conformance",               # the pytest plugin and the command line
)


def folder_of(parts: tuple[str, ...]) -> str:
    """The folder a module (path parts under the root) belongs to."""
    if parts[0] != "conformance":
        return parts[0]
    return "conformance/" + parts[1] if len(parts) > 2 else "conformance"


def is_library(rel: Path) -> bool:
    return (rel.parts[0] in PACKAGES and not rel.name.startswith("test_") and rel.name != "conftest.py"
            and rel.parts[:2] != ("conformance", "meta"))


def module_file(root: Path, module: str) -> Path | None:
    path = root.joinpath(*module.split("."))
    if path.is_dir():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def imports(root: Path, rel: Path) -> list[tuple[int, Path]]:
    """(line, imported module file) for every import of a project module in `rel` (names imported from a
    package that are modules count as those modules)."""
    out = []
    for node in ast.walk(ast.parse((root / rel).read_text(), str(rel))):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*rel.parts[:len(rel.parts) - node.level], *([node.module] if node.module else [])])
            modules = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for module in modules:
            found = module_file(root, module) if module.split(".")[0] in PACKAGES else None
            if found is not None and found != root / rel:
                out.append((node.lineno, found.relative_to(root)))
    return out


def library_graph(root: Path) -> dict[Path, list[tuple[int, Path]]]:
    modules = sorted(p.relative_to(root) for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))
    return {rel: imports(root, rel) for rel in modules if is_library(rel)}


def floor_problems(graph: dict[Path, list[tuple[int, Path]]], floors: tuple[str, ...] = FLOORS) -> list[str]:
    """Each import that runs up a floor, and each folder that is on no floor."""
    problems = [f"folder {folder} is on no floor (place it in FLOORS)"
                for folder in sorted({folder_of(rel.parts) for rel in graph} - set(floors))]
    for rel, edges in graph.items():
        src = folder_of(rel.parts)
        if src not in floors:
            continue
        for line, target in edges:
            dst = folder_of(target.parts)
            if dst != src and (dst not in floors or floors.index(dst) > floors.index(src)):
                problems.append(f"{rel}:{line} imports {target} ({src} -> {dst}: up a floor)")
    return problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def folder_edges(graph) -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for rel, edges in graph.items():
        for _, target in edges:
            if folder_of(target.parts) != folder_of(rel.parts):
                out[folder_of(rel.parts)].add(folder_of(target.parts))
    return out


def module_edges(graph) -> dict[str, set[str]]:
    # A module importing its own package's __init__ (to reach a sibling) is not a circle of modules.
    return {str(rel): {str(t) for _, t in edges if not (t.name == "__init__.py" and rel.is_relative_to(t.parent))}
            for rel, edges in graph.items()}


@pytest.fixture(scope="module")
def graph():
    return library_graph(ROOT)


def test_no_import_runs_up_a_floor(graph):
    problems = floor_problems(graph)
    assert not problems, "imports up a floor (docs/architecture.md, FLOORS):\n" + "\n".join(problems)


def test_no_circle_between_folders(graph):
    found = cycles(folder_edges(graph))
    assert not found, "folders importing each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_circle_between_modules(graph):
    found = cycles(module_edges(graph))
    assert not found, "modules importing each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_floor_exists_and_holds_library_code(graph):
    folders = {folder_of(rel.parts) for rel in graph}
    assert set(FLOORS) == folders, f"floors without code: {set(FLOORS) - folders}; folders: {folders - set(FLOORS)}"


# ---------------------------------------------------------------- planted

def write_tree(root: Path, files: dict[str, str]) -> dict[Path, list[tuple[int, Path]]]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for pkg in PACKAGES:
        (root / pkg).mkdir(exist_ok=True)
        for d in [root / pkg, *(p for p in (root / pkg).rglob("*") if p.is_dir())]:
            (d / "__init__.py").touch()
    return library_graph(root)


def test_planted_up_import_is_named(tmp_path):
    """The ground floor importing the session layer, once at module level and once lazily in a function."""
    graph = write_tree(tmp_path, {
        "conformance/core/compare.py": "from conformance.session.report import Report\n",
        "conformance/core/registry.py": "def f():\n    from conformance.adapters import ADAPTERS\n",
        "conformance/session/report.py": "from conformance.core import compare\n",
        "conformance/adapters/base.py": "from conformance.core.registry import f\n",
        "conformance/meta/test_x.py": "from conformance.session.report import Report\n",   # tests may import up
    })
    problems = floor_problems(graph)
    assert problems == [
        "conformance/core/compare.py:1 imports conformance/session/report.py (conformance/core -> conformance/session:"
        " up a floor)",
        "conformance/core/registry.py:2 imports conformance/adapters/__init__.py (conformance/core -> "
        "conformance/adapters: up a floor)"], problems


def test_planted_circles_are_named(tmp_path):
    """Two folders importing each other, and two modules of one folder importing each other under TYPE_CHECKING."""
    graph = write_tree(tmp_path, {
        "conformance/user/store.py": "from conformance.user.user_draft import x\n",
        "conformance/user/user_draft.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                          "    from conformance.user.store import y\n",
        "conformance/wiring/a.py": "from conformance.settings.b import z\n",
        "conformance/settings/b.py": "def g():\n    import conformance.wiring.a\n",
    })
    assert cycles(folder_edges(graph)) == [["conformance/settings", "conformance/wiring"]]
    assert cycles(module_edges(graph)) == [["conformance/settings/b.py", "conformance/wiring/a.py"],
                                           ["conformance/user/store.py", "conformance/user/user_draft.py"]]
    # Of the two folders' imports, the one up a floor is named; the other points down.
    assert floor_problems(graph) == ["conformance/wiring/a.py:1 imports conformance/settings/b.py (conformance/wiring"
                                     " -> conformance/settings: up a floor)"]


def test_a_folder_on_no_floor_is_named(tmp_path):
    graph = write_tree(tmp_path, {"conformance/newarea/check.py": "from conformance.core import stages\n",
                                  "conformance/core/stages.py": ""})
    assert floor_problems(graph) == ["folder conformance/newarea is on no floor (place it in FLOORS)"]
