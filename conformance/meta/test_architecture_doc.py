"""docs/architecture.md against the code: its floors table is test_layers.FLOORS, every path it names exists,
and its recipes' steps hold (every adapter package is registered; every area the registry knows is declared)."""
from __future__ import annotations

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


def floors_in(text: str) -> list[str]:
    """The folders of the floors table, bottom first."""
    block = text.split("<!-- floors:start -->", 1)[1].split("<!-- floors:end -->", 1)[0]
    rows = [re.match(r"\| (\d+) \| `([^`]+)` \|", line) for line in block.splitlines()]
    rows = [(int(m.group(1)), m.group(2)) for m in rows if m]
    return [folder for _, folder in sorted(rows)]


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """Paths named in backticks that do not exist (a `<name>` placeholder is a pattern, not a path)."""
    return sorted({p for p in PATH.findall(text) if "<" not in p and not (root / p).exists()})


def test_the_floors_table_is_the_layers_test():
    assert floors_in(DOC.read_text()) == list(FLOORS), "docs/architecture.md's floors table differs from FLOORS"


def test_every_path_named_exists():
    assert not missing_paths(DOC.read_text()), missing_paths(DOC.read_text())


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
