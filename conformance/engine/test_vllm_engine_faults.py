"""Meta: serving faults planted through vLLM's own code paths (a method of its proposer or model runner patched in the
engine's worker: conformance/adapters/vllm/engine_capture.py FAULTS) must fail the vLLM engine lane, its first
divergence at the named request, round, draft step and stage, while the same request served without the fault
conforms. The output stays lossless (the target verifies every draft): only the rounds show where."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from conformance.adapters import ADAPTERS
from conformance.core.sections import Section
from conformance.engine.scenarios import Prompt, Scenario
from conformance.engine.reporting import assert_fault_at_its_place, planted_fault_row
from conformance.engine.served_lane import GROUPS, ServedGroup

ENGINE = ADAPTERS["vllm"].engine
pytestmark = [pytest.mark.vllm_engine, pytest.mark.meta,
              pytest.mark.skipif(ENGINE.missing() is not None, reason=ENGINE.MISSING)]


@pytest.fixture(scope="session")
def vllm_engine(served_lanes):
    return served_lanes(ENGINE)

# One request the unfaulted lane serves too (chain_k3's batch scenario), as many new tokens.
FAULT_PROMPT = Prompt(5, 5)


@dataclass(frozen=True)
class PlantedFault:
    id: str                 # engine_capture.FAULTS
    summary: str
    round: int              # where the lane must first diverge
    step: int
    stage: str

    @property
    def group(self) -> ServedGroup:
        return ServedGroup(f"fault_{self.id}", 3, (Scenario(self.id, f"planted fault {self.id}", ((FAULT_PROMPT,),)),),
                           fault=self.id)


FAULTS = (
    PlantedFault("draft_positions_advanced", "EagleProposer._update_positions_dependent_metadata: each draft step's "
                 "positions one further than the slot it writes (a position bug of the draft loop)", 0, 1, "positions"),
    PlantedFault("aux_from_shallower_layers", "the runner's EAGLE-3 aux layers set one lower "
                 "(set_aux_hidden_state_layers after _setup_eagle3_aux_hidden_state_outputs)", 0, 0, "aux_in"),
    PlantedFault("sample_row_before_last", "EagleProposer.set_inputs_first_pass: step 0 samples (and hands step 1 "
                 "the hidden state of) the row before the last accepted one", 0, 0, "logits"),
)


@pytest.fixture(scope="module")
def unfaulted(vllm_engine):
    group = next(g for g in GROUPS if g.id == "chain_k3")
    run = vllm_engine.run(group)
    assert not run.error, run.error
    findings = vllm_engine.findings(run, run.scenarios["batch"])
    return next(f for f in findings if f.request.prompt == FAULT_PROMPT)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_planted_serving_fault_fails_the_lane(fault, unfaulted, vllm_engine, report, repro):
    assert unfaulted.divergence is None, f"without the fault the request already diverges:\n" \
                                         f"{unfaulted.rounds_failure(repro)}"
    run = vllm_engine.run(fault.group)
    assert not run.error, run.error
    failures = vllm_engine.failures(run, repro)
    (finding,) = vllm_engine.findings(run, next(iter(run.scenarios.values())))
    m = finding.request.served.meta.get("spec_decode") or {}
    accepted = finding.reference_accepted
    report.add_row(Section.ENGINE_FAULTS, planted_fault_row(
        f"{ENGINE.NAME} engine", fault, f"{fault.summary} ({run.planted})", finding, failures,
        m.get("mean_acceptance_length", 0), 1 + sum(accepted) / len(accepted)))
    assert_fault_at_its_place(fault, finding, failures, repro, "the vLLM engine lane")
