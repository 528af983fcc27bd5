"""Matching an observation against the registry (registry.py): an entry is a hit only when the observed
failure is exactly its place with its signature; anything else fails with the full message. Each area
declares how its observations match (conformance/core/areas.py); `judge` is the one entry point, and the
match_* helpers name the areas' observations. And the one helper that turns applicable entries into a
strict xfail param, and the one that settles a check.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import pytest

from conformance.core.areas import ACCOUNTING_PROBLEMS, AREAS, AccountingProblems, Divergence, Match, Mismatch, Refusal
from conformance.core.registry import Known


class KnownDivergenceHit(AssertionError):
    """The registered behaviour, at its exact place with its signature: what a strict xfail expects."""


def judge(area: str, known: Sequence[Known], seen: object) -> Match:
    """The one way an observation meets the registry, in every area, built-in matrix and user draft alike:
    the entries it is exactly, and what no entry explains (conformance/core/areas.py)."""
    return AREAS[area].judge(known, seen)


def match_forward(known: Sequence[Known], first, num_layers: int) -> Known | None:
    """The deciding entry when the first divergence (a StageResult or None) is exactly its step and stage."""
    hits = judge("draft", known, Divergence(first, num_layers)).hits
    return hits[0] if hits else None


def match_load(known: Sequence[Known], error: str | None, message: str) -> Known | None:
    """A load entry whose exception class is `error` and whose pattern is found in `message`
    (error None: the caller kept only the message)."""
    hits = judge("load", known, Refusal(error, message)).hits
    return hits[0] if hits else None


def match_wiring(known: Sequence[Known], seen: Mismatch) -> Known | None:
    """The first applicable wiring entry, when the observed mismatch is its kind (and, for an error, its exception
    class and message)."""
    hits = judge("wiring", known, seen).hits
    return hits[0] if hits else None


def accounting_problems(account) -> list[tuple[str, str]]:
    """(problem, tensor or message) for every problem of an Accounting (conformance/loading/accounting.py)."""
    out = [("refused", account.refused)] if account.refused else []
    out += [(problem, t) for problem, field in ACCOUNTING_PROBLEMS.items() for t in getattr(account, field)]
    return out + [("invalid", p) for p in account.vocab_map]


def match_accounting(known: Sequence[Known], problems: Sequence[tuple[str, str]]) -> tuple[list[Known], list[str]]:
    """(the entries that explain problems, the problems none explains as "problem: tensor")."""
    found = judge("accounting", known, AccountingProblems(tuple(problems)))
    return found.hits, found.unexplained


# ---------------------------------------------------------------- strict xfails

def known_param(*values, id: str, known: Sequence[Known] = ()):
    """A pytest param; a strict xfail (raises KnownDivergenceHit only) when entries apply to it."""
    marks = [pytest.mark.xfail(strict=True, raises=KnownDivergenceHit,
                               reason="; ".join(e.describe() for e in known))] if known else []
    return pytest.param(*values, id=id, marks=marks)


def settle(message: str, hit: Known | Sequence[Known] | None) -> NoReturn:
    """Fail with the full message: as the known hit when an entry matched exactly, else as a failure."""
    __tracebackhide__ = True
    hits = [hit] if isinstance(hit, Known) else list(hit or ())
    if hits:
        raise KnownDivergenceHit(message + "".join(f"\n  known ({e.id}): {e.reason}" for e in hits)) from None
    raise AssertionError(message) from None


def settle_accounting(account, known: Sequence[Known], head: str, repro: str) -> None:
    """Pass when the account has no problem; KnownDivergenceHit only when registered entries explain every
    problem (a refusal by a load entry's pattern, each other problem by an entry naming that tensor)."""
    __tracebackhide__ = True
    problems = accounting_problems(account)
    if not problems:
        return
    used, unexplained = match_accounting(known, problems)
    lines = [f"{head}: " + "; ".join(f"{p}: {w}" for p, w in problems)]
    if unexplained and known:
        lines.append("  not explained by the registry: " + "; ".join(unexplained))
    settle("\n".join(lines + [f"  repro: {repro}"]), [] if unexplained else used)
