"""The CUDA engine lane's store and checks: the engine lane's chain scenarios (scenarios.py) served by SGLang's real
Engine on CUDA in every configuration of gpu_matrix.MATRIX, and what each run is held to.

Per configuration, per request of every chain scenario:
- served as asked: the attention backend, CUDA graphs, overlap scheduler, page size and dtype SGLang resolved are
  the configuration's (a silent override would test another configuration);
- against the reference's simulation (simulate.chain_rounds, fp32): outputs are the target's greedy continuation,
  the drafted tokens and accepted drafts of every round, and SGLang's verify count, accepted-draft histogram and
  accept length (findings.RequestFinding);
- against its eager twin (the same backend with CUDA graphs off, no overlap, page size 1): the same, token for
  token (twins.twin_failures).
The checks are functions of recorded runs, so that the CPU meta tests (conformance/meta/test_engine_gpu_matrix.py)
hold them to planted differences without a GPU.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from conformance.engine.findings import RequestFinding
from conformance.engine.gpu_matrix import GpuConfig
from conformance.engine.lane import EngineLane, GroupRun, ScenarioRun
from conformance.engine.scenarios import GROUPS, EngineGroup
from conformance.engine.twins import reference_tokens, round_differences, served_tokens, twin_failures

# The engine lane's chain groups, served as they are: the CUDA lane drafts chains (a tree's CUDA kernels are a
# lane of their own) and plants no fault in an engine.
CHAIN_GROUPS = tuple(g for g in GROUPS if g.chain and not g.env and not g.fault_yaml)
# The server arguments a configuration sets, as SGLang reports them resolved (engine.RESOLVED_FIELDS).
ASKED = ("attention_backend", "disable_cuda_graph", "disable_overlap_schedule", "page_size", "dtype")


class GpuEngineLane(EngineLane):
    """One configuration's engines, one per chain group, each started once; the reference side (target, reference
    draft, greedy continuations, simulations) is `shared`'s, computed once for every configuration."""

    def __init__(self, shared: EngineLane, config: GpuConfig, root: Path):
        super().__init__(shared.trained, root)
        self.shared, self.config = shared, config

    def own(self, group: EngineGroup) -> EngineGroup:
        """The group under this configuration's name (its capture folder, its report rows)."""
        return dataclasses.replace(group, id=f"{group.id}@{self.config.id}")

    def run(self, group: EngineGroup) -> GroupRun:
        return super().run(group if group.id.endswith(f"@{self.config.id}") else self.own(group))

    def start_engine(self, group: EngineGroup, capture: Path):
        from conformance.adapters import ADAPTERS, DEFAULT_SERVER

        served_engine = ADAPTERS[DEFAULT_SERVER].engine_cuda.CudaServedEngine
        return served_engine(self.trained.target_dir, self.trained.checkpoints["sglang"], capture,
                             {**group.server_args(), **self.config.server_args()})

    def greedy(self, prompt, new_tokens):
        return self.shared.greedy(prompt, new_tokens)

    def chain(self, prompt, steps, new_tokens):
        return self.shared.chain(prompt, steps, new_tokens)


def served_as_asked(config: GpuConfig, resolved: dict) -> list[str]:
    """Each server argument the configuration set that SGLang resolved to something else, one line each."""
    asked = config.server_args()
    return [f"{config.id}: asked {name}={asked[name]!r}, SGLang serves {resolved.get(name)!r}"
            for name in ASKED if resolved.get(name) != asked[name]]


def gpu_findings(lane: EngineLane, group: EngineGroup, scenario: ScenarioRun) -> list[RequestFinding]:
    """Per request: the served run with the target's greedy continuation and the reference's simulation, its
    conforming rounds the drafted-token comparison's (the capture holds no draft pass to compare stage by stage)."""
    new = scenario.scenario.new_tokens
    out = []
    for request in scenario.requests:
        reference = lane.chain(request.prompt, group.steps, new)
        served, ref = served_tokens(request.rounds), reference_tokens(reference)
        conforming = next((r for r, (a, b) in enumerate(zip(served, ref)) if a != b), min(len(served), len(ref)))
        out.append(RequestFinding(request, lane.greedy(request.prompt, new), reference, conforming, None))
    return out


def reference_failures(config: GpuConfig, scenario: ScenarioRun, findings: list[RequestFinding]) -> list[str]:
    """Outputs, the drafted tokens and accepted drafts of every round, and SGLang's accept accounting, against
    the reference's simulation of the same requests; each failure names configuration, scenario, request, round."""
    out = []
    for i, f in enumerate(findings):
        request = f"{config.id}: {scenario.scenario.id}, request {i}"   # the findings' messages name its prompt
        out += [f"{request}: {m}" for m in (f.lossless_failure(), f.acceptance_failure(scenario.scenario.new_tokens))
                if m]
        out += round_differences(f"{request} ({f.request.label})", served_tokens(f.request.rounds),
                                 reference_tokens(f.reference), (f"SGLang {config.id}", "the reference simulation"))
    return out


def eager_twin_failures(config: GpuConfig, scenario: ScenarioRun, twin: ScenarioRun) -> list[str]:
    """The same requests served by the configuration and by its eager twin, token for token."""
    return twin_failures(scenario.scenario.id, scenario.requests, twin.requests, (config.id, config.eager_twin.id))
