"""Training accuracy to measured accept length, per chain K: speculators' prediction from its training
metrics (1 + sum_{k<K} full_acc_k, conformance/acceptance/acceptance.py) next to the accept length
SGLang's engine measured on the scenarios it served at that K, and the reference's simulation of the
same requests. Nothing is served or simulated here: the lane's runs and findings are reused.

Two definitions, each compared like for like:
- SGLang's meta_info accept length is completion tokens / verify count (the prefill's token counts,
  the last round's tokens past max_new_tokens do not), pooled over the requests; the simulation's
  (findings.reference_stats) is the same quotient.
- Per verify round, 1 + accepted drafts / verify count (SGLang's own histogram) is what training
  predicts; at the engine's own rounds, speculators' per-row scores (Prediction.accepted at each
  round's start row) must give it exactly (the held-out rows are the target's greedy continuation).
The prediction averages over every held-out start row, the engine over its few prompts' rounds: the
difference between the two is the choice of rows, not a fault (the row-for-row column shows it).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from conformance.acceptance.acceptance import Prediction
from conformance.core.sections import ACCEPT_COLUMNS
from conformance.engine.findings import RequestFinding, scenario_findings
from conformance.engine.lane import EngineLane
from conformance.engine.scenarios import GROUPS

PREDICTED, MEASURED, SIMULATED, PER_ROUND, TRAINED_ROWS = ACCEPT_COLUMNS


@dataclass(frozen=True)
class AcceptRow:
    K: int
    scenarios: tuple[str, ...]
    requests: int
    predicted: float               # the trainer's full_acc over every held-out start row
    measured: Fraction             # SGLang: sum completion tokens / sum verify count
    simulated: Fraction            # the reference's rounds on the same requests, same quotient
    per_round: Fraction            # SGLang: 1 + sum accepted drafts (its histogram) / sum verify count
    trained_rows: Fraction | None  # the trainer's per-row scores at the engine's rounds (None: a round off them)
    start_rows: tuple[int, int]    # first and last start row of the engine's rounds
    rounds: int
    unequal_requests: tuple[str, ...]   # findings.acceptance_failure, per request (the lane's own check)

    def report_row(self) -> dict:
        return {
            "K": self.K, "scenarios": ", ".join(self.scenarios), "requests": self.requests,
            PREDICTED: round(self.predicted, 6), MEASURED: round(float(self.measured), 6),
            SIMULATED: round(float(self.simulated), 6),
            "engine == simulation": "exact" if self.measured == self.simulated and not self.unequal_requests
            else f"DIFFER ({len(self.unequal_requests)} requests)",
            PER_ROUND: round(float(self.per_round), 6),
            TRAINED_ROWS: None if self.trained_rows is None else round(float(self.trained_rows), 6),
            "per round - predicted": round(float(self.per_round) - self.predicted, 6),
            "why they differ": f"the prediction averages all held-out start rows, the engine its {self.rounds} "
                              f"verify rounds of {self.requests} prompts (start rows {self.start_rows[0]}.."
                              f"{self.start_rows[1]})" + ("; training's scores at those rows give SGLang's per-round "
                                                          "figure exactly: the gap is the rows"
                                                          if self.trained_rows == self.per_round else "")
                              + "; SGLang's meta_info figure (completion tokens / verify count) counts the "
                                "prefill's token and not the last round's tokens past the length limit"}


def _training_at_rounds(prediction: Prediction, heldout: torch.Tensor, findings: list[RequestFinding],
                        K: int) -> Fraction | None:
    """1 + mean over the engine's rounds of the leading drafts speculators scored right at the round's
    start row (capped at K): None when a round's context is not a held-out prefix or its row was scored
    for fewer than K steps (training said nothing there)."""
    accepted = []
    for f in findings:
        seq = f.request.prompt.seq
        for r in f.reference:
            n = len(r.context)
            if n > heldout.shape[1] or not torch.equal(r.context, heldout[seq, :n]) or \
                    prediction.scored_steps(r.last_row) < K:
                return None
            accepted.append(min(prediction.accepted(seq, r.last_row), K))
    return 1 + Fraction(sum(accepted), len(accepted))


def accept_rows(lane: EngineLane, prediction: Prediction, groups=None) -> dict[int, AcceptRow]:
    """K -> its row, over the chain groups the lane serves (`groups`: those of them; each served once per
    session; an engine that failed gives no row)."""
    by_k: dict[int, list] = {}
    for group in (g for g in (GROUPS if groups is None else groups) if g.chain):
        run = lane.run(group)
        if run.error:
            continue
        K = run.resolved["speculative_num_steps"]
        for scenario in run.scenarios.values():
            by_k.setdefault(K, []).append((scenario, scenario_findings(lane, run, scenario)))
    rows = {}
    for K, served in sorted(by_k.items()):
        findings = [(s.scenario.new_tokens, f) for s, fs in served for f in fs]
        meta = [f.request.served.meta for _, f in findings]
        verify = sum(m["spec_verify_ct"] for m in meta)
        correct = sum(a * n for m in meta for a, n in enumerate(m.get("spec_correct_drafts_histogram") or []))
        reference_rounds = sum(len(f.reference) for _, f in findings)
        start_rows = [r.last_row for _, f in findings for r in f.reference]
        rows[K] = AcceptRow(
            K, tuple(s.scenario.id for s, _ in served), len(findings), prediction.accept_length(K),
            Fraction(sum(m["completion_tokens"] for m in meta), verify),
            Fraction(sum(new for new, _ in findings), reference_rounds),
            1 + Fraction(correct, verify),
            _training_at_rounds(prediction, lane.trained.heldout_ids, [f for _, f in findings], K),
            (min(start_rows), max(start_rows)), reference_rounds,
            tuple(f.request.label for new, f in findings if f.acceptance_failure(new)))
    return rows


def served_ks(groups=None) -> set[int]:
    """The chain K of every engine group the lane serves (the seed flags' steps 1 is K = 1), or of `groups`."""
    return {g.steps for g in (GROUPS if groups is None else groups) if g.chain}


def other_trainer_groups() -> tuple:
    """What the lane serves a non-default trainer's draft with, for the bridge alone: the deepest chain group
    (one engine start; K = the TTT steps the drafts are trained for, every shorter K read off the same rounds
    by the reference simulation's rows)."""
    return (max((g for g in GROUPS if g.chain), key=lambda g: g.steps),)


def bridge_failures(rows: dict[int, AcceptRow], ks: set[int]) -> list[str]:
    """A row for every K served; per K the engine's accept length equals the simulation's exactly, and
    speculators' scores at the engine's own rounds give SGLang's per-round accept length exactly."""
    out = [f"K = {K}: no accept-length row (the engine at K = {K} did not serve)" for K in sorted(ks - rows.keys())]
    for K, row in sorted(rows.items()):
        if row.measured != row.simulated or row.unequal_requests:
            out.append(f"K = {K} ({', '.join(row.scenarios)}): SGLang measured accept length {row.measured} "
                       f"({float(row.measured):.4f}), the reference simulation {row.simulated} "
                       f"({float(row.simulated):.4f}); requests whose accounting differs: "
                       f"{list(row.unequal_requests) or 'none'}")
        if row.trained_rows != row.per_round:
            out.append(f"K = {K} ({', '.join(row.scenarios)}): SGLang's per-round accept length {row.per_round} "
                       f"({float(row.per_round):.4f}), the trainer's training scores at the same {row.rounds} "
                       f"rounds' start rows " + ("none (a round is off the held-out rows training scored)"
                                                 if row.trained_rows is None else f"{row.trained_rows} "
                                                 f"({float(row.trained_rows):.4f})"))
    return out
