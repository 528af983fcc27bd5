"""Meta: serving faults planted through SGLang's own mechanisms (conformance/engine/faults.py) must fail
the engine lane, its first divergence at the named request, round, draft step and stage, while the same
request served without the fault conforms."""
from __future__ import annotations

import pytest

from conformance.engine.faults import CRASH, FAULT_PROMPT, FAULTS
from conformance.engine.findings import scenario_findings
from conformance.engine.reporting import assert_planted_fault_named, record_group
from conformance.engine.scenarios import GROUPS

pytestmark = [pytest.mark.engine, pytest.mark.meta]


def unfaulted(lane, report):
    """The fault's request as the lane serves it without a fault (chain_k3, the batch scenario)."""
    group = next(g for g in GROUPS if g.id == "chain_k3")
    run = lane.run(group)
    record_group(report, run, lane.recorded)
    assert not run.error, run.error
    scenario = run.scenarios["batch"]
    return next(f for f in scenario_findings(lane, run, scenario) if f.request.prompt == FAULT_PROMPT)


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_planted_serving_fault_fails_the_lane(fault, engine_lane, report, repro):
    assert_planted_fault_named(engine_lane, fault, unfaulted(engine_lane, report), report, repro)


def test_scheduler_crash_fails_its_group_in_one_line(engine_lane, report):
    """A scheduler that fails while serving fails its own group with one line; the session goes on (SGLang's
    default would kill this process) and no SGLang process is left behind."""
    import psutil

    run = engine_lane.run(CRASH)
    record_group(report, run, engine_lane.recorded)
    assert run.error and "EngineFailed" in run.error and "\n" not in run.error, run.error
    # An exited child not yet reaped by multiprocessing is a zombie: gone, not running.
    left = [p.name() for p in psutil.Process().children(recursive=True)
            if p.name().startswith("sglang::") and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"SGLang processes left running: {left}"
