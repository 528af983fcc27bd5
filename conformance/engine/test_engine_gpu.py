"""The engine lane on CUDA: SGLang's real Engine serving the engine lane's chain scenarios in every configuration of
conformance/engine/gpu_matrix.py (Triton, FA3 and FlashInfer attention; CUDA graphs on and off; the overlap
scheduler on and off; page size 1 and 16), no CPU shim. Per configuration and request: served as asked; the drafted
tokens of every round, the accepted-draft histogram and the accept length equal the reference's simulation and the
configuration's eager, non-overlap, page-1 twin, token for token (conformance/engine/gpu_lane.py).

Runs only on a CUDA runner with SGLang's CUDA kernels (requirements-gpu.lock, `make engine-gpu`); elsewhere every
test skips with one line, an error under --require-gpu (conformance/plugin.py). It has never run on the hosts this
suite is developed on (no CUDA kernels there); its checks are held to planted differences on CPU by
conformance/meta/test_engine_gpu_matrix.py.
"""
from __future__ import annotations

import pytest
import torch

from conformance.engine.gpu_lane import (
    CHAIN_GROUPS, eager_twin_failures, gpu_findings, reference_failures, served_as_asked,
)
from conformance.engine.gpu_matrix import MATRIX
from conformance.engine.reporting import record_group, record_request

pytestmark = [pytest.mark.engine, pytest.mark.gpu]

CONFIG_GROUPS = [pytest.param(c, g, id=f"{c.id}:{g.id}") for c in MATRIX for g in CHAIN_GROUPS]
SCENARIOS = [pytest.param(c, g, s, id=f"{c.id}:{s.id}") for c in MATRIX for g in CHAIN_GROUPS for s in g.scenarios]


def served(gpu_lanes, config, group, report):
    """The configuration's run of the group; a GPU that cannot serve the configuration skips, an engine that did
    not start or serve fails the test with SGLang's own words."""
    if why := config.unavailable(torch.cuda.get_device_capability()):
        pytest.skip(why)
    lane = gpu_lanes(config)
    run = lane.run(group)
    record_group(report, run, lane.recorded)
    if run.error:
        pytest.fail(f"{config.id}: {run.error}", pytrace=False)
    return lane, run


@pytest.mark.parametrize("config,group", CONFIG_GROUPS)
def test_configuration_is_served_as_asked(config, group, gpu_lanes, report):
    """The attention backend, CUDA graphs, overlap scheduler, page size and dtype SGLang resolved are the
    configuration's: a silent override would make every check below test another configuration."""
    _, run = served(gpu_lanes, config, group, report)
    failures = served_as_asked(config, run.resolved)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("config,group,scenario", SCENARIOS)
def test_rounds_equal_reference_simulation(config, group, scenario, gpu_lanes, report, repro):
    """Outputs, the drafted tokens and accepted drafts of every round, and SGLang's verify count, accepted-draft
    histogram and accept length equal the reference's simulation of the same requests."""
    lane, run = served(gpu_lanes, config, group, report)
    scenario_run = run.scenarios[scenario.id]
    findings = gpu_findings(lane, group, scenario_run)
    for f in findings:
        record_request(report, f"{scenario.id}@{config.id}", f, scenario.new_tokens)
    failures = reference_failures(config, scenario_run, findings)
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("config,group,scenario", [p for p in SCENARIOS if not p.values[0].is_eager_twin])
def test_rounds_equal_eager_twin(config, group, scenario, gpu_lanes, report, repro):
    """The same requests served by the configuration and by its eager twin (same backend and dtype, CUDA graphs
    off, overlap off, page size 1): drafted tokens and accepted drafts of every round, verify count, histogram and
    accept length, token for token."""
    _, run = served(gpu_lanes, config, group, report)
    _, twin = served(gpu_lanes, config.eager_twin, group, report)
    failures = eager_twin_failures(config, run.scenarios[scenario.id], twin.scenarios[scenario.id])
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"
