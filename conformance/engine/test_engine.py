"""The engine lane: SGLang's real `Engine` (scheduler, EAGLE-3 spec-v2 worker, radix cache, chunked
prefill, its own accept accounting) serving the trained tiny draft greedily in fp32 on CPU, held to the
reference exactly: outputs, SGLang's measured accept length, and every round stage by stage.

Each engine group (scenarios.py) is started once per session and shut down once served. The shims
its scheduler process needs are in conformance/adapters/sglang/engine_shims.py and in the report.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from conformance.adapters.sglang.drafting import row_slot_kv
from conformance.core.matching import KnownDivergenceHit, match_forward, settle
from conformance.core.registry import applicable
from conformance.core.sections import Section
from conformance.acceptance.trained_draft import TRAINERS
from conformance.adapters import DEFAULT_TRAINER
from conformance.engine.bridge import accept_rows, bridge_failures, other_trainer_groups, served_ks
from conformance.engine.check import compare_tree_round
from conformance.engine.findings import drafter_failure
from conformance.engine.reporting import served_scenario as served, record_accept_rows, record_group, record_request
from conformance.engine.scenarios import GROUPS, MLA_GROUPS
from reference.tree import ancestors

pytestmark = pytest.mark.engine


@pytest.fixture
def lane(request, group):
    """The engine lane that serves `group` (its trained draft: the Llama draft's lane, or the MLA draft's)."""
    return request.getfixturevalue(LANES.get(group.id, "engine_lane"))

ALL = [pytest.param(g, s, id=s.id) for g in GROUPS for s in g.scenarios]
# Every scenario the lane's core checks run on: the Llama draft's, and the MLA draft's (test_engine_mla.py has its own
# meta tests), each served by its lane (LANES).
SERVED = ALL + [pytest.param(g, s, id=s.id) for g in MLA_GROUPS for s in g.scenarios]
LANES = {g.id: "mla_engine_lane" for g in MLA_GROUPS}   # group -> its lane fixture, when not engine_lane
TREE_GROUPS = [g for g in GROUPS if not g.chain]


@pytest.mark.parametrize("group,scenario", SERVED)
def test_outputs_are_the_targets_greedy_continuation(group, scenario, lane, report, repro):
    """Greedy speculative decoding is lossless: every output equals transformers' generate."""
    _, _, findings = served(lane, group, scenario, report)
    failures = [m for f in findings if (m := f.lossless_failure())]
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("group", [*GROUPS, *MLA_GROUPS], ids=lambda g: g.id)
def test_an_engine_leaves_no_files_behind(group, lane):
    """Each engine's IPC files are made in its own directory and removed with it at shutdown."""
    failure = lane.run(group).leftovers_failure()
    assert failure is None, failure


@pytest.mark.parametrize("group,scenario", SERVED)
def test_sglang_accept_accounting_equals_reference(group, scenario, lane, report, repro):
    """SGLang's own meta_info (spec_verify_ct, spec_correct_drafts_histogram, spec_accept_length) equals the
    reference draft's simulation of the same request (chain: draft_and_verify; tree: the exact tree)."""
    _, run, findings = served(lane, group, scenario, report)
    for f in findings:
        record_request(report, scenario.id, f, scenario.new_tokens)
    failures = [m for f in findings if (m := f.acceptance_failure(scenario.new_tokens))]
    assert not failures, "\n".join(failures) + f"\n  repro: {repro}"


@pytest.mark.parametrize("group,scenario", [p for p in SERVED if p.values[0].chain])
def test_served_rounds_equal_reference_stage_by_stage(group, scenario, lane, report, repro):
    """Every round of every request: the positions the worker gave each pass, the hand-off (the target's
    aux states and the ids it embeds at step 0, the recurrent hidden at steps >= 1), every draft stage,
    the drafted tokens and the accepted drafts equal the reference's on the same context."""
    _, _, findings = served(lane, group, scenario, report)
    failures = [m for f in findings if (m := f.rounds_failure(repro))]
    assert not failures, "\n\n".join(failures)


def known_tree_entries(trained, group) -> tuple:
    """The registry's tree entries for this served tree (the trained draft's knobs, the tree's shape)."""
    names = {**dataclasses.asdict(trained.config), "topk": group.topk, "steps": group.steps,
             "num_draft_tokens": group.draft_tokens}
    return tuple(e for e in applicable("tree", "sglang", names) if e.step < group.steps)


@pytest.mark.parametrize("group,scenario", [pytest.param(g, s, id=s.id) for g in TREE_GROUPS for s in g.scenarios])
def test_served_tree_rounds_vs_exact_tree(group, scenario, engine_lane, report, repro, request):
    """Trees served by SGLang's worker against the exact tree (every node attends to its ancestors). A
    round may leave it only where the registry says (the model-level tree KV layout) and must then equal
    the reference with SGLang's row-slot KV everywhere: the claimed divergence, shown on the real path.
    The registry's entries are read at run time (they need the trained draft's knobs): when one applies,
    the test is a strict xfail that only its exact place can satisfy."""
    run, scenario_run, _ = served(engine_lane, group, scenario, report)
    known = known_tree_entries(engine_lane.trained, group)
    if known:
        request.applymarker(pytest.mark.xfail(strict=True, raises=KnownDivergenceHit,
                                              reason="; ".join(e.describe() for e in known)))
    layers = engine_lane.trained.config.num_hidden_layers
    ndt = run.resolved["speculative_num_draft_tokens"]
    hits = []
    for i, req in enumerate(scenario_run.requests):
        exact = engine_lane.tree(group, req.prompt, ndt, scenario.new_tokens, ancestors)
        slots = engine_lane.tree(group, req.prompt, ndt, scenario.new_tokens, row_slot_kv)
        for r, served_round in enumerate(req.rounds):
            case = f"{scenario.id}, request {i} (seq {req.prompt.seq}), round {r}"
            cmp = compare_tree_round(served_round, exact[r], case)
            first = cmp.first_divergence
            explained = compare_tree_round(served_round, slots[r], case).first_divergence is None
            hit = None if first is None else match_forward(known, first, layers)
            report.add_row(Section.ENGINE_TREE, {
                "scenario": scenario.id, "request": req.label, "round": r,
                "vs exact tree": "conforms" if first is None else f"step {first.step} `{first.stage}`",
                "vs row-slot KV reference": "conforms" if explained else "diverges",
                "accepted SGLang/exact tree": f"{served_round.accepted}/{exact[r].accepted}"})
            if first is not None and not (hit and explained):
                raise AssertionError(cmp.message(repro))
            if hit:
                hits.append((hit, cmp))
    if hits:
        entry, cmp = hits[0]
        settle(f"{len(hits)} served rounds leave the exact tree at the registered step and stage, each equal to "
               f"the reference with SGLang's row-slot KV; the first:\n{cmp.message(repro)}", entry)


@pytest.mark.parametrize("group,scenario", [p for p in ALL if p.values[1].id == "batch"])
def test_batch_requests_share_passes(group, scenario, engine_lane, report):
    """The scenario is what it claims: its requests were prefilled and drafted in the same passes."""
    _, scenario_run, _ = served(engine_lane, group, scenario, report)
    n = len(scenario_run.requests)
    for request in scenario_run.requests:
        assert request.rounds and request.rounds[0].extend[0].batch == n, f"{request.label}: prefilled alone"
        assert request.rounds[0].decode[0].batch == n, f"{request.label}: drafted alone"


@pytest.mark.parametrize("group,scenario", [p for p in SERVED if p.values[0].chunked_prefill_size])
def test_chunked_prefill_splits_prompts(group, scenario, lane, report):
    """The scenario is what it claims: a prompt longer than the chunk was prefilled (and draft-extended)
    in several chunks, one of them ending mid-prompt."""
    _, scenario_run, _ = served(lane, group, scenario, report)
    longest = max(scenario_run.requests, key=lambda r: r.prompt.length)
    passes = longest.rounds[0].extend
    assert len(passes) > 1, f"{longest.label}: prefilled in one pass with chunk {group.chunked_prefill_size}"


@pytest.mark.parametrize("group,scenario", [p for p in ALL if p.values[1].id == "radix_hit"])
def test_radix_hit_drafts_equal_the_cold_run(group, scenario, engine_lane, report, repro):
    """A prompt served again hits the radix cache (SGLang's cached_tokens) and drafts, round for round,
    what the cold request drafted; a prompt extending it reuses its prefix."""
    _, scenario_run, _ = served(engine_lane, group, scenario, report)
    cold, warm, longer = scenario_run.requests
    assert warm.served.meta["cached_tokens"] > 0, f"{warm.label}: no radix hit (cached_tokens 0)"
    assert longer.served.meta["cached_tokens"] >= cold.prompt.length, f"{longer.label}: shared prefix not reused"
    assert len(warm.rounds) == len(cold.rounds), f"{warm.label}: {len(warm.rounds)} rounds, cold {len(cold.rounds)}"
    for r, (a, b) in enumerate(zip(warm.rounds, cold.rounds)):
        drafted_warm, drafted_cold = a.tree["draft_tokens"].tolist(), b.tree["draft_tokens"].tolist()
        assert (drafted_warm, a.accepted) == (drafted_cold, b.accepted), (
            f"round {r}: on the radix hit SGLang drafted {drafted_warm} (accepted {a.accepted}), cold "
            f"{drafted_cold} (accepted {b.accepted}); repro: {repro}")


@pytest.mark.parametrize("group,scenario", [p for p in ALL if p.values[1].id == "seed_flags"])
def test_seed_flags_verify_width_is_what_sglang_resolved(group, scenario, engine_lane, report):
    """`topk 1, steps 1, draft tokens 16`: every verify checks the number of draft tokens SGLang resolved
    (the rows its draft extend computes per request), not the 16 asked for; the accept length SGLang
    measures is bounded by it (the report ties the two)."""
    run, scenario_run, _ = served(engine_lane, group, scenario, report)
    resolved = run.resolved["speculative_num_draft_tokens"]
    widths = {r.extend[0].width for q in scenario_run.requests for r in q.rounds[1:]}
    assert widths == {resolved}, f"verify width served {sorted(widths)}, SGLang resolved {resolved}"
    for q in scenario_run.requests:
        assert q.served.meta["spec_accept_length"] <= resolved, f"{q.label}: accept length above the verify width"


@pytest.mark.parametrize("group,scenario", SERVED)
def test_the_drafter_is_named(group, scenario, lane, report):
    """The report names the speculative worker class SGLang's scheduler built for each engine (which one serves
    a draft depends on its flags: speculative/spec_info.py create_worker), and it is the one whose rounds the
    capture observed (EAGLEWorkerV2's forward_batch_generation, engine_shims.Capture)."""
    run, _, _ = served(lane, group, scenario, report)
    assert (failure := drafter_failure(run)) is None, failure


def test_training_accuracy_to_measured_accept_length(engine_lane, acceptance, report, repro):
    """Per chain K the lane served, speculators' predicted accept length next to the one SGLang's engine
    measured and the reference's simulation of the same requests (report table and accept_length.png).
    The engine equals the simulation exactly, and speculators' per-row training scores at the engine's own
    rounds give SGLang's per-round accept length exactly; the prediction over all held-out rows is shown
    beside them, not asserted (other rows)."""
    rows = accept_rows(engine_lane, acceptance.prediction)
    record_accept_rows(report, rows, engine_lane.recorded)
    failures = bridge_failures(rows, served_ks())
    assert not failures, "sglang engine vs reference [accept length per K, fp32]:\n  " + "\n  ".join(failures) + (
        f"\n  repro: {repro}")


@pytest.mark.parametrize("trainer", [t for t in TRAINERS if t != DEFAULT_TRAINER])
def test_other_trainers_training_accuracy_to_measured_accept_length(trainer, engine_lane_of, acceptance_of, report,
                                                                     repro):
    """The same bridge for a draft another trainer's own training path trained (NeMo Automodel: its TTT
    trainer's per-row prefix scores, the counts behind its logged train_tau_sim), served by SGLang's engine
    from the SGLang-format copy: SGLang's measured accept length equals the reference's simulation exactly,
    and the trainer's own scores at the engine's rounds give SGLang's per-round accept length exactly. One
    chain engine (bridge.other_trainer_groups) keeps the lane's time small."""
    lane, groups = engine_lane_of(trainer), other_trainer_groups()
    rows = accept_rows(lane, acceptance_of(trainer).prediction, groups)
    for group in groups:
        record_group(report, lane.run(group), lane.recorded)
    record_accept_rows(report, rows, lane.recorded, trainer)
    failures = bridge_failures(rows, served_ks(groups))
    assert not failures, (f"sglang engine vs reference [accept length per K, {trainer}-trained draft, fp32]:\n  "
                          + "\n  ".join(failures) + f"\n  repro: {repro}")


def test_accept_length_check_fails_on_a_mismatched_row(engine_lane, acceptance):
    """Meta: the bridge's check catches a planted mismatch in each column it holds exact, and a missing K."""
    rows = accept_rows(engine_lane, acceptance.prediction)
    assert rows and not bridge_failures(rows, served_ks()), "the unplanted rows must pass (see the test above)"
    K = max(rows)
    row = rows[K]
    plants = {"measured": dataclasses.replace(row, measured=row.measured + Fraction(1, row.rounds)),
              "training's rows": dataclasses.replace(row, trained_rows=row.per_round - Fraction(1, row.rounds))}
    for what, planted in plants.items():
        failures = bridge_failures({**rows, K: planted}, served_ks())
        assert len(failures) == 1 and failures[0].startswith(f"K = {K} "), f"planted {what}: {failures}"
    missing = bridge_failures({k: v for k, v in rows.items() if k != K}, served_ks())
    assert missing == [f"K = {K}: no accept-length row (the engine at K = {K} did not serve)"], missing
