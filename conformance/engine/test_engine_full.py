"""The engine lane's heavy configurations (scenarios.FULL_GROUPS), held to the same oracle as the default engine and
to the default engine itself (scenarios.TWINS): tensor parallelism 2, SGLang's real Engine with `tp_size=2` on CPU,
each rank a scheduler process of its own over gloo (SGLang's own CPU TP path: model_runner.py
adjust_config_with_unaligned_cpu_tp, gloo in distributed/parallel_state.py), and paged KV (`page_size=16`, the
Triton backend's paged path and page-granular radix matching).

Heavy (the two-rank engine starts in about 2.5 minutes on the 2-core host): marked `engine_full`, run by
`make engine-full`, never by `make test`.
"""
from __future__ import annotations

import pytest
import torch

from conformance.engine.lane import ENGINE
from conformance.engine.reporting import served_scenario as served
from conformance.engine.scenarios import FULL_GROUPS, SCENARIOS, TWINS
from conformance.engine.served import served_rounds
from conformance.engine.twins import twin_failures

pytestmark = pytest.mark.engine_full

FULL_PARAMS = [pytest.param(g, s, id=s.id) for g in FULL_GROUPS for s in g.scenarios]
TWIN_PARAMS = [p for p in FULL_PARAMS if p.values[1].id in TWINS]
TP_PARAMS = [p for p in FULL_PARAMS if p.values[0].tp_size > 1]


@pytest.mark.parametrize("group,scenario", FULL_PARAMS)
def test_outputs_acceptance_and_rounds_equal_reference(group, scenario, engine_lane, report, repro):
    """At TP 2 or page size 16 as by default: outputs are the target's greedy continuation, SGLang's accept
    accounting equals the reference's simulation, every round (rank 0's capture) equals the reference stage by
    stage; SGLang serves the TP size and page size asked for."""
    run, _, findings = served(engine_lane, group, scenario, report)
    assert run.resolved.get("tp_size", group.tp_size) == group.tp_size
    assert run.resolved.get("page_size") == group.page_size, run.resolved
    failures = [m for f in findings for m in (f.lossless_failure(), f.acceptance_failure(scenario.new_tokens),
                                              f.rounds_failure(repro)) if m]
    assert not failures, "\n\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("group,scenario", TWIN_PARAMS)
def test_drafts_what_the_default_engine_drafts(group, scenario, engine_lane, report, repro):
    """The drafted tokens and accepted drafts of every round, request by request, and SGLang's accept accounting,
    identical to the default engine (TP 1, page size 1) serving the same prompts at the same flags
    (scenarios.TWINS)."""
    _, scenario_run, _ = served(engine_lane, group, scenario, report)
    twin_group, twin = SCENARIOS[TWINS[scenario.id]]
    _, twin_run, _ = served(engine_lane, twin_group, twin, report)
    names = (f"TP {group.tp_size}", "TP 1") if group.tp_size > 1 else (f"page size {group.page_size}", "page size 1")
    failures = twin_failures(scenario.id, scenario_run.requests, twin_run.requests, names)
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("group,scenario", [p for p in FULL_PARAMS if p.values[0].page_size > 1
                                             and len(p.values[1].waves) > 1])
def test_paged_radix_hits_are_whole_pages(group, scenario, engine_lane, report):
    """A prompt served again after its request finished hits the radix cache in whole pages (SGLang's
    cached_tokens a positive multiple of the page size), and the run above held it to the reference."""
    _, scenario_run, _ = served(engine_lane, group, scenario, report)
    later = scenario_run.requests[len(scenario.waves[0]):]
    hits = {r.label: r.served.meta.get("cached_tokens") for r in later}
    assert all(h and h % group.page_size == 0 for h in hits.values()), (
        f"{scenario.id}: cached tokens per request of the later waves {hits}, page size {group.page_size}")


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
