"""Meta: serving faults planted through SGLang's own mechanisms (conformance/engine/faults.py) must fail
the engine lane, its first divergence at the named request, round, draft step and stage, while the same
request served without the fault conforms."""
from __future__ import annotations

import pytest

from conformance.core.sections import Section
from conformance.engine.faults import CRASH, FAULT_PROMPT, FAULTS
from conformance.engine.findings import lane_failures, scenario_findings
from conformance.engine.lane import ENGINE
from conformance.engine.reporting import fault_row, record_group
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
    clean = unfaulted(engine_lane, report)
    assert clean.divergence is None, f"without the fault the request already diverges:\n{clean.rounds_failure(repro)}"
    run = engine_lane.run(fault.group)
    record_group(report, run, engine_lane.recorded)
    assert not run.error, run.error
    failures = lane_failures(engine_lane, run, repro)
    (finding,) = scenario_findings(engine_lane, run, next(iter(run.scenarios.values())))
    first = None if finding.divergence is None else finding.divergence.first_divergence
    report.add_row(Section.ENGINE_FAULTS, fault_row({
        "server": f"{ENGINE.NAME} engine", "fault": fault.id, "how": fault.summary, "lane failures": len(failures),
        "first divergence": "none" if first is None else
        f"round {finding.conforming_rounds}, step {first.step} `{first.stage}`",
        "expected": f"round {fault.round}, step {fault.step} `{fault.stage}`",
        "lossless": finding.lossless_failure() is None,
        "accept length served/ref": f"{finding.served_stats['accept_length']:.4g}/"
                                    f"{finding.reference_stats(fault.group.scenarios[0].new_tokens)['accept_length']:.4g}"}))
    assert failures, f"{fault.id}: the engine lane passed with the fault planted ({fault.summary})"
    assert first is not None, f"{fault.id}: no round diverged; the lane failed only on: {failures}"
    got = (finding.conforming_rounds, first.step, first.stage)
    assert got == (fault.round, fault.step, fault.stage), (
        f"{fault.id}: first divergence at round {got[0]}, step {got[1]} '{got[2]}', expected round {fault.round}, "
        f"step {fault.step} '{fault.stage}'\n{finding.divergence.message(repro)}")
    message = finding.rounds_failure(repro)
    assert f"round {fault.round}" in message and f"stage '{fault.stage}'" in message, message


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
