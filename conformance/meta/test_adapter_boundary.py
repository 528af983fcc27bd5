"""Only the adapter knows its implementation: no module outside conformance/adapters/ branches on an
adapter's name or keeps a table keyed by it (what an implementation needs lives on its adapter, so a
new implementation is one adapter file plus its registration line).

The modules' syntax trees are scanned for an adapter name as a string literal in a comparison
(`impl == "sglang"`, `name in ("reference", ...)`) or as a key (of a dict, or the first element of
the pairs of a table). Checkpoint *format*
identifiers (and trainer names) share two of those strings; they are told apart by what they are
compared with or assigned to, whose name says it holds a format or a trainer (FORMAT_CONTEXT). Test
modules and the registry data may name implementations; they are not scanned.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conformance.adapters import ADAPTERS

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("conformance", "fixtures", "reference")
ADAPTERS_DIR = ROOT / "conformance" / "adapters"
# A name that holds checkpoint formats (or trainers, the frameworks that wrote a checkpoint) or data
# keyed by them: fmt, format(s), checkpoint dirs, config writers, trainer.
FORMAT_CONTEXT = re.compile(r"fmt|format|checkpoint|dirs\b|writers|trainer", re.IGNORECASE)


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [value for element in node.elts for value in _literals(element)]
    return []


def name_branches(source: str, names: frozenset[str]) -> list[tuple[int, str]]:
    """(line, what) for every adapter name in a comparison or as a dict key, formats excepted."""
    tree = ast.parse(source)
    in_class = {id(node): cls.name for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for node in ast.walk(cls)}
    assigned_to = {id(node.value): " ".join(map(ast.unparse, node.targets if isinstance(node, ast.Assign)
                                                else [node.target]))
                   for node in ast.walk(tree)
                   if isinstance(node, (ast.Assign, ast.AnnAssign))
                   and isinstance(node.value, (ast.Dict, ast.Tuple, ast.List))}

    def operand(node: ast.AST) -> str:
        """An operand as written; `self.x` as `Class.x` (a Trainer's self.name is a trainer's name)."""
        text = ast.unparse(node)
        return in_class.get(id(node), "self") + text[4:] if text.startswith("self.") else text

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for left, right in zip(operands, operands[1:]):
                for side, other in ((left, right), (right, left)):
                    hits = sorted(set(_literals(side)) & names)
                    if hits and not FORMAT_CONTEXT.search(operand(other)):
                        found.append((node.lineno, f"{ast.unparse(node)}: compares {ast.unparse(other)} with {hits}"))
        elif isinstance(node, (ast.Dict, ast.Tuple, ast.List)):
            # A dict, or a table of pairs ((name, value), ...), keyed by adapter names.
            keys = node.keys if isinstance(node, ast.Dict) else \
                [e.elts[0] for e in node.elts if isinstance(e, (ast.Tuple, ast.List)) and e.elts]
            hits = [k.value for k in keys if isinstance(k, ast.Constant) and k.value in names]
            target = assigned_to.get(id(node), "")
            if hits and not FORMAT_CONTEXT.search(target):
                kind = "dict" if isinstance(node, ast.Dict) else "table"
                found.append((node.lineno, f"{kind} keyed by {hits}" + (f" ({target})" if target else "")))
    return sorted(found)


def scanned_modules() -> list[Path]:
    paths = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))] + sorted(ROOT.glob("*.py"))
    return [p for p in paths if ADAPTERS_DIR not in p.parents and not p.name.startswith("test_")]


def leaks(paths: list[Path], root: Path) -> list[str]:
    """`file:line: what` for every name branch or name-keyed table in `paths`."""
    names = frozenset(ADAPTERS)
    return [f"{path.relative_to(root)}:{line}: {what}"
            for path in paths for line, what in name_branches(path.read_text(), names)]


def test_no_module_outside_the_adapters_branches_on_an_implementation():
    found = leaks(scanned_modules(), ROOT)
    assert not found, ("implementation knowledge outside conformance/adapters/ (move it onto the adapter):\n  "
                       + "\n  ".join(found))


def test_the_scan_finds_a_planted_branch_and_table(tmp_path):
    """Plants each kind of leak in a module of its own; format identifiers stay allowed."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        'def pick(impl, fmt, case):\n'
        '    if impl == "sglang":\n'                           # 2: a branch on a name
        '        return 1\n'
        '    if case.impl in ("reference", "other"):\n'         # 4: an `in` tuple
        '        return 2\n'
        '    if fmt == "sglang":\n'                             # a checkpoint format: allowed
        '        return 3\n'
        '    return 4\n'
        'GROUP = {"speculators": 8}\n'                          # 9: a table keyed by name
        'CONFIG_WRITERS = {"speculators": None}\n'              # keyed by format: allowed
        'lookup = {"x": 1, "speculators": 2}[name]\n'          # 11: an unassigned name-keyed table
        'PAIRS = (("reference", "speculators"), ("sglang", "sglang"))\n'   # 12: a table of pairs
        'FORMAT_PAIRS = (("sglang", "x"),)\n')                 # pairs keyed by format: allowed
    found = leaks([planted], tmp_path)
    assert [line.split(":")[1] for line in found] == ["2", "4", "9", "11", "12"], found
    assert "compares impl with ['sglang']" in found[0] and "compares case.impl with ['reference']" in found[1]
    assert "dict keyed by ['speculators'] (GROUP)" in found[2], found
