"""The exact acceptance checks (fp32, greedy chain), where no sampling bound is needed.

Drafts: per verify round and draft position, the token an implementation drafts equals the
reference's; its accept length is then the reference's, round by round (the same target verifies
the same tokens). Rows: per round, the reference accepts exactly what speculators' training metrics
scored at that start row (the held-out tokens are the target's greedy continuation, so teacher
forcing feeds the chain the tokens it drafts itself while it is right; test_trained_draft_has_learned
checks both preconditions). Neither side of speculators' prediction is compared with the other: its
metrics against the reference's simulation, its drafting loop against the reference's drafts, so a
fault in the forward both run cannot cancel out.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from conformance.acceptance.acceptance import Prediction, Request, Simulation
from conformance.acceptance.stagewise import round_divergence
from conformance.acceptance.trained_draft import GreedyTarget, TrainedDraft


@dataclass(frozen=True)
class DraftMismatch:
    round: int          # index into the requests
    request: Request
    position: int       # 0-based draft step: the first where the tokens differ in this round
    drafted: int
    expected: int


def draft_mismatches(actual: Simulation, expected: Simulation, requests: list[Request]) -> list[DraftMismatch]:
    """Per round whose drafts differ, the first position where they do."""
    differs = actual.drafts != expected.drafts
    out = []
    for j in differs.any(dim=1).nonzero().flatten().tolist():
        k = int(differs[j].nonzero()[0])
        out.append(DraftMismatch(j, requests[j], k, int(actual.drafts[j, k]), int(expected.drafts[j, k])))
    return out


def drafts_message(impl: str, mismatches: list[DraftMismatch], rounds: int, trained: TrainedDraft,
                   target: GreedyTarget, checkpoints: dict[str, Path], aux_ids: tuple[int, ...],
                   reference: Simulation, case_id: str, repro: str) -> str:
    """The failure: how many rounds differ, the first one (row, position, tokens) and the first
    divergent stage of that round (the stage comparison, both fed the reference's chain)."""
    first = mismatches[0]
    r = first.request
    prompt = trained.heldout_ids[r.seq, :r.prompt_len]
    comparison = round_divergence(trained, target, impl, checkpoints, aux_ids, prompt,
                                  reference.drafts[first.round], first.position, case_id)
    stage = comparison.first_divergence
    where = ("no stage parts from the reference on this round's rows (the draft ids differ only in the "
             "drafting loop around the forward)" if stage is None else
             f"first divergent stage: step {stage.step} '{stage.stage}' (max abs {stage.max_abs}, "
             f"at {stage.abs_index})")
    positions = sorted({m.position for m in mismatches})
    return (f"{impl} vs reference [{case_id}, fp32]: {len(mismatches)}/{rounds} verify rounds draft other tokens "
            f"(first positions {[p + 1 for p in positions]})\n"
            f"  first: round {first.round}, held-out sequence {r.seq}, start row {r.row} (prompt {r.prompt_len} "
            f"tokens), draft position {first.position + 1} (step {first.position}): {impl} drafted "
            f"{first.drafted}, the reference {first.expected}\n  {where}\n"
            + (comparison.table() if stage is not None else "") + f"\n  repro: {repro}")


@dataclass(frozen=True)
class RowMismatch:
    round: int
    request: Request
    scored: int       # draft steps training scored at this start row
    trained: int      # leading drafts right there, as speculators' metrics scored them
    simulated: int    # drafts the reference's round accepted, up to `scored`


def row_mismatches(prediction: Prediction, simulation: Simulation, requests: list[Request]) -> list[RowMismatch]:
    """Rounds whose accepted drafts differ from what training scored at their start row."""
    out = []
    for j, r in enumerate(requests):
        scored = prediction.scored_steps(r.row)
        trained = prediction.accepted(r.seq, r.row)
        simulated = min(int(simulation.stats.accepted[j]), scored)
        if simulated != trained:
            out.append(RowMismatch(j, r, scored, trained, simulated))
    return out


def rows_message(mismatches: list[RowMismatch], rounds: int, trained: TrainedDraft, target: GreedyTarget,
                 reference: Simulation, case_id: str, repro: str) -> str:
    """The failure: how many rounds differ, the first one (row, what each side counts) and where the
    predictor's forward parts from the reference on that round (both fed the reference's chain)."""
    m = mismatches[0]
    r = m.request
    step = min(m.trained, m.simulated)   # the first step one side counts right and the other wrong
    predictor = trained.trainer   # whose training metrics made the prediction
    comparison = round_divergence(trained, target, predictor, trained.checkpoints, tuple(trained.config.aux_layer_ids),
                                  trained.heldout_ids[r.seq, :r.prompt_len], reference.drafts[m.round], step, case_id)
    return (f"reference vs {predictor}' training metrics [{case_id}, fp32]: {len(mismatches)}/{rounds} rounds accept "
            f"other than training scored at their start row\n  first: round {m.round}, held-out sequence {r.seq}, "
            f"start row {r.row}: training scored {m.trained} leading drafts right (of {m.scored} steps scored), the "
            f"reference's round accepted {m.simulated}; from draft position {step + 1} (step {step})\n"
            f"  {predictor}' forward on this round: " + comparison.message(repro))


def same_rows_accept_length(prediction: Prediction, simulation: Simulation, requests: list[Request],
                            K: int) -> tuple[float, float, int]:
    """(training's accept length, the simulation's, rounds) over the rounds whose start row training
    scored for K steps: equal when row_mismatches is empty."""
    rounds = [j for j, r in enumerate(requests) if prediction.scored_steps(r.row) >= K]
    trained = torch.tensor([1 + min(prediction.accepted(requests[j].seq, requests[j].row), K) for j in rounds])
    simulated = 1 + simulation.stats.accepted[rounds].clamp(max=K)
    return float(trained.double().mean()), float(simulated.double().mean()), len(rounds)
