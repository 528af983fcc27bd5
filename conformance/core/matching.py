"""Matching an observation against the registry (registry.py): an entry is a hit only when the observed
failure is exactly its place with its signature; anything else fails with the full message. And the
one helper that turns applicable entries into a strict xfail param.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NoReturn

import pytest

from conformance.core.registry import ACCOUNTING_PROBLEMS, Known
from conformance.core.stages import TREE, TREE_FINAL, stage_names


class KnownDivergenceHit(AssertionError):
    """The registered behaviour, at its exact place with its signature: what a strict xfail expects."""


def deciding(known: Sequence[Known], num_layers: int) -> Known | None:
    """The entry that decides a forward comparison: a load entry first, else the earliest (step, stage)."""
    if not known:
        return None
    order = {name: i for i, name in enumerate(stage_names(num_layers) + TREE + TREE_FINAL)}
    return min(known, key=lambda e: (-1, -1) if e.area == "load" else (e.step, order.get(e.stage, len(order))))


def match_forward(known: Sequence[Known], first, num_layers: int) -> Known | None:
    """The deciding entry when the first divergence (a StageResult or None) is exactly its step and stage."""
    entry = deciding(known, num_layers)
    if entry is None or entry.area == "load" or first is None:
        return None
    return entry if (first.step, first.stage) == (entry.step, entry.stage) else None


def match_load(known: Sequence[Known], error: str | None, message: str) -> Known | None:
    """A load entry whose exception class is `error` and whose pattern is found in `message`
    (error None: the caller kept only the message)."""
    return next((e for e in known if e.area == "load" and (error is None or error == e.error)
                 and re.search(e.message, message)), None)


def match_wiring(known: Sequence[Known], kind: str) -> Known | None:
    """The first applicable wiring entry, when the observed mismatch is its kind."""
    wiring = [e for e in known if e.area == "wiring"]
    return wiring[0] if wiring and wiring[0].kind == kind else None


def accounting_problems(account) -> list[tuple[str, str]]:
    """(problem, tensor or message) for every problem of an Accounting (conformance/loading/accounting.py)."""
    out = [("refused", account.refused)] if account.refused else []
    out += [(problem, t) for problem, field in ACCOUNTING_PROBLEMS.items() for t in getattr(account, field)]
    return out + [("invalid", p) for p in account.vocab_map]


def match_accounting(known: Sequence[Known], problems: Sequence[tuple[str, str]]) -> tuple[list[Known], list[str]]:
    """(the entries that explain problems, the problems none explains as "problem: tensor"). A refusal is
    explained by a load entry whose pattern its message has; any other problem by an accounting entry
    of that problem whose tensor patterns include the tensor."""
    used: list[Known] = []
    unexplained = []
    for problem, what in problems:
        if problem == "refused":
            entry = match_load(known, None, what)
        else:
            entry = next((e for e in known if e.area == "accounting" and e.problem == problem
                          and any(re.fullmatch(t, what) for t in e.tensors)), None)
        if entry is None:
            unexplained.append(f"{problem}: {what}")
        elif entry not in used:
            used.append(entry)
    return used, unexplained


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
