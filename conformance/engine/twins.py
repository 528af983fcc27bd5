"""Two runs of the same requests compared token for token: what each round drafted and what verify accepted of
it, and the accept accounting the server reported (verify count, accepted-draft histogram, accept length).

The twins: an engine at TP 2 and at TP 1 (test_engine_tp.py); a CUDA configuration and its eager, non-overlap,
page-1 run (test_engine_gpu.py); a served run and the reference's simulation of it (the drafted tokens; its
accounting is findings.RequestFinding.acceptance_failure). Rounds are compared up to the first that differs: later
rounds start from other contexts. Every difference names the request and the round, each side by its name.
"""
from __future__ import annotations

from dataclasses import dataclass

from conformance.core.served_round import ServedRound


@dataclass(frozen=True)
class RoundTokens:
    drafted: tuple[int, ...]    # the target ids the draft proposed (a chain: one per draft step)
    accepted: int               # how many of them verify accepted


def served_tokens(rounds: list[ServedRound]) -> list[RoundTokens]:
    """A served request's rounds as the capture recorded them (draft_tokens: what draft() handed to verify)."""
    return [RoundTokens(tuple(r.tree["draft_tokens"].flatten().tolist()) if "draft_tokens" in r.tree else (),
                        r.accepted) for r in rounds]


def reference_tokens(rounds) -> list[RoundTokens]:
    """The reference simulation's rounds (simulate.ReferenceRound)."""
    return [RoundTokens(tuple(r.drafts.flatten().tolist()), r.accepted) for r in rounds]


def accounting(meta: dict) -> dict:
    """SGLang's own accept accounting of one request (meta_info; tokenizer_manager.py:3148-3172)."""
    return {"verify_ct": meta.get("spec_verify_ct"), "histogram": list(meta.get("spec_correct_drafts_histogram") or []),
            "accept_length": meta.get("spec_accept_length")}


def round_differences(case: str, mine: list[RoundTokens], theirs: list[RoundTokens],
                      names: tuple[str, str]) -> list[str]:
    """The first round whose drafted tokens or accepted count differ, and a round count that differs."""
    a, b = names
    for r, (x, y) in enumerate(zip(mine, theirs)):
        if x != y:
            return [f"{case}, round {r}: {a} drafted {list(x.drafted)} (accepted {x.accepted}), {b} drafted "
                    f"{list(y.drafted)} (accepted {y.accepted})"]
    if len(mine) != len(theirs):
        return [f"{case}: {a} ran {len(mine)} rounds, {b} {len(theirs)}"]
    return []


def accounting_differences(case: str, mine: dict, theirs: dict, names: tuple[str, str]) -> list[str]:
    """Verify count, histogram (a shorter one padded with empty bins) and accept length, each exact: both sides
    are the same server's arithmetic on integers."""
    a, b = names
    width = max(len(mine["histogram"]), len(theirs["histogram"]))
    padded = [h + [0] * (width - len(h)) for h in (mine["histogram"], theirs["histogram"])]
    out = []
    if mine["verify_ct"] != theirs["verify_ct"]:
        out.append(f"{case}: verify count {a} {mine['verify_ct']}, {b} {theirs['verify_ct']}")
    if padded[0] != padded[1]:
        out.append(f"{case}: accepted-draft histogram {a} {mine['histogram']}, {b} {theirs['histogram']}")
    if mine["accept_length"] != theirs["accept_length"]:
        out.append(f"{case}: accept length {a} {mine['accept_length']}, {b} {theirs['accept_length']}")
    return out


def twin_failures(scenario_id: str, mine: list, theirs: list, names: tuple[str, str]) -> list[str]:
    """Request by request (lane.Request: prompt, served, rounds), the same prompts served by both runs: the rounds
    token for token, then the accounting."""
    a, b = names
    if [r.prompt for r in mine] != [r.prompt for r in theirs]:
        return [f"{scenario_id}: {a} served prompts {[r.prompt for r in mine]}, {b} {[r.prompt for r in theirs]}"]
    out = []
    for i, (x, y) in enumerate(zip(mine, theirs)):
        case = f"{a} vs {b}: {scenario_id}, request {i} ({x.label})"
        out += round_differences(case, served_tokens(x.rounds), served_tokens(y.rounds), names)
        out += accounting_differences(case, accounting(x.served.meta), accounting(y.served.meta), names)
    return out
