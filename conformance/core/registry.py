"""The one registry of known behaviour (registry.toml): reading, validating, and which entries apply.

An entry holds for an implementation when the installed version is in its `versions` range and its
`when` condition is true of the names its area defines (areas.py: draft knobs, server flags, tree shape,
target wiring facts, server settings). The condition language is a small, safe subset of Python
expressions (names, constants, tuples, comparisons, in, and/or/not, + - *), checked when the file is read.

An entry names the exact place and the observed signature of what it knows (AREAS); the matchers in
matching.py return an entry only when an observation equals them, so a different failure is never hidden.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import NoReturn, Protocol

from packaging.specifiers import SpecifierSet

from conformance.core.areas import AREAS, KNOBS, SERVER_FLAGS
from reference.eagle3 import Eagle3Config

REGISTRY_FILE = Path(__file__).with_name("registry.toml")
COMMON = ("area", "id", "impl", "versions", "when", "reason")
ALLOWED_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.BinOp, ast.Add,
                 ast.Sub, ast.Mult, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In,
                 ast.NotIn, ast.Tuple, ast.Name, ast.Load, ast.Constant)


class RegistryError(ValueError):
    """A malformed registry entry; the message (one line) names the file, the entry and the field."""


@dataclass(frozen=True)
class Known:
    area: str
    id: str
    impl: str              # adapter name
    versions: str          # PEP 440 specifier for the implementation's package
    when: str              # condition over the area's names
    reason: str            # why, with file:line
    step: int | None = None
    stage: str | None = None
    error: str | None = None
    message: str | None = None
    kind: str | None = None
    problem: str | None = None
    tensors: tuple[str, ...] = ()
    setting: str | None = None
    shown_by: str | None = None
    key: str | None = None         # reading: the config key
    reads: str | None = None       # reading: what the implementation takes it to mean
    fix: str | None = None         # reading: the key to write so that every implementation reads it alike
    source: str | None = None      # reading: "observed" (default) or "read from code"
    asserted: bool = False     # settings: known from its condition alone, not observed (areas.ASSERTED)
    round: int | None = None   # engine: the served round of the first divergence
    rows: str | None = None    # engine: the rows of that pass that differ (areas.ROW_SIGNATURES)
    neutral: tuple[tuple[str, str], ...] = ()   # (knob or server flag, expression over the names), sorted
    neutral_weights: tuple[str, ...] = ()       # stored tensor names (regexes, searched) set to ones instead

    @property
    def place(self) -> str:
        return AREAS[self.area].place(self)

    def describe(self) -> str:
        return f"{self.impl} {self.versions} when {self.when}: {self.place} ({self.id}). {self.reason}"

    def condition_holds(self, names: Mapping[str, object]) -> bool:
        return bool(eval(_compiled(self.when, self.area), {"__builtins__": {}}, dict(names)))  # validated

    def version_holds(self) -> bool:
        # An implementation that is not installed has no known behaviour: its tests then fail on the
        # import, which names the missing package, instead of passing as expected failures.
        version = installed_version(self.impl, AREAS[self.area].engine)
        return version is not None and version in SpecifierSet(self.versions)

    def applies(self, names: Mapping[str, object]) -> bool:
        return self.version_holds() and self.condition_holds(names)


@cache
def _compiled(condition: str, area: str):
    tree = ast.parse(condition, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED_NODES):
            raise RegistryError(f"condition {condition!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Name) and node.id not in AREAS[area].names and node.id != "None":
            raise RegistryError(f"condition {condition!r}: unknown name {node.id!r} for area {area!r}")
    return compile(tree, "<registry.toml>", "eval")


# The implementations under test, each with how it reads its installed version (None: not installed). The adapters
# give them (conformance/adapters/__init__.py calls use_implementations), so this ground floor imports no adapter.
_IMPLEMENTATIONS: dict[str, Callable[[], str | None]] = {}
# The version of each implementation's serving engine, where it is not the implementation's own (areas.Area.engine).
_ENGINES: dict[str, Callable[[], str | None]] = {}


def use_implementations(versions: Mapping[str, Callable[[], str | None]],
                        engines: Mapping[str, Callable[[], str | None]] | None = None) -> None:
    """Name the implementations under test (the reference, which has no package and no entries, is left out), and
    the version readers of the serving engines that run another build than the implementation's own (`engines`),
    and check every entry's `impl` against them: RegistryError naming the entry and the field."""
    _IMPLEMENTATIONS.clear()
    _IMPLEMENTATIONS.update(versions)
    _ENGINES.clear()
    _ENGINES.update(engines or {})
    installed_version.cache_clear()
    for n, entry in enumerate(REGISTRY, 1):
        _check_impl(entry.impl, f"{REGISTRY_FILE.name}: entry #{n} ({entry.id})")


def _check_impl(impl: str, where: str) -> None:
    if impl not in _IMPLEMENTATIONS:
        raise RegistryError(f"{where}: field 'impl': {impl!r} is not an implementation under test")


@cache
def installed_version(impl: str, engine: bool = False) -> str | None:
    """`impl`'s installed version; `engine`: the version its serving engine runs (its own build, where it has one)."""
    if not _IMPLEMENTATIONS:   # a caller that never imported conformance.adapters: no entry could hold, loudly
        raise RegistryError("registry: no implementations given (import conformance.adapters first)")
    if engine and impl in _ENGINES:
        return _ENGINES[impl]()
    return _IMPLEMENTATIONS[impl]() if impl in _IMPLEMENTATIONS else None


# ---------------------------------------------------------------- reading and validating

def _check(item: dict, area: str, where: str) -> None:
    def bad(field: str, why: str) -> NoReturn:
        raise RegistryError(f"{where}: field '{field}': {why}")

    declared = AREAS[area]
    if problem := declared.validate(item):   # the area's own fields: a step, a stage, a kind, a problem ...
        bad(*problem)
    for field in COMMON + declared.signature + declared.optional:
        value = item.get(field)
        if field == "neutral" and field in item:
            _check_neutral(value, item["when"], area, bad)
        elif field == "neutral_weights" and field in item and not (
                isinstance(value, list) and value and all(isinstance(t, str) for t in value) and "neutral" not in item):
            bad(field, f"{value!r} is not a non-empty list of tensor-name patterns (and not beside 'neutral')")
        elif field not in ("step", "round", "tensors", "neutral", "neutral_weights", "asserted") and \
                field in item and not isinstance(value, str):
            bad(field, f"{value!r} is not a string")
    if _IMPLEMENTATIONS:   # the registry read at import is checked when the adapters name them (use_implementations)
        _check_impl(item["impl"], where)
    try:
        SpecifierSet(item["versions"])
    except Exception as exc:
        bad("versions", str(exc))
    try:
        _compiled(item["when"], area)
    except (SyntaxError, RegistryError) as exc:
        bad("when", str(exc).splitlines()[0])
    for field, patterns in (("message", [item.get("message")]), ("tensors", item.get("tensors", [])),
                            ("neutral_weights", item.get("neutral_weights", []))):
        for pattern in filter(None, patterns):
            try:
                re.compile(pattern)
            except re.error as exc:
                bad(field, f"{pattern!r} is not a regex: {exc}")


def _check_neutral(value, when: str, area: str, bad) -> None:
    """A neutral is a non-empty table of knobs / server flags to expressions; one of them must be read by `when`."""
    if not (isinstance(value, dict) and value):
        bad("neutral", f"{value!r} is not a table of knob = \"expression\"")
    for name, expr in value.items():
        if name not in AREAS[area].names or not isinstance(expr, str):
            bad("neutral", f"{name} = {expr!r}: not a {area} knob or server flag set to an expression string")
        try:
            _compiled(expr, area)
        except (SyntaxError, RegistryError) as exc:
            bad("neutral", f"{name} = {expr!r}: {str(exc).splitlines()[0]}")
    read = {n.id for n in ast.walk(ast.parse(when, mode="eval")) if isinstance(n, ast.Name)}
    if not read & set(value):
        bad("neutral", f"sets {sorted(value)}, none of which its condition reads, so it cannot make it false")


def load_registry(path: Path = REGISTRY_FILE) -> tuple[Known, ...]:
    """Read and validate the registry; a problem raises RegistryError naming the file, entry and field."""
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{path.name}: not valid TOML: {exc}") from None
    if set(raw) - {"known"}:
        raise RegistryError(f"{path.name}: unknown tables {sorted(set(raw) - {'known'})} (entries are [[known]])")
    entries = []
    for n, item in enumerate(raw.get("known", []), 1):
        where = f"{path.name}: entry #{n} ({item.get('id', 'no id')})"
        area = item.get("area")
        if area not in AREAS:
            raise RegistryError(f"{where}: field 'area': {area!r} is not one of {list(AREAS)}")
        fields = COMMON + AREAS[area].signature
        missing = [f for f in fields if f not in item]
        extra = sorted(set(item) - set(fields) - set(AREAS[area].optional))
        if missing or extra:
            raise RegistryError(f"{where}: missing fields {missing}, unknown fields {extra} for area {area!r}")
        _check(item, area, where)
        entries.append(Known(**{**item, "tensors": tuple(item.get("tensors", ())),
                                "neutral": tuple(sorted(item.get("neutral", {}).items())),
                                "neutral_weights": tuple(item.get("neutral_weights", ()))}))
    ids = [e.id for e in entries]
    if len(ids) != len(set(ids)):
        raise RegistryError(f"{path.name}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
    for n, e in enumerate(entries, 1):
        if e.shown_by is not None and e.shown_by not in ids:
            raise RegistryError(f"{path.name}: entry #{n} ({e.id}): field 'shown_by': no entry {e.shown_by!r}")
    return tuple(entries)


REGISTRY: tuple[Known, ...] = load_registry()


class DraftCase(Protocol):
    """What the registry reads of a draft case (fixtures/cases.py DraftCase): its knobs and server flags."""

    id: str
    overrides: tuple[tuple[str, object], ...]
    sglang_args: tuple[tuple[str, object], ...]

    @property
    def config(self) -> Eagle3Config: ...


# ---------------------------------------------------------------- which entries apply

def case_names(case: DraftCase) -> dict[str, object]:
    """The names a draft / load / accounting condition reads: the case's knobs and server flags."""
    return {**dataclasses.asdict(case.config), **{flag: None for flag in SERVER_FLAGS}, **dict(case.sglang_args)}


def applicable(areas: str | Iterable[str], impl: str, names: Mapping[str, object],
               registry: Sequence[Known] | None = None) -> tuple[Known, ...]:
    """The entries of `areas` for `impl` whose version range and condition hold, in file order
    (`registry`: REGISTRY, read at call time so that a self-test can plant entries)."""
    areas = {areas} if isinstance(areas, str) else set(areas)
    return tuple(e for e in (REGISTRY if registry is None else registry)
                 if e.area in areas and e.impl == impl and e.applies(names))


def for_case(impl: str, case: DraftCase, steps: int | None = None,
             registry: Sequence[Known] | None = None) -> tuple[Known, ...]:
    """The load entries and the draft entries within the compared `steps` (None: all) that apply."""
    known = applicable(("load", "draft"), impl, case_names(case), registry)
    return tuple(e for e in known if e.area == "load" or steps is None or e.step < steps)


def for_accounting(impl: str, case: DraftCase, registry: Sequence[Known] | None = None) -> tuple[Known, ...]:
    """The accounting entries and the load entries (a refusal is a load failure) that apply."""
    return applicable(("accounting", "load"), impl, case_names(case), registry)



@dataclass(frozen=True)
class Neutralised:
    case: DraftCase                  # the case with the `neutral` knobs of its entries applied
    entries: tuple[Known, ...]       # the entries neutralised, in the order applied
    unit_weights: tuple[str, ...]    # the `neutral_weights` patterns: tensors to set to ones in its checkpoints


def neutralised(case: DraftCase, impls: Sequence[str], registry: Sequence[Known] | None = None) -> Neutralised:
    """`case` with each load / draft entry of `impls` that applies to it neutralised, one at a time until none is
    left: by its `neutral` knobs, which must make its condition false, or by its `neutral_weights` (the knobs
    stay; the store sets those tensors to ones, where the registered behaviour has no effect). No implementation
    has registered behaviour left on the result: every stage must conform. RegistryError naming the entry when
    one has neither, or its knobs leave its condition true."""
    applied: list[Known] = []
    while known := [e for impl in impls for e in for_case(impl, case, registry=registry)
                    if not (e in applied and e.neutral_weights)]:
        entry = known[0]
        where = f"{REGISTRY_FILE.name}: entry {entry.id}: field 'neutral'"
        if entry in applied:
            raise RegistryError(f"{where}: applies again to {case.id} after the neutrals of {[e.id for e in applied]}")
        if not (entry.neutral or entry.neutral_weights):
            raise RegistryError(f"{where}: missing, so case {case.id}, which it applies to, cannot be made clean")
        names = case_names(case)
        values = {k: eval(_compiled(expr, entry.area), {"__builtins__": {}}, names) for k, expr in entry.neutral}
        knobs = {**dict(case.overrides), **{k: v for k, v in values.items() if k in KNOBS}}
        flags = {**dict(case.sglang_args), **{k: v for k, v in values.items() if k in SERVER_FLAGS}}
        case = dataclasses.replace(
            case, id=case.id if applied else f"{case.id}-neutral", overrides=tuple(sorted(knobs.items())),
            sglang_args=tuple(sorted((k, v) for k, v in flags.items() if v is not None)))   # None: flag not given
        if entry.neutral and entry.condition_holds(case_names(case)):
            raise RegistryError(f"{where}: {dict(entry.neutral)} leaves its condition true on {case.id}")
        applied.append(entry)
    return Neutralised(case, tuple(applied), tuple(p for e in applied for p in e.neutral_weights))
