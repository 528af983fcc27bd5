"""docs/architecture.md against the code: its floors table is test_layers.FLOORS, every path it names exists,
every name its recipes put in backticks is defined in the code, and its recipes' steps hold (every adapter
package is registered; every area the registry knows is declared); and every `make` target docs/ shows is
one of the Makefile's."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from conformance.adapters import ADAPTERS
from conformance.core.areas import AREAS
from conformance.core.registry import REGISTRY
from conformance.meta.test_layers import FLOORS

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PATH = re.compile(r"`((?:conformance|fixtures|reference|docs)(?:/[\w<>.-]+)*/?)`")
IDENTIFIER = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)`")   # a name, or a dotted one (`matching.judge`)
PACKAGES = ("conformance", "fixtures", "reference")


def floors_in(text: str) -> list[str]:
    """The folders of the floors table, bottom first."""
    block = text.split("<!-- floors:start -->", 1)[1].split("<!-- floors:end -->", 1)[0]
    rows = [re.match(r"\| (\d+) \| `([^`]+)` \|", line) for line in block.splitlines()]
    rows = [(int(m.group(1)), m.group(2)) for m in rows if m]
    return [folder for _, folder in sorted(rows)]


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Paths named in backticks that do not exist (a `<name>` placeholder is a pattern, not a path)."""
    return sorted({p for p in PATH.findall(text) if "<" not in p and not (root / p).exists()})


def recipes_in(text: str) -> str:
    return text.split("\n## Recipes", 1)[1].split("\n## ", 1)[0]


@functools.cache
def defined_names(root: Path = ROOT) -> frozenset[str]:
    """Every name the code defines: its modules and packages, functions and classes, and every name assigned
    (module, class and instance attributes, annotated fields)."""
    out = set()
    for path in (p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        out.update(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                out.add(node.id if isinstance(node, ast.Name) else node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
    return frozenset(out)


def is_file(name: str, root: Path = ROOT) -> bool:
    """A file at the root (`Makefile`, `requirements.lock`) or a module file in the packages (`adapter.py`)."""
    return (root / name).is_file() or any(next((root / pkg).rglob(name), None) for pkg in PACKAGES)


def missing_identifiers(text: str, names: frozenset[str], root: Path = ROOT) -> list[str]:
    """Names in backticks in the recipes that the code does not define (each part of a dotted one); a file
    is not a name."""
    return sorted({n for n in IDENTIFIER.findall(recipes_in(text))
                   if not set(n.split(".")) <= names and not is_file(n, root)})


def make_targets(makefile: str) -> set[str]:
    """The Makefile's named targets (`name:`, not a `:=` assignment)."""
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", makefile, re.M))


def make_commands(text: str) -> set[str]:
    """The targets of the `make` commands a doc shows: in backticks, or a line of a fenced code block."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    commands = re.findall(r"`(make [^`]*)`", text) + [line.strip() for block in blocks for line in block.splitlines()
                                                      if line.strip().startswith("make ")]
    return {command.split()[1] for command in commands if len(command.split()) > 1}


def missing_make_targets(docs: dict[str, str], makefile: str) -> list[str]:
    targets = make_targets(makefile)
    return sorted(f"{name}: make {target}" for name, text in docs.items() for target in make_commands(text)
                  if target not in targets)


def docs_texts() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def test_the_floors_table_is_the_layers_test():
    assert floors_in(DOC.read_text()) == list(FLOORS), "docs/architecture.md's floors table differs from FLOORS"


def test_every_path_named_exists():
    assert not missing_paths(DOC.read_text()), missing_paths(DOC.read_text())


def test_every_name_in_the_recipes_is_defined():
    missing = missing_identifiers(DOC.read_text(), defined_names())
    assert not missing, f"docs/architecture.md's recipes name what the code does not define: {missing}"


def test_every_make_target_the_docs_show_exists():
    missing = missing_make_targets(docs_texts(), (ROOT / "Makefile").read_text())
    assert not missing, f"make targets shown in docs/ that the Makefile lacks: {missing}"


def test_every_adapter_package_is_registered():
    """Recipe step 2: the adapter package and one registration line are all it takes to be found."""
    packages = {p.name for p in (ROOT / "conformance" / "adapters").iterdir() if (p / "__init__.py").exists()}
    registered = {a.__module__.split(".")[2] for a in ADAPTERS.values()}
    assert packages <= registered, f"adapter packages never registered in ADAPTERS: {sorted(packages - registered)}"


def test_every_registry_area_is_declared():
    assert {e.area for e in REGISTRY} <= set(AREAS)


def test_planted_doc_errors_are_caught(tmp_path):
    """A path that does not exist, and a floors table in another order."""
    text = DOC.read_text()
    assert missing_paths(text + "\n`conformance/core/no_such_module.py`\n") == ["conformance/core/no_such_module.py"]
    swapped = text.replace("| 2 | `conformance/core`", "| 2 | `conformance/tmp`").replace(
        "| 3 | `conformance/checkpoints`", "| 3 | `conformance/core`").replace("| 2 | `conformance/tmp`",
                                                                          "| 2 | `conformance/checkpoints`")
    assert floors_in(swapped) != list(FLOORS)


def test_planted_names_and_make_targets_are_caught():
    """A recipe naming a base class the code lacks, and a doc showing a make target the Makefile lacks (in
    backticks and in a code block); a file at the root and a name outside the recipes are not names."""
    text = DOC.read_text()
    recipe = "\n### A new server"
    planted = text.replace(recipe, recipe + "\n\nDerive `NoSuchAdapterBase` in `adapter.py`, read `matching.no_such`; "
                                            "pin `pytest.ini`.\n", 1)
    assert missing_identifiers(planted, defined_names()) == ["NoSuchAdapterBase", "matching.no_such"]
    assert missing_identifiers(text + "\n`NoSuchName` after the recipes\n", defined_names()) == []
    makefile = (ROOT / "Makefile").read_text()
    docs = {"planted.md": "run `make no-such-target`\n```\nmake another-missing X=1\nmake check\n```\n"}
    assert missing_make_targets(docs, makefile) == ["planted.md: make another-missing",
                                                    "planted.md: make no-such-target"]
