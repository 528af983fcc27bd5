"""The engine lane on an MLA draft: SGLang's real `Engine` serving a tiny DeepSeek-V3 target with an EAGLE-3 draft whose
attention is DeepSeek's multi-head latent attention (the layout Kimi-K2.5/K2.6 drafts are served with), trained by NeMo
Automodel's own training code (trained_draft.MLA_RECIPE) and loaded by SGLang's Eagle3DeepseekV2ForCausalLM from the
sglang-mla layout. test_engine.py holds it to the reference exactly, as it holds the Llama draft: lossless outputs,
SGLang's measured acceptance equal to the reference's simulation, and every round stage by stage over the stages
SGLang's MLA draft has (adapters/sglang/engine_mla.py). Here: that the capture saw every one of those stages, and that a
fault planted in SGLang's MLA draft layer fails the lane at its round and stage.
"""
from __future__ import annotations

import pytest

from conformance.adapters.sglang.engine_mla import ENGINE_CLAIMED
from conformance.engine.faults import MLA_FAULT_PROMPT, MLA_FAULTS
from conformance.engine.reporting import assert_planted_fault_named, served_scenario as served
from conformance.engine.scenarios import MLA_GROUPS

pytestmark = pytest.mark.engine

ALL = [pytest.param(g, s, id=s.id) for g in MLA_GROUPS for s in g.scenarios]


@pytest.mark.meta
@pytest.mark.parametrize("group,scenario", ALL)
def test_every_mla_stage_is_captured(group, scenario, mla_engine_lane, report):
    """The capture saw every stage SGLang's MLA draft has, at the passes that compute it, and nothing else: a hook
    that stopped firing would leave a stage out of the comparison without failing it."""
    _, scenario_run, _ = served(mla_engine_lane, group, scenario, report)
    # step 0 is fed the target's aux states and runs fc (after fc_norm, when the draft has one); a decode pass is fed
    # the hidden and skips fc; target_ids come from what draft() hands to verification, not from a pass
    at_step0 = ENGINE_CLAIMED - {"hidden_in", "target_ids"} - (set() if mla_engine_lane.trained.config.fc_norm
                                                               else {"fc_in_norm"})
    at_decode = ENGINE_CLAIMED - {"aux_in", "fc_in_norm", "fc_out", "target_ids"}
    for request in scenario_run.requests:
        assert request.rounds, f"{request.label}: no round captured"
        first = request.rounds[0]
        step0 = {name.rsplit(".", 1)[-1] for p in first.extend for name in (*p.rows, *p.selected)}
        decode = {name.rsplit(".", 1)[-1] for p in first.decode for name in p.rows}
        assert step0 == at_step0, f"{request.label}, step 0: captured but not claimed or the reverse: " \
                                  f"{sorted(step0 ^ at_step0)}"
        assert decode == at_decode, f"{request.label}, decode: {sorted(decode ^ at_decode)}"
        assert first.decode and len(first.decode) == group.steps - 1, f"{request.label}: {len(first.decode)} decodes"


@pytest.mark.meta
@pytest.mark.parametrize("fault", MLA_FAULTS, ids=[f.id for f in MLA_FAULTS])
def test_planted_mla_fault_fails_the_lane(fault, mla_engine_lane, report, repro):
    group, scenario = MLA_GROUPS[0], MLA_GROUPS[0].scenarios[0]
    _, _, findings = served(mla_engine_lane, group, scenario, report)
    clean = next(f for f in findings if f.request.prompt == MLA_FAULT_PROMPT)
    assert_planted_fault_named(mla_engine_lane, fault, clean, report, repro)
