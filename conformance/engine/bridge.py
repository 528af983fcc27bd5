"""Training accuracy to measured accept length, per chain K and server: speculators' prediction from its training
metrics (1 + sum_{k<K} full_acc_k, conformance/acceptance/acceptance.py) next to the accept length
the server's engine measured on the scenarios it served at that K, and the reference's simulation of the
same requests. Nothing is served or simulated here: the lane's runs and findings are reused. SGLang's engine
(accept_rows, the engine lane) and an engine in an environment of its own (served_accept_rows: vLLM's) give
rows of the same shape, side by side in one table and chart.

Each server's measured figure is compared like for like with the simulation:
- SGLang's meta_info accept length is completion tokens / verify count (the prefill's token counts,
  the last round's tokens past max_new_tokens do not), pooled over the requests; the simulation's
  (findings.reference_stats) is the same quotient.
- vLLM's is 1 + accepted tokens / drafts, its own spec-decode counters (vllm:spec_decode_num_accepted_tokens,
  vllm:spec_decode_num_drafts) over the scenarios; the simulation's is the same quotient of its rounds.
- Per verify round, 1 + accepted drafts / verify count (the server's own per-round counts) is what training
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
from conformance.engine.lane import ENGINE, EngineLane
from conformance.engine.scenarios import GROUPS
from conformance.engine.served_lane import GROUPS as SERVED_GROUPS, ServedGroup, ServedLane

PREDICTED, MEASURED, SIMULATED, PER_ROUND, TRAINED_ROWS = ACCEPT_COLUMNS

@dataclass(frozen=True)
class AcceptRow:
    server: str                    # the engine's NAME (conformance/adapters/*/engine.py)
    K: int
    scenarios: tuple[str, ...]
    requests: int
    predicted: float               # the trainer's full_acc over every held-out start row
    measured: Fraction             # the server's own figure (SGLang: completion tokens / verify count; vLLM: per round)
    simulated: Fraction            # the reference's rounds on the same requests, same quotient
    per_round: Fraction            # the server's 1 + sum accepted drafts / sum verify count
    trained_rows: Fraction | None  # the trainer's per-row scores at the engine's rounds (None: a round off them)
    start_rows: tuple[int, int]    # first and last start row of the engine's rounds
    rounds: int
    unequal_requests: tuple[str, ...]   # the lane's own per-request accounting check, per request
    measured_as: str               # how the server defines its figure (its engine module's ACCEPT_LENGTH)

    def report_row(self) -> dict:
        return {
            "server": self.server, "K": self.K, "scenarios": ", ".join(self.scenarios), "requests": self.requests,
            PREDICTED: round(self.predicted, 6), MEASURED: round(float(self.measured), 6),
            SIMULATED: round(float(self.simulated), 6),
            "engine == simulation": "exact" if self.measured == self.simulated and not self.unequal_requests
            else f"DIFFER ({len(self.unequal_requests)} requests)",
            PER_ROUND: round(float(self.per_round), 6),
            TRAINED_ROWS: None if self.trained_rows is None else round(float(self.trained_rows), 6),
            "per round - predicted": round(float(self.per_round) - self.predicted, 6),
            "why they differ": f"the prediction averages all held-out start rows, the engine its {self.rounds} "
                              f"verify rounds of {self.requests} prompts (start rows {self.start_rows[0]}.."
                              f"{self.start_rows[1]})" + (f"; training's scores at those rows give {self.server}'s "
                                                          "per-round figure exactly: the gap is the rows"
                                                          if self.trained_rows == self.per_round else "")
                              + f"; {self.server} measures {self.measured_as}"}



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
            ENGINE.NAME, K, tuple(s.scenario.id for s, _ in served), len(findings), prediction.accept_length(K),
            Fraction(sum(m["completion_tokens"] for m in meta), verify),
            Fraction(sum(new for new, _ in findings), reference_rounds),
            1 + Fraction(correct, verify),
            _training_at_rounds(prediction, lane.trained.heldout_ids, [f for _, f in findings], K),
            (min(start_rows), max(start_rows)), reference_rounds,
            tuple(f.request.label for new, f in findings if f.acceptance_failure(new)), ENGINE.ACCEPT_LENGTH)
    return rows


def served_accept_rows(lane: ServedLane, prediction: Prediction) -> dict[int, AcceptRow]:
    """K -> its row for an engine in an environment of its own (served_lane.ServedLane: vLLM's), over its groups of
    the trained 1-layer draft in speculators' format (BRIDGE_GROUPS) and their scenarios whose requests stay within
    the held-out rows training scored (bridge_scenarios). `prediction`: speculators' on that draft."""
    rows = {}
    for group in bridge_groups():
        run = lane.run(group)
        if run.error:
            continue
        served = [(s, lane.findings(run, s)) for s in bridge_scenarios(lane, group, run)]
        findings = [f for _, fs in served for f in fs]
        if not findings:
            continue
        counters = [s.counters for s, _ in served]
        drafts, accepted = sum(c.get("drafts", 0) for c in counters), sum(c.get("accepted tokens", 0) for c in counters)
        reference = [a for f in findings for a in f.reference_accepted]
        start_rows = [r.last_row for f in findings for r in f.reference]
        per_round = 1 + Fraction(accepted, drafts) if drafts else Fraction(0)
        rows[group.K] = AcceptRow(
            lane.engine.NAME, group.K, tuple(s.scenario.id for s, _ in served), len(findings),
            prediction.accept_length(group.K), per_round, 1 + Fraction(sum(reference), len(reference)), per_round,
            _training_at_rounds(prediction, lane.trained[group.layers].heldout_ids, findings, group.K),
            (min(start_rows), max(start_rows)), len(reference),
            tuple(f.request.label for f in findings if f.counters_failure()), lane.engine.ACCEPT_LENGTH)
    return rows


def bridge_groups() -> list[ServedGroup]:
    """A served lane's groups the bridge reads: the trained 1-layer draft in speculators' format (the one
    speculators' prediction is of), unfaulted, one per K."""
    return [g for g in SERVED_GROUPS if g.layers == 1 and g.checkpoint_format == "speculators" and g.fault is None]


def bridge_scenarios(lane: ServedLane, group: ServedGroup, run) -> list:
    """The group's scenario runs whose every request stays within the held-out rows (prompt and new tokens):
    training scored nothing past them (the prefix-cache prompts of 65 and 66 tokens run past them)."""
    width = lane.trained[group.layers].heldout_ids.shape[1]
    return [s for s in run.scenarios.values()
            if all(p.length + s.scenario.new_tokens <= width for wave in s.scenario.waves for p in wave)]


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
            out.append(f"K = {K} ({', '.join(row.scenarios)}): {row.server} measured accept length {row.measured} "
                       f"({float(row.measured):.4f}), the reference simulation {row.simulated} "
                       f"({float(row.simulated):.4f}); requests whose accounting differs: "
                       f"{list(row.unequal_requests) or 'none'}")
        if row.trained_rows != row.per_round:
            out.append(f"K = {K} ({', '.join(row.scenarios)}): {row.server}'s per-round accept length {row.per_round} "
                       f"({float(row.per_round):.4f}), the trainer's training scores at the same {row.rounds} "
                       f"rounds' start rows " + ("none (a round is off the held-out rows training scored)"
                                                 if row.trained_rows is None else f"{row.trained_rows} "
                                                 f"({float(row.trained_rows):.4f})"))
    return out
