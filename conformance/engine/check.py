"""One served round against the reference's, stage by stage: the first divergence names the request,
the round, the draft step and the stage.

The engine's step 0 covers only the round's new rows (its KV cache holds the rest); the reference
recomputes every row of the context, so the served rows are compared at their rows t. Before the
canonical stages of each step come the positions SGLang's worker gave the pass (the rows t at step
0, the last row's t + k at decode step k), and after the last step what verify accepted.
"""
from __future__ import annotations

import torch

from conformance.core.trace import Trace
from conformance.core import stages as S
from conformance.core.compare import ABSENT, DIVERGED, OK, Comparison, StageResult, compare_traces
from conformance.core.tolerances import tol_for
from conformance.engine.served import ServedRound
from conformance.engine.simulate import ReferenceRound

IMPL = "sglang engine"
# What the capture sees of a served pass: every canonical stage but draft_ids (the worker maps them to
# target ids at once; the drafted target ids are read from what draft() hands to verification).
CLAIMED = frozenset(S.PRE + S.LAYER + S.POST) - {"draft_ids"}
POSITIONS, ACCEPTED = "positions", "accepted_drafts"
# The tree draft_forward hands to verification, by the reference tree's stage names (reference/tree.py).
TREE_OUTPUTS = (("tree_tokens", "draft_tokens"), ("tree_index", "top_scores_index"), ("tree_parents", "parent_list"))


def exact(step: int, stage: str, actual: torch.Tensor, expected: torch.Tensor) -> StageResult:
    """An integer stage: equal, element for element."""
    actual, expected = actual.flatten().long(), expected.flatten().long()
    tol = tol_for("ids", torch.float32)
    if actual.shape != expected.shape:
        return StageResult(step, stage, DIVERGED, tol=tol, detail=f"{actual.tolist()}, expected {expected.tolist()}")
    wrong = (actual != expected).nonzero().flatten()
    detail = "" if not len(wrong) else f"{actual.tolist()}, expected {expected.tolist()}"
    return StageResult(step, stage, DIVERGED if len(wrong) else OK, max_abs=float(len(wrong)),
                       max_rel=float(len(wrong)) / max(actual.numel(), 1),
                       abs_index=(int(wrong[0]),) if len(wrong) else None, mismatched=len(wrong),
                       numel=actual.numel(), tol=tol, detail=detail)


def served_trace(served: ServedRound, last_row: int, num_layers: int, chain: bool,
                 impl: str = IMPL, dtype: torch.dtype = torch.float32,
                 claimed: frozenset[str] = CLAIMED) -> tuple[Trace, list]:
    """The served round as a Trace on the reference's rows (`dtype`: what the engine served in; `claimed`: the
    stages the engine's capture has of this draft, the engine's claimed_stages), and its positions per step."""
    n = sum(len(p.positions) for p in served.extend)
    rows0 = torch.arange(last_row + 1 - n, last_row + 1)
    cuts = torch.tensor([0] + [len(p.positions) for p in served.extend]).cumsum(0).tolist()
    step0, rows = {}, {}
    names = dict.fromkeys(k for p in served.extend for k in (*p.rows, *p.selected))
    for name in names:
        if all(name in p.rows for p in served.extend):
            step0[name], rows[name] = torch.cat([p.rows[name] for p in served.extend]), rows0
        elif all(name in p.selected for p in served.extend):
            step0[name] = torch.cat([p.selected[name] for p in served.extend])
            rows[name] = rows0[[c - 1 for c in cuts[1:]]]
    steps, all_rows = [step0], [rows]
    positions = [(torch.cat([p.positions for p in served.extend]), rows0)]
    for k, p in enumerate(served.decode, start=1):
        steps.append(dict(p.rows))
        all_rows.append({name: torch.tensor([last_row]) for name in p.rows} if chain else {})
        positions.append((p.positions, torch.full((len(p.positions),), last_row + k)))
    if chain and "draft_tokens" in served.tree:
        for k, token in enumerate(served.tree["draft_tokens"].flatten()[:len(steps)]):
            steps[k]["target_ids"], all_rows[k]["target_ids"] = token[None], torch.tensor([last_row])
    # A tree's drafted ids are its candidates (compared as the tree after the last step), not one per step.
    claimed = claimed if chain else claimed - {"target_ids"}
    trace = Trace(impl=impl, dtype=dtype, steps=steps, rows=all_rows, claimed_stages=claimed,
                  num_layers=num_layers)
    return trace, positions


def compare_round(served: ServedRound, ref: ReferenceRound, case_id: str, chain: bool = True,
                  impl: str = IMPL, dtype: torch.dtype = torch.float32, same: Trace | None = None,
                  claimed: frozenset[str] = CLAIMED) -> Comparison:
    """Positions, then every canonical stage of every step, then (chains) the accepted drafts. `impl`: the
    served side's name in the message (the engine that served it). An engine serving another dtype than fp32
    (`dtype`) is compared under that dtype's error model (core/tolerances.py): `ref.trace` is then the fp64
    reference and `same` the reference in `dtype`, on the same inputs."""
    layers = ref.trace.num_layers
    trace, positions = served_trace(served, ref.last_row, layers, chain, impl, dtype, claimed)
    steps = min(len(trace.steps), len(ref.trace.steps))
    precise = ref.trace if ref.trace.dtype == torch.float64 else None
    cmp = compare_traces(trace, ref.trace, case_id, steps=steps, precise=precise, same=same)
    results = []
    if len(trace.steps) != len(ref.trace.steps):
        results.append(StageResult(steps - 1, "draft_passes", DIVERGED, detail=(
            f"{impl} ran {len(trace.steps)} draft steps (step 0 and its decode passes), the reference "
            f"{len(ref.trace.steps)}")))
    for step in range(steps):
        results.append(exact(step, POSITIONS, *positions[step]))
        results += [r for r in cmp.results if r.step == step]
    if chain:
        results.append(exact(steps - 1, ACCEPTED, torch.tensor([served.accepted]), torch.tensor([ref.accepted])))
    cmp.results = [r for r in results if r.verdict != ABSENT]   # draft_ids: the capture reads target ids
    return cmp


def first_divergent_round(served: list[ServedRound], reference: list[ReferenceRound], case_id: str,
                          chain: bool = True, impl: str = IMPL,
                          claimed: frozenset[str] = CLAIMED) -> tuple[int, Comparison | None]:
    """The first round whose comparison fails (later rounds start from other contexts), or (rounds, None)."""
    for r, (s, ref) in enumerate(zip(served, reference)):
        cmp = compare_round(s, ref, f"{case_id}, round {r}", chain, impl, claimed=claimed)
        if cmp.first_divergence is not None:
            return r, cmp
    return min(len(served), len(reference)), None


def compare_tree_round(served: ServedRound, ref: ReferenceRound, case_id: str) -> Comparison:
    """A tree round: positions and stages of every step (topk rows per decode pass), then the tree
    SGLang handed to verification (organize_draft_results: tokens, candidate ids, parents) and what
    verify accepted of it, against the reference tree on the same context."""
    cmp = compare_round(served, ref, case_id, chain=False)
    last, tree = len(ref.trace.steps) - 1, ref.trace.steps[-1]
    cmp.results += [exact(last, name, served.tree[mine], tree[name]) for name, mine in TREE_OUTPUTS]
    cmp.results.append(exact(last, ACCEPTED, torch.tensor([served.accepted]), torch.tensor([ref.accepted])))
    return cmp
