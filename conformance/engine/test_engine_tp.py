"""The engine lane at tensor parallelism 2: SGLang's real Engine with `tp_size=2` on CPU, each rank a scheduler
process of its own over gloo (SGLang's own CPU TP path: model_runner.py adjust_config_with_unaligned_cpu_tp,
gloo in distributed/parallel_state.py), held to the same oracle as TP 1 and to TP 1 itself.

Heavy (the two-rank engine starts in about 2.5 minutes on the 2-core host): marked `engine_full`, run by
`make engine-full`, never by `make test`.
"""
from __future__ import annotations

import pytest
import torch

from conformance.engine.findings import scenario_findings
from conformance.engine.lane import ENGINE
from conformance.engine.reporting import record_group
from conformance.engine.scenarios import FULL_GROUPS, SCENARIOS, TP_TWINS
from conformance.engine.served import served_rounds
from conformance.engine.twins import twin_failures

pytestmark = pytest.mark.engine_full

TP_PARAMS = [pytest.param(g, s, id=s.id) for g in FULL_GROUPS if g.tp_size > 1 for s in g.scenarios]


def served(lane, group, scenario, report):
    run = lane.run(group)
    record_group(report, run, lane.recorded)
    if run.error:
        pytest.fail(run.error, pytrace=False)
    scenario_run = run.scenarios[scenario.id]
    return run, scenario_run, scenario_findings(lane, run, scenario_run)


@pytest.mark.parametrize("group,scenario", TP_PARAMS)
def test_tp_outputs_acceptance_and_rounds_equal_reference(group, scenario, engine_lane, report, repro):
    """At TP 2 as at TP 1: outputs are the target's greedy continuation, SGLang's accept accounting equals
    the reference's simulation, every round (rank 0's capture) equals the reference stage by stage."""
    run, _, findings = served(engine_lane, group, scenario, report)
    assert run.resolved.get("tp_size", group.tp_size) == group.tp_size
    failures = [m for f in findings for m in (f.lossless_failure(), f.acceptance_failure(scenario.new_tokens),
                                              f.rounds_failure(repro)) if m]
    assert not failures, "\n\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("group,scenario", TP_PARAMS)
def test_tp_drafts_what_tp1_drafts(group, scenario, engine_lane, report, repro):
    """The drafted tokens and accepted drafts of every round, request by request, and SGLang's accept accounting,
    identical to the TP 1 engine serving the same prompts at the same flags (scenarios.TP_TWINS)."""
    _, scenario_run, _ = served(engine_lane, group, scenario, report)
    twin_group, twin = SCENARIOS[TP_TWINS[scenario.id]]
    _, twin_run, _ = served(engine_lane, twin_group, twin, report)
    failures = twin_failures(scenario.id, scenario_run.requests, twin_run.requests, (f"TP {group.tp_size}", "TP 1"))
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


def rank_disagreements(rank0: dict, other: dict, rank: int, head_sharded) -> list[str]:
    """Request by request, round by round, pass by pass: every stage that is not head-sharded (aux states
    received, the residual stream, logits after the all-gather) and the drafted tokens bitwise equal on
    `rank` and rank 0; the first difference per request is named by rank, round, step and stage."""
    out = []
    for rid, rounds in rank0.items():
        theirs = other.get(rid, [])
        if len(theirs) != len(rounds):
            out.append(f"rank {rank}, request {rid}: {len(theirs)} rounds, rank 0 {len(rounds)}")
            continue
        first = None
        for r, (a, b) in enumerate(zip(rounds, theirs)):
            for step, (pa, pb) in enumerate(zip(a.extend[-1:] + a.decode, b.extend[-1:] + b.decode)):
                for stage, value in pa.rows.items():
                    if stage.rsplit(".", 1)[-1] in head_sharded:
                        continue
                    got = pb.rows.get(stage)
                    if got is None or got.shape != value.shape or not torch.equal(got, value):
                        first = first or f"rank {rank}, request {rid}, round {r}, step {step}, stage `{stage}`"
            if a.tree["draft_tokens"].tolist() != b.tree["draft_tokens"].tolist():
                first = first or f"rank {rank}, request {rid}, round {r}, drafted tokens"
        if first:
            out.append(first + ": differs from rank 0")
    return out


@pytest.mark.parametrize("group,scenario", TP_PARAMS)
def test_tp_ranks_agree(group, scenario, engine_lane, report):
    """Each rank's scheduler captured its own rounds: every replicated stage and the drafted tokens of every
    rank equal rank 0's, bitwise (one rank drafting differently is a different drafter)."""
    from conformance.adapters import ADAPTERS, DEFAULT_SERVER

    served(engine_lane, group, scenario, report)
    capture = engine_lane.root / group.id
    rank0 = served_rounds(ENGINE.read_events(capture, 0), group.topk)
    assert rank0, "rank 0 captured no rounds"
    head_sharded = ADAPTERS[DEFAULT_SERVER].tensor_parallel.HEAD_SHARDED
    failures = []
    for rank in range(1, group.tp_size):
        other = served_rounds(ENGINE.read_events(capture, rank), group.topk)
        assert other, f"rank {rank} captured no rounds"
        failures += rank_disagreements(rank0, other, rank, head_sharded)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("group,scenario", TP_PARAMS)
def test_rank_disagreement_is_named(group, scenario, engine_lane, report):
    """Meta: a rank whose captured round differs from rank 0's in one replicated stage (planted in rank 1's
    recorded rounds: the second round's step-0 `fc_out` of the first request) fails the check above, named
    by rank, request, round, step and stage."""
    from conformance.adapters import ADAPTERS, DEFAULT_SERVER

    served(engine_lane, group, scenario, report)
    capture = engine_lane.root / group.id
    rank0 = served_rounds(ENGINE.read_events(capture, 0), group.topk)
    planted = served_rounds(ENGINE.read_events(capture, 1), group.topk)
    rid = next(iter(rank0))
    last = planted[rid][1].extend[-1]
    last.rows["fc_out"] = last.rows["fc_out"] + 1e-6
    found = rank_disagreements(rank0, planted, 1, ADAPTERS[DEFAULT_SERVER].tensor_parallel.HEAD_SHARDED)
    assert found == [f"rank 1, request {rid}, round 1, step 0, stage `fc_out`: differs from rank 0"], found
