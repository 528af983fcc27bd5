"""A finding on a user's draft, as data: what is served differently, where, the evidence, the cause and the fix.

Every check area that judges a user's draft (the forward, loading, wiring, server settings, ...) states what it
finds as a Problem; the verdict (conformance/user/verdict.py) merges and numbers them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Problem ranks: the order problems are numbered in (the first that stops serving comes first).
DIRECTORY, CONVERSION, LOADING, FORWARD, WIRING, SETTINGS, OTHER = range(7)
# Each rank's area, as report.md and the chart name it (a load refusal and the weight accounting are both loading).
AREA_OF_RANK = ("reading", "conversion", "loading", "forward", "wiring", "settings", "other")
FIELDS = ("what", "where", "evidence", "cause", "fix")


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

    def to_json(self, number: int) -> dict:
        out = {"number": number, **{f: getattr(self, f) for f in FIELDS}}
        if self.also:
            out["evidence"] += "; also in: " + ", ".join(self.also)
        return {**out, "area": AREA_OF_RANK[self.rank], "impl": self.impl or None, "registry_id": self.known or None,
                "checks": sorted(self.checks)}
