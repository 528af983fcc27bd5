"""A bf16 engine (scenarios.BF16_GROUPS: SGLang's real Engine with `dtype="bfloat16"`, chain of 3, the batch
scenario's prompts) held stage by stage under the bf16 error model (conformance/engine/bf16.py says how), and
meta tests that a real fault is not hidden by the bf16 bound: one planted in a bf16 engine through SGLang's own
source_patcher, two planted in the recorded rounds.

Heavy (an engine start, and the planted one, 10-60 s each on the 2-core host): marked `engine_full`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.core.sections import Section
from conformance.engine.bf16 import BF16, IMPL, bf16_findings, round_comparisons, side
from conformance.engine.faults import FAULT_PROMPT, HIDDEN_FROM_WRONG_ROW
from conformance.engine.lane import ENGINE
from conformance.engine.reporting import fault_row, served_scenario
from conformance.engine.scenarios import BF16_GROUPS, EngineGroup, Scenario

pytestmark = pytest.mark.engine_full

BF16_PARAMS = [pytest.param(g, s, id=s.id) for g in BF16_GROUPS for s in g.scenarios]

# The draft extend after verify hands the next round the hidden state of the row before the last accepted one
# (faults.HIDDEN_FROM_WRONG_ROW), in a bf16 engine: where the fp32 lane first diverges, so must this one.
BF16_FAULT = EngineGroup("chain_k3_bf16_hidden_from_wrong_row", steps=3, topk=1, draft_tokens=4, dtype="bfloat16",
                         fault_yaml=HIDDEN_FROM_WRONG_ROW, scenarios=(
                             Scenario("bf16_hidden_from_wrong_row", "bf16, planted: hidden state fed back from the "
                                      "wrong row", ((FAULT_PROMPT,),), new_tokens=10),))
BF16_FAULT_AT = (1, 1, "hidden_in")


def served(lane, group, scenario, report):
    return served_scenario(lane, group, scenario, report, findings=bf16_findings)


@pytest.mark.parametrize("group,scenario", BF16_PARAMS)
def test_bf16_served_as_asked(group, scenario, engine_lane, report):
    """SGLang resolved the dtype asked for (a silent fp32 engine would pass every check below trivially)."""
    run, _, _ = served(engine_lane, group, scenario, report)
    assert run.resolved.get("dtype") == group.dtype, run.resolved


@pytest.mark.parametrize("group,scenario", BF16_PARAMS)
def test_bf16_outputs_are_the_targets_greedy(group, scenario, engine_lane, report, repro):
    """Every served token is the fp64 target's argmax on the served context before it, but for ties the bf16
    logits bound cannot order; where none was excused, the output is the fp32 target's greedy continuation token
    for token; where transformers' bf16 greedy continuation parts from it, at a bf16 tie (bf16.py)."""
    _, _, findings = served(engine_lane, group, scenario, report)
    failures = [m for f in findings if (m := f.lossless_failure())]
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("group,scenario", BF16_PARAMS)
def test_bf16_rounds_stage_by_stage(group, scenario, engine_lane, report, repro):
    """Every round, every draft step, every captured stage against the fp64 reference draft fed that round's
    captured inputs, within the bf16 bound (rho from the bf16 reference on the same inputs); drafted tokens exact
    but for bf16 ties; aux_in against the target's aux states; accepted drafts as the served tokens imply."""
    _, _, findings = served(engine_lane, group, scenario, report)
    assert all(f.rounds for f in findings), "a request with no round compared"
    failures = [m for f in findings if (m := f.rounds_failure(repro))]
    results = [r for f in findings for c in f.rounds for r in c.results]
    excess = max((r.excess or 0.0, r.stage) for r in results)
    drafted = [r for r in results if r.stage == "target_ids"]
    print(f"bf16 rounds: {sum(len(f.rounds) for f in findings)} compared, "
          f"{sum(r.verdict == 'ok' for r in results)} stages within the bound, largest error/allowed "
          f"{excess[0]:.3g} at {excess[1]}; drafted tokens {len(drafted)}, "
          f"{sum('excused' in r.detail for r in drafted)} of them excused as bf16 ties; "
          + " | ".join(f.lossless_summary() for f in findings))
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("group,scenario", BF16_PARAMS)
def test_bf16_accept_accounting_is_its_own(group, scenario, engine_lane, report, repro):
    """SGLang's verify count, accepted-draft histogram and accept length equal its own captured rounds'."""
    _, _, findings = served(engine_lane, group, scenario, report)
    failures = [m for f in findings if (m := f.accounting_failure(scenario.new_tokens))]
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


def test_bf16_planted_serving_fault_is_caught(engine_lane, report, repro):
    """Meta: a bf16 engine whose draft extend feeds the next round the wrong row's hidden state fails the bf16
    comparison at the round, step and stage the fp32 lane names, while the same request unplanted conforms."""
    group, scenario = BF16_GROUPS[0], BF16_GROUPS[0].scenarios[0]
    _, _, clean = served(engine_lane, group, scenario, report)
    (clean,) = [f for f in clean if f.request.prompt == FAULT_PROMPT]
    assert clean.rounds_failure(repro) is None, clean.rounds_failure(repro)
    _, _, (planted,) = served(engine_lane, BF16_FAULT, BF16_FAULT.scenarios[0], report)
    hit = planted.first_divergent
    first = None if hit is None else hit[1].first_divergence
    report.add_row(Section.ENGINE_FAULTS, fault_row({
        "server": f"{ENGINE.NAME} engine (bf16)", "fault": BF16_FAULT.id, "how": BF16_FAULT.scenarios[0].summary,
        "lane failures": sum(m is not None for m in (planted.rounds_failure(repro), planted.lossless_failure())),
        "first divergence": "none" if first is None else f"round {hit[0]}, step {first.step} `{first.stage}`",
        "expected": "round {}, step {} `{}`".format(*BF16_FAULT_AT), "lossless": planted.lossless_failure() is None}))
    assert hit is not None, f"the bf16 comparison passed with the fault planted:\n{planted.rounds}"
    got = (hit[0], first.step, first.stage)
    assert got == BF16_FAULT_AT, f"first divergence {got}, expected {BF16_FAULT_AT}\n{hit[1].message(repro)}"


def _shift_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row replaced by the row before it (the first kept): a stage computed for the wrong token."""
    return torch.cat([t[:1], t[:-1]])


# Planted in the recorded rounds of the first request (round, which pass, stage, how), and where the comparison
# must first diverge (round, step, stage). The aux states are what the reference is fed: shifted, the draft
# stages after them still agree with the reference, and the hand-off check against the target must catch them.
RECORDED_PLANTS = {
    "aux_rows_shifted": ((0, "extend", "aux_in", _shift_rows), (0, 0, "aux_in")),
    "mlp_out_rows_shifted": ((1, "extend", "layers.0.mlp_out", _shift_rows), (1, 0, "layers.0.mlp_out")),
    "hidden_in_scaled_1.05": ((1, "decode", "hidden_in", lambda t: t * 1.05), (1, 1, "hidden_in")),
}


@pytest.mark.parametrize("plant", list(RECORDED_PLANTS))
def test_bf16_planted_captured_stage_is_caught(plant, engine_lane, report, repro):
    """Meta: one captured stage of one round perturbed (rows shifted by one: the bf16 sensitivity table's fault
    caught at every stage; 5 % on the hidden fed back) fails the bf16 comparison there and not before."""
    group, scenario = BF16_GROUPS[0], BF16_GROUPS[0].scenarios[0]
    _, scenario_run, findings = served(engine_lane, group, scenario, report)
    finding = findings[0]
    assert finding.rounds_failure(repro) is None, finding.rounds_failure(repro)
    (r, where, stage, perturb), expected = RECORDED_PLANTS[plant]
    rounds = list(finding.request.rounds)
    assert len(rounds) > r, f"{plant}: request 0 served {len(rounds)} rounds"
    passes = list(getattr(rounds[r], where))
    p = passes[0]
    assert stage in p.rows and p.rows[stage].shape[0] > (1 if "shift" in plant else 0), (
        f"{plant}: round {r}'s {where} pass has {p.rows.get(stage, torch.empty(0)).shape[0]} rows of {stage}")
    passes[0] = dataclasses.replace(p, rows={**p.rows, stage: perturb(p.rows[stage])})
    rounds[r] = dataclasses.replace(rounds[r], **{where: passes})
    comparisons, problems = round_comparisons(side(engine_lane), finding.request,
                                              engine_lane.prompt_ids(finding.request.prompt), group.steps,
                                              finding.case_id, rounds)
    assert not problems, problems
    hit = next(((i, c) for i, c in enumerate(comparisons) if c.first_divergence is not None), None)
    first = None if hit is None else hit[1].first_divergence
    report.add_row(Section.ENGINE_FAULTS, fault_row({
        "server": f"{ENGINE.NAME} engine (bf16)", "fault": f"recorded: {plant}",
        "how": f"{finding.case_id}: round {r}'s {where} pass, captured `{stage}` perturbed",
        "lane failures": sum(c.first_divergence is not None for c in comparisons),
        "first divergence": "none" if first is None else f"round {hit[0]}, step {first.step} `{first.stage}`",
        "expected": "round {}, step {} `{}`".format(*expected)}))
    assert hit is not None, f"{plant}: the bf16 comparison passed with the planted stage"
    got = (hit[0], hit[1].first_divergence.step, hit[1].first_divergence.stage)
    message = hit[1].message(repro)
    assert got == expected, f"{plant}: first divergence {got}, expected {expected}\n{message}"
    assert f"round {expected[0]}" in message and IMPL in message and "max abs error" in message, message
    assert BF16 == hit[1].dtype
