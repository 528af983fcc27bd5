"""A finding on a user's draft, as data: what is served differently, where, the evidence, the cause and the fix.

Every check area that judges a user's draft (the forward, loading, wiring, server settings, ...) states what it
finds as a Problem; the verdict (conformance/user/verdict.py) merges and numbers them.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

# Problem ranks: the order problems are numbered in (the first that stops serving comes first).
DIRECTORY, CONVERSION, READING, LOADING, FORWARD, WIRING, SETTINGS, OTHER = range(8)
# Each rank's area, as report.md and the chart name it (a load refusal and the weight accounting are both loading).
AREA_OF_RANK = ("reading", "conversion", "reading", "loading", "forward", "wiring", "settings", "other")
FIELDS = ("what", "where", "evidence", "cause", "fix")
CONVERT = "convert"   # a remedy: this suite's converter writes a copy of the draft without the problem


@dataclass
class Problem:
    what: str                 # one line: what is served differently
    where: str                # stage, tensor, setting or aux slot
    evidence: str             # the numbers
    cause: str                # file:line in the pinned package
    fix: str                  # the config key or server flag to change, or what cannot be served
    rank: int = FORWARD
    key: str = ""             # the same key from several checks is one problem
    known: str = ""           # the registry entry that names it, if any
    impl: str = ""            # the implementation it is about, if one
    seen: str = ""            # the run that showed it (dtype, steps), when several runs can
    checks: list[str] = field(default_factory=list)   # node ids of the checks that found it
    also: list[str] = field(default_factory=list)     # the other runs that showed it
    remedy: str = ""          # CONVERT when the fix is a command of this suite's (the verdict prints it)

    def to_json(self, number: int) -> dict:
        out = {"number": number, **{f: getattr(self, f) for f in FIELDS}}
        if self.also:
            out["evidence"] += "; also in: " + ", ".join(self.also)
        out = {f: cited(plain(text, self.known), self.impl) if f in FIELDS else text for f, text in out.items()}
        return {**out, "area": AREA_OF_RANK[self.rank], "impl": self.impl or None, "registry_id": self.known or None,
                "remedy": self.remedy or None, "checks": sorted(self.checks)}


def plain(text: str, known: str) -> str:
    """The text without the registry's own names for its entries (the problem's own, `known`, and any other it
    cites, as a reading problem cites each implementation's): the user reads what and why; the ids stay in
    report.json (`registry_id`) and report.md's details."""
    from conformance.core.registry import REGISTRY   # not at import: the registry's entries are read from here

    for known in {known, *(entry.id for entry in REGISTRY)} - {""}:
        text = text.replace(f" ({known})", "").replace(f"the registry's {known}: ", "")
    return text


# ---------------------------------------------------------------- file:line citations

# The installed packages a cause cites, in the order a bare file name is looked up.
PACKAGES = ("sglang", "speculators", "specforge", "transformers", "vllm")
_CITED = re.compile(rf"(?:\b(?P<package>{'|'.join(PACKAGES)}) )?(?<![\w/.-])(?P<path>[\w.-]+(?:/[\w.-]+)*\.py)(?=:\d)")


@cache
def _sources(package: str) -> tuple[str, ...]:
    """Every .py file of an installed package, from its root on (`srt/models/llama_eagle3.py`); none when absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return ()
    root = Path(next(iter(spec.submodule_search_locations)))
    return tuple(p.relative_to(root).as_posix() for p in root.rglob("*.py"))


def cited(text: str, impl: str = "") -> str:
    """Every file:line citation with its package path: `llama_eagle3.py:97-99` and `speculators models/x.py:80`
    become `sglang/srt/models/llama_eagle3.py:97-99` and `speculators/models/x.py:80`, found among the installed
    packages' files (the package `impl` names first, when a name is in several); one found nowhere, or in
    several places alike, stays as written."""
    def qualify(m: re.Match) -> str:
        path = m["path"]
        if path.split("/", 1)[0] in PACKAGES:
            return m[0]
        order = (m["package"],) if m["package"] else (impl, *PACKAGES) if impl in PACKAGES else PACKAGES
        for package in dict.fromkeys(order):
            found = [rel for rel in _sources(package) if rel == path or rel.endswith("/" + path)]
            if len(found) == 1:
                return f"{package}/{found[0]}"
            if found:
                break
        return m[0]
    return _CITED.sub(qualify, text)
