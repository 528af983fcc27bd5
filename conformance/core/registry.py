"""The registry of known divergences (known_divergences.toml) and how a case is matched against it.

An entry holds for an implementation when the installed version is in its `versions` range and its
`when` condition is true of the case's draft knobs and SGLang server flags. The condition language is
a small, safe subset of Python expressions (names, constants, comparisons, and/or/not, + - *),
checked when the file is read.
"""
from __future__ import annotations

import ast
import dataclasses
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

from packaging.specifiers import SpecifierSet

from conformance.core.stages import stage_names
from fixtures.cases import DraftCase
from reference.eagle3 import Eagle3Config

REGISTRY_FILE = Path(__file__).with_name("known_divergences.toml")
LOAD = "load"   # the stage name for "the implementation's own loader refused the checkpoint"
PACKAGES = {"sglang": "sglang", "speculators": "speculators"}   # adapter -> the package its version comes from
SERVER_FLAGS = ("speculative_draft_window_size",)               # server flags a condition may name
FIELDS = ("id", "impl", "versions", "when", "step", "stage", "reason")
ALLOWED_NODES = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.BinOp, ast.Add,
                 ast.Sub, ast.Mult, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
                 ast.Name, ast.Load, ast.Constant)
KNOBS = frozenset(f.name for f in dataclasses.fields(Eagle3Config)) | frozenset(SERVER_FLAGS)


class RegistryError(ValueError):
    """A malformed registry entry; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class KnownDivergence:
    id: str
    impl: str              # adapter name
    versions: str          # PEP 440 specifier for the implementation's package
    when: str              # condition over knobs and server flags
    step: int              # the draft step where it first shows
    stage: str             # first divergent stage, or "load"
    reason: str            # why, with file:line

    def describe(self) -> str:
        return f"{self.impl} when {self.when}: first divergence at step {self.step}, '{self.stage}'. {self.reason}"

    def condition_holds(self, case: DraftCase) -> bool:
        names = {**dataclasses.asdict(case.config), **{flag: None for flag in SERVER_FLAGS}, **dict(case.sglang_args)}
        return bool(eval(_compiled(self.when), {"__builtins__": {}}, names))  # validated: see _compiled

    def version_holds(self) -> bool:
        # An implementation that is not installed has no known divergence: its tests then fail on
        # the import, which names the missing package, instead of passing as expected failures.
        version = installed_version(self.impl)
        return version is not None and version in SpecifierSet(self.versions)

    def applies(self, case: DraftCase) -> bool:
        return self.version_holds() and self.condition_holds(case)


@cache
def _compiled(condition: str):
    tree = ast.parse(condition, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, ALLOWED_NODES):
            raise RegistryError(f"condition {condition!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Name) and node.id not in KNOBS and node.id != "None":
            raise RegistryError(f"condition {condition!r}: unknown knob {node.id!r}")
    return compile(tree, "<known_divergences.toml>", "eval")


@cache
def installed_version(impl: str) -> str | None:
    try:
        return metadata.version(PACKAGES[impl])
    except metadata.PackageNotFoundError:
        return None


def load_registry(path: Path = REGISTRY_FILE) -> tuple[KnownDivergence, ...]:
    """Read and validate the registry; a problem raises RegistryError naming the file, entry and field."""
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"{path.name}: not valid TOML: {exc}") from None
    entries = []
    for n, item in enumerate(raw.get("divergence", []), 1):
        where = f"{path.name}: divergence #{n} ({item.get('id', 'no id')})"
        missing = [f for f in FIELDS if f not in item]
        extra = sorted(set(item) - set(FIELDS))
        if missing or extra:
            raise RegistryError(f"{where}: missing fields {missing}, unknown fields {extra}")
        if item["impl"] not in PACKAGES:
            raise RegistryError(f"{where}: impl {item['impl']!r} is not one of {sorted(PACKAGES)}")
        try:
            SpecifierSet(item["versions"])
            _compiled(item["when"])
        except Exception as exc:
            raise RegistryError(f"{where}: {exc}") from None
        base = item["stage"].rsplit(".", 1)[-1]
        if item["stage"] != LOAD and item["stage"] not in stage_names(4):
            raise RegistryError(f"{where}: stage {item['stage']!r} ({base}) is not a canonical stage")
        entries.append(KnownDivergence(**{f: item[f] for f in FIELDS}))
    ids = [e.id for e in entries]
    if len(ids) != len(set(ids)):
        raise RegistryError(f"{path.name}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return tuple(entries)


KNOWN_DIVERGENCES: tuple[KnownDivergence, ...] = load_registry()


def known_divergence(impl: str, case: DraftCase,
                     registry: tuple[KnownDivergence, ...] = KNOWN_DIVERGENCES) -> KnownDivergence | None:
    """The entry that decides this (implementation, case) pair: the earliest step and stage wins."""
    hits = [d for d in registry if d.impl == impl and d.applies(case)]
    if not hits:
        return None
    order = {LOAD: -1, **{name: i for i, name in enumerate(stage_names(case.config.num_hidden_layers))}}
    return min(hits, key=lambda d: (d.step, order.get(d.stage, len(order))))
