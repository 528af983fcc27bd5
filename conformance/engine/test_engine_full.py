"""The engine lane's heavy configurations (scenarios.FULL_GROUPS), held to the same oracle as the default engine and
to the default engine itself (scenarios.TWINS): tensor parallelism 2, SGLang's real Engine with `tp_size=2` on CPU,
each rank a scheduler process of its own over gloo (SGLang's own CPU TP path: model_runner.py
adjust_config_with_unaligned_cpu_tp, gloo in distributed/parallel_state.py), paged KV (`page_size=16`, the
Triton backend's paged path and page-granular radix matching), a KV pool small enough that the radix cache evicts
(`max_total_tokens`), and the trained draft in two decoder layers (the registry's draft entries for it, on the
real worker).

Heavy (the two-rank engine starts in about 2.5 minutes on the 2-core host): marked `engine_full`, run by
`make engine-full`, never by `make test`.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER, REFERENCE
from conformance.core.matching import KnownDivergenceHit, match_forward, settle
from conformance.core.areas import SERVER_FLAGS
from conformance.core.registry import applicable
from conformance.engine.check import first_divergent_round
from conformance.engine.findings import RequestFinding, drafter_failure
from conformance.engine.lane import ENGINE, EngineLane, Request
from conformance.engine.reporting import record_request, served_scenario as served
from conformance.engine.scenarios import FULL_GROUPS, SCENARIOS, TWINS, Prompt, Scenario
from conformance.engine.served import served_rounds
from conformance.engine.simulate import chain_rounds
from conformance.engine.twins import twin_failures
from conformance.session.harness import set_ones
from fixtures.checkpoint import edited_copy

pytestmark = pytest.mark.engine_full

FULL_PARAMS = [pytest.param(g, s, id=s.id) for g in FULL_GROUPS for s in g.scenarios]
ONE_LAYER = [p for p in FULL_PARAMS if p.values[0].draft_layers == 1]
LAYERED = [p for p in FULL_PARAMS if p.values[0].draft_layers > 1]
TWIN_PARAMS = [p for p in FULL_PARAMS if p.values[1].id in TWINS]
TP_PARAMS = [p for p in FULL_PARAMS if p.values[0].tp_size > 1]
POOL_PARAMS = [p for p in FULL_PARAMS if p.values[0].max_total_tokens]


@pytest.mark.parametrize("group,scenario", ONE_LAYER)
def test_outputs_acceptance_and_rounds_equal_reference(group, scenario, engine_lane, report, repro):
    """At TP 2, page size 16 or a small KV pool as by default: outputs are the target's greedy continuation, SGLang's
    accept accounting equals the reference's simulation, every round (rank 0's capture) equals the reference stage
    by stage; SGLang serves the TP size and page size asked for."""
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


@pytest.mark.parametrize("group,scenario", FULL_PARAMS)
def test_the_drafter_is_named(group, scenario, engine_lane_for, report):
    """The report names the speculative worker class SGLang's scheduler built for each heavy engine (for the 2-layer
    draft too: speculative/spec_info.py create_worker picks it from the flags), and it is the one whose rounds the
    capture observed."""
    run, _, _ = served(engine_lane_for(group), group, scenario, report)
    assert (failure := drafter_failure(run)) is None, failure


# ---------------------------------------------------------------- radix-cache eviction (a small KV pool)

def whole_hit(prompt: Prompt) -> int:
    """The most of a prompt SGLang's radix cache can hit (cached_tokens): every token but the last, which it recomputes
    for the logits (schedule_batch.py _compute_max_prefix_len), and with EAGLE one fewer, its tree being keyed by
    bigrams of raw tokens (radix_cache.py RadixKey, maybe_to_bigram_view: N raw tokens are N - 1 bigrams)."""
    return prompt.length - 2


def eviction_failures(scenario: Scenario, requests: list[Request]) -> list[str]:
    """The last wave's requests by where their prompt was served before: a prompt last served before the evicting
    wave (the one before last) must hit less than whole (it was evicted); one served in the evicting wave must hit
    whole. A last wave without one of each is itself a failure (the scenario would show nothing)."""
    *earlier, evicting, last = scenario.waves
    older = {p for wave in earlier for p in wave} - set(evicting)
    again = requests[len(requests) - len(last):]
    evicted = [r for r in again if r.prompt in older]
    kept = [r for r in again if r.prompt in evicting]
    out = [] if evicted and kept else [
        f"{scenario.id}: its last wave serves {len(evicted)} prompt(s) of the waves before the evicting one and "
        f"{len(kept)} of the evicting wave; the check needs one of each"]
    for r in evicted:
        cached = r.served.meta.get("cached_tokens")
        if cached is None or cached >= whole_hit(r.prompt):
            out.append(f"{scenario.id}, {r.label}: served again after the evicting wave, cached_tokens {cached}: "
                       f"not evicted (a whole hit is {whole_hit(r.prompt)})")
    for r in kept:
        cached = r.served.meta.get("cached_tokens")
        if cached != whole_hit(r.prompt):
            out.append(f"{scenario.id}, {r.label}: served again right after the evicting wave, cached_tokens "
                       f"{cached}, a whole hit is {whole_hit(r.prompt)}")
    return out


@pytest.mark.parametrize("group,scenario", POOL_PARAMS)
def test_evicted_prompt_misses_the_radix_cache(group, scenario, engine_lane_for, report, repro):
    """The small pool is what it claims: SGLang sized its KV pool as asked (the scheduler's max_total_num_tokens), the
    first prompt, evicted by the later wave's longer requests, misses the radix cache when served again, and a prompt
    of that later wave still hits whole (SGLang's cached_tokens); test_outputs_acceptance_and_rounds_equal_reference
    holds every one of these requests, the re-served ones included, to the reference."""
    run, scenario_run, findings = served(engine_lane_for(group), group, scenario, report)
    for f in findings:
        record_request(report, scenario.id, f, scenario.new_tokens)
    assert run.resolved.get("max_total_num_tokens") == group.max_total_tokens, run.resolved
    failures = eviction_failures(scenario, scenario_run.requests)
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("group,scenario", POOL_PARAMS)
def test_eviction_check_catches_a_hit_and_a_miss(group, scenario, engine_lane_for, report):
    """Meta: the check above fails, naming the request, when the re-served first prompt hit whole (no eviction:
    planted in its meta_info) and when the evicting wave's prompt missed (planted likewise)."""
    _, scenario_run, _ = served(engine_lane_for(group), group, scenario, report)
    requests = scenario_run.requests
    last = requests[len(requests) - len(scenario.waves[-1]):]
    for i, r in enumerate(last):
        first_seen = next(w for w, wave in enumerate(scenario.waves) if r.prompt in wave)
        planted = whole_hit(r.prompt) if first_seen < len(scenario.waves) - 2 else 0
        meta = {**r.served.meta, "cached_tokens": planted}
        swapped = dataclasses.replace(r, served=dataclasses.replace(r.served, meta=meta))
        found = eviction_failures(scenario, requests[:len(requests) - len(last)] + [
            swapped if j == i else q for j, q in enumerate(last)])
        assert len(found) == 1 and r.label in found[0] and f"cached_tokens {planted}" in found[0], (i, found)


# ---------------------------------------------------------------- a 2-layer draft

def known_draft_entries(lane: EngineLane) -> tuple:
    """The registry's draft-forward entries for SGLang on this trained draft (its knobs; no server flag set)."""
    names = {**dataclasses.asdict(lane.trained.config), **{flag: None for flag in SERVER_FLAGS}}
    return applicable("draft", DEFAULT_SERVER, names)


def as_sglang_loads_it(lane: EngineLane, entry) -> object:
    """The reference draft with the entry's `neutral_weights` set to ones: for `sglang-hidden-norm-on-later-layers`,
    the unit hidden_norm SGLang applies to layers >= 1 (never loaded) in place of their trained input_layernorm. What
    SGLang's worker computes if the entry is the whole story."""
    key = ("as sglang loads it", entry.id)
    if key not in lane.memo:
        unit = functools.partial(set_ones, patterns=entry.neutral_weights, where=f"the trained draft ({entry.id})")
        path = edited_copy(lane.trained.checkpoints["speculators"], lane.root / f"unit-weights-{entry.id}", unit)
        lane.memo[key] = ADAPTERS[REFERENCE]().load(path, torch.float32)
    return lane.memo[key]


@pytest.mark.parametrize("group,scenario", LAYERED)
def test_multi_layer_outputs_are_the_targets_greedy_continuation(group, scenario, engine_lane_for, report, repro):
    """Whatever the draft drafts, greedy verification keeps the output lossless: every output equals transformers'
    generate."""
    _, _, findings = served(engine_lane_for(group), group, scenario, report)
    failures = [m for f in findings if (m := f.lossless_failure())]
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


def settle_layered(lane: EngineLane, group, scenario: Scenario, findings: list[RequestFinding], known: tuple,
                   repro: str) -> None:
    """Pass when every request conforms and no entry applies; KnownDivergenceHit only when every request leaves the
    reference in its first round at exactly the deciding entry's step and stage and equals, round for round and in
    SGLang's accept accounting, the reference on the draft as SGLang loads it; any other outcome (a conforming
    request where an entry applies, another place, a later round, a round the entry does not explain) fails with the
    full message."""
    __tracebackhide__ = True
    layers = lane.trained.config.num_hidden_layers
    hits = []
    for i, f in enumerate(findings):
        first = None if f.divergence is None else f.divergence.first_divergence
        if first is None:
            if failure := f.rounds_failure(repro) or f.acceptance_failure(scenario.new_tokens):
                raise AssertionError(failure)
            if known:
                raise AssertionError(f"{f.request.label}: every round conforms, yet the registry says SGLang "
                                     f"diverges here: {'; '.join(e.describe() for e in known)}\n  repro: {repro}")
            continue
        hit = match_forward(known, first, layers)
        if not hit or f.conforming_rounds != 0:
            raise AssertionError(f.divergence.message(repro))
        explained = chain_rounds(as_sglang_loads_it(lane, hit), lane.target, torch.tensor(f.request.served.prompt),
                                 group.steps, scenario.new_tokens, lane.trained.config.aux_layer_ids)
        case = f"{scenario.id}, request {i} (seq {f.request.prompt.seq}) vs the draft as SGLang loads it"
        as_loaded = RequestFinding(f.request, f.greedy, explained, *first_divergent_round(f.request.rounds, explained,
                                                                                          case))
        if failure := as_loaded.rounds_failure(repro) or as_loaded.acceptance_failure(scenario.new_tokens):
            raise AssertionError(f"{f.divergence.message(repro)}\n  and against the draft as SGLang loads it "
                                 f"({hit.id}'s neutral_weights set to ones):\n{failure}")
        hits.append((hit, f))
    if hits:
        entry, f = hits[0]
        settle(f"{len(hits)} of {len(findings)} requests leave the reference in round 0 at the registered step and "
               f"stage, each equal round for round (and in SGLang's accept accounting) to the reference on the draft "
               f"as SGLang loads it; the first:\n{f.divergence.message(repro)}", entry)


@pytest.mark.parametrize("group,scenario", LAYERED)
def test_multi_layer_rounds_vs_reference(group, scenario, engine_lane_for, report, repro, request):
    """Every round stage by stage against the reference (speculators' training semantics), and SGLang's accept
    accounting against its simulation. The registry's draft entries are read at run time (they need the trained
    draft's knobs); when one applies (SGLang 0.5.20-0.5.23, more than one layer: `sglang-hidden-norm-on-later-layers`,
    step 0 `layers.1.hidden_norm`), the test is a strict xfail that only this satisfies: every request leaves the
    reference in its first round at exactly the entry's step and stage, and equals, round for round and in SGLang's
    accept accounting, the reference on the draft as SGLang loads it (the entry's neutral_weights set to ones)."""
    lane = engine_lane_for(group)
    _, _, findings = served(lane, group, scenario, report)
    known = known_draft_entries(lane)
    if known:
        request.applymarker(pytest.mark.xfail(strict=True, raises=KnownDivergenceHit,
                                              reason="; ".join(e.describe() for e in known)))
    for f in findings:
        record_request(report, scenario.id, f, scenario.new_tokens)
    settle_layered(lane, group, scenario, findings, known, repro)


def planted_finding(lane: EngineLane, f: RequestFinding, round_: int, stage: str, case: str) -> RequestFinding:
    """`f` with its served round `round_`'s step-0 `stage` moved by 1e-3 (its last pass's rows), compared anew."""
    rounds = copy.deepcopy(f.request.rounds)
    last = rounds[round_].extend[-1]
    last.rows[stage] = last.rows[stage] + 1e-3
    request = dataclasses.replace(f.request, rounds=rounds)
    return RequestFinding(request, f.greedy, f.reference, *first_divergent_round(rounds, f.reference, case))


@pytest.mark.parametrize("group,scenario", LAYERED)
def test_layered_check_rejects_other_divergences(group, scenario, engine_lane_for, report):
    """Meta: the strict xfail above is satisfied by the registered divergence only. Planted in the first request's
    served rounds: its round-1 step-0 `fc_out` moved (the first divergence is still the registered one, but the round
    no longer equals the draft as SGLang loads it), and its round-0 step-0 `embeds` moved (a divergence before the
    registered stage): each fails as a plain failure naming the planted round and stage, not as the known hit."""
    lane = engine_lane_for(group)
    _, _, findings = served(lane, group, scenario, report)
    known = known_draft_entries(lane)
    assert known, "no registry entry applies to the 2-layer draft: nothing to plant against"
    with pytest.raises(KnownDivergenceHit):
        settle_layered(lane, group, scenario, findings, known, "repro")
    for round_, stage, named in ((1, "fc_out", "round 1"), (0, "embeds", "round 0")):
        planted = planted_finding(lane, findings[0], round_, stage, f"{scenario.id}, planted {stage}")
        with pytest.raises(AssertionError) as caught:
            settle_layered(lane, group, scenario, [planted] + findings[1:], known, "repro")
        message = str(caught.value)
        assert not isinstance(caught.value, KnownDivergenceHit), f"planted {stage}: taken for the known hit"
        assert named in message and f"'{stage}'" in message, f"planted {stage}:\n{message}"
