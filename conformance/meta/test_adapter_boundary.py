"""Only the adapter knows its implementation: no module outside conformance/adapters/ branches on an
adapter's name, keeps a table keyed by it or imports an adapter's internals (what an implementation needs
lives on its adapter, so a new implementation is its adapter package plus its registration line).

The modules' syntax trees are scanned for an adapter name as a string literal in a comparison
(`impl == "sglang"`, `name in ("reference", ...)`), as a key (of a dict, the first element of a tuple
key `("vllm", 1, 1024)`, or the first element of the pairs of a table), as a subscript
(`ADAPTERS["sglang"]`) or as a call argument (`applicable("wiring", "sglang", names)`); and for an import
of an adapter's internals (`conformance.adapters.<impl>...`: what an area needs of an implementation is
reached through its adapter; `conformance.adapters` itself and `conformance.adapters.base` are the way in).
Checkpoint *format* identifiers (and trainer names) share two of those strings; they are told apart by
what they are compared with, assigned to or subscript, or for a call argument by the callee, the option it
declares or the parameter it binds (a keyword, or the positional parameter of the project's definition of
the callee), whose name says it holds a format or a trainer (FORMAT_CONTEXT). Test modules and the
registry data may name implementations; they are not scanned.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
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


def _key_name(node: ast.AST, names: frozenset[str]) -> str | None:
    """The adapter name a key is, or begins with (a tuple key's first element)."""
    if isinstance(node, ast.Tuple) and node.elts:
        node = node.elts[0]
    return node.value if isinstance(node, ast.Constant) and node.value in names else None


def adapter_internals(node: ast.AST, packages: frozenset[str]) -> list[str]:
    """The adapter-internal modules an import names: conformance.adapters.<impl>[...] (base excepted)."""
    prefix = "conformance.adapters"
    if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
        base = node.module or ""
        modules = [base] + ([f"{base}.{a.name}" for a in node.names] if base == prefix else [])
    else:
        return []
    return [m for m in modules if m.startswith(prefix + ".") and m.split(".")[2] in packages]


Parameters = dict[str, dict[int, set[str]]]


def positional_parameters(trees: list[ast.AST]) -> Parameters:
    """Per name of a function or class defined in `trees`, the names of its positional parameters, by position,
    over every definition of that name: a method's without self/cls; a class's those of its __init__, or else
    its dataclass fields (what a positional argument binds to, so that its name can say it holds a format)."""
    out: Parameters = defaultdict(lambda: defaultdict(set))
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = [a.arg for a in node.args.posonlyargs + node.args.args]
                fields = args[1:] if args[:1] in (["self"], ["cls"]) else args
            elif isinstance(node, ast.ClassDef):
                init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
                fields = [a.arg for a in init.args.args[1:]] if init else [
                    n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                    and "ClassVar" not in ast.unparse(n.annotation)]
            else:
                continue
            for i, field in enumerate(fields):
                out[node.name][i].add(field)
    return out


def call_contexts(call: ast.Call, parameters: Parameters) -> list[tuple[str, ast.AST]]:
    """(context, argument) per argument of `call`: the callee, the option it declares (a leading "--name"), and
    the parameter the argument binds (its keyword, or the positional parameter of the callee's definitions)."""
    callee = ast.unparse(call.func)
    declares = [a.value for a in call.args[:1] if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
    defined = parameters.get(callee.rsplit(".", 1)[-1], {})
    return ([(" ".join([callee, *declares, *sorted(defined.get(i, ()))]), a) for i, a in enumerate(call.args)]
            + [(" ".join([callee, *declares, k.arg or ""]), k.value) for k in call.keywords])


def name_branches(source: str, names: frozenset[str], packages: frozenset[str] = frozenset(),
                  parameters: Parameters | None = None) -> list[tuple[int, str]]:
    """(line, what) for every adapter name in a comparison, as a key, subscript or call argument, formats
    excepted; and every import of an adapter's internals (`packages`: the modules under conformance/adapters/
    other than base). `parameters`: the callables' positional parameters (default: this source's own)."""
    tree = ast.parse(source)
    parameters = positional_parameters([tree]) if parameters is None else parameters
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
            # A dict keyed by adapter names (or tuples led by one), or a table of pairs ((name, value), ...).
            keys = node.keys if isinstance(node, ast.Dict) else \
                [e.elts[0] for e in node.elts if isinstance(e, (ast.Tuple, ast.List)) and e.elts]
            hits = [hit for k in keys if k is not None and (hit := _key_name(k, names))]
            target = assigned_to.get(id(node), "")
            if hits and not FORMAT_CONTEXT.search(target):
                kind = "dict" if isinstance(node, ast.Dict) else "table"
                found.append((node.lineno, f"{kind} keyed by {hits}" + (f" ({target})" if target else "")))
        elif isinstance(node, ast.Subscript):
            hit = _key_name(node.slice, names)
            if hit and not FORMAT_CONTEXT.search(operand(node.value)):
                found.append((node.lineno, f"{ast.unparse(node)}: subscripts {operand(node.value)} by {hit!r}"))
        elif isinstance(node, ast.Call):
            for context, arg in call_contexts(node, parameters):
                hits = sorted(set(_literals(arg)) & names)
                if hits and not FORMAT_CONTEXT.search(context):
                    found.append((node.lineno, f"{ast.unparse(node)}: passes {hits} to {ast.unparse(node.func)}"))
        else:
            for module in adapter_internals(node, packages):
                found.append((node.lineno, f"imports {module} (an adapter's internals: reach them through it)"))
    return sorted(found)


def scanned_modules() -> list[Path]:
    paths = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))] + sorted(ROOT.glob("*.py"))
    return [p for p in paths if ADAPTERS_DIR not in p.parents and not p.name.startswith("test_")]


def adapter_packages() -> frozenset[str]:
    """The modules under conformance/adapters/ that are one adapter's (everything but the way in, base)."""
    return frozenset(p.stem for p in ADAPTERS_DIR.iterdir() if p.stem not in ("__init__", "base", "__pycache__")
                     and (p.suffix == ".py" or (p / "__init__.py").exists()))


def leaks(paths: list[Path], root: Path) -> list[str]:
    """`file:line: what` for every name branch, name-keyed table, name index or argument, or import of an
    adapter's internals in `paths`."""
    names, packages = frozenset(ADAPTERS), adapter_packages()
    defined = sorted({*(p for d in SCANNED for p in (ROOT / d).rglob("*.py")), *paths})
    parameters = positional_parameters([ast.parse(p.read_text()) for p in defined])
    return [f"{path.relative_to(root)}:{line}: {what}"
            for path in paths for line, what in name_branches(path.read_text(), names, packages, parameters)]


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


def test_the_scan_finds_a_planted_index_argument_tuple_key_and_import(tmp_path):
    """Plants each kind the scan learned: a name as an index, as a call argument (positional or keyword),
    as the first element of a tuple key, and imports of an adapter's internals; a format passed where the
    parameter or the option says it holds one, and the way into the adapters, stay allowed."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        'from conformance.adapters import ADAPTERS, base\n'                      # the way in: allowed
        'from conformance.adapters.base import AdapterBase\n'                   # allowed
        'from conformance.adapters.sglang.target import AuxIds\n'               # 3: internals
        'import conformance.adapters.vllm.process\n'                            # 4: internals
        'from conformance.adapters import speculators\n'                        # 5: a package of one adapter
        'def write(cfg, out, fmt):\n'
        '    return fmt\n'
        'server = ADAPTERS["sglang"]\n'                                         # 8: an index
        'entries = applicable("wiring", "sglang", {})\n'                        # 9: a positional argument
        'problem = Problem("x", impl="vllm")\n'                                 # 10: a keyword argument
        'FAILS = {("vllm", 1, 1024): "no compile"}\n'                           # 11: a tuple key
        'written = write(None, "out", "sglang")\n'                              # a format parameter: allowed
        'dirs = {}\n'
        'served = dirs["sglang"]\n'                                             # indexed by format: allowed
        'parser.add_argument("--format", default="specforge")\n')               # a format option: allowed
    found = leaks([planted], tmp_path)
    assert [line.split(":")[1] for line in found] == ["3", "4", "5", "8", "9", "10", "11"], found
    assert "imports conformance.adapters.sglang.target" in found[0] and "conformance.adapters.speculators" in found[2]
    assert "subscripts ADAPTERS by 'sglang'" in found[3], found
    assert "passes ['sglang'] to applicable" in found[4] and "passes ['vllm'] to Problem" in found[5], found
    assert "dict keyed by ['vllm'] (FAILS)" in found[6], found
