"""Training accuracy vs accept length for a tiny draft trained with speculators' own training code, and the
same recipe trained by every other trainer's own training path (trained_draft.TRAINERS: NeMo Automodel's).

Exact in fp32 (conformance/acceptance/exact.py): each implementation drafts the reference's tokens in
every verify round and at every draft position, and the reference accepts at every start row exactly
what the trainer's training metrics scored there (on each trainer's own draft). Only the drawn rounds
against all held-out rows (1 + sum_k full_acc_k) keep conformance/core/tolerances.py's sampling bound.
Planted wiring faults must move the accept length by more than that bound and be named at their stage.
"""
from __future__ import annotations

import hashlib
import re

import pytest
import torch

from conformance.acceptance.acceptance import (K_MAX, Simulation, generate, make_drafter, oracle_drafter, simulate,
                                               training_prediction)
from conformance.acceptance.exact import (draft_mismatches, drafts_message, row_mismatches, rows_message,
                                          same_rows_accept_length)
from conformance.acceptance.faults import FAULT_REQUESTS, FAULTS
from conformance.acceptance.stagewise import first_divergence
from conformance.acceptance.trained_draft import TRAINERS
from conformance.adapters import ADAPTERS, DEFAULT_TRAINER, IMPLEMENTATIONS, REFERENCE
from conformance.core.sections import Section
from conformance.core.tolerances import ACCEPT_LENGTH_Z, accept_length_tolerance
from reference.speculative import AcceptStats

CASE = "trained_draft"
LEARNED = 0.3          # full_acc_0 the trained draft must exceed to be "far from zero" (chance: 1/61)
ORACLE_REQUESTS = 64   # the oracle accepts every draft: no sampling error to average away
GENERATIONS, NEW_TOKENS = 16, 32   # whole generations: the first held-out prompts, 32 new tokens each
SHARED_REQUESTS = 64   # rounds of the shared-forward plant (its first divergent rounds come early)


def _row_bound(p: float, rounds: int) -> float:
    """The same z for a per-position rate: z * sqrt(p (1 - p) / R)."""
    return ACCEPT_LENGTH_Z * (p * (1 - p) / rounds) ** 0.5


@pytest.mark.cpu
@pytest.mark.parametrize("trainer", TRAINERS)
def test_trained_draft_has_learned(trainer, acceptance_of, report):
    """The fixture's preconditions, for the draft each trainer's own training path trained: acceptance far
    from zero; the held-out tokens are the target's argmax under the full forward the simulation verifies
    with; and every token the target emits there is in the draft vocabulary (so the trainer's draft-vocab
    teacher, eagle3-semantics §4.1, scores exactly what full-vocabulary verification accepts)."""
    acceptance = acceptance_of(trainer)
    trained, prediction = acceptance.trained, acceptance.prediction
    summary = trained.summary
    report.add_row(Section.TRAINED_DRAFT, {
        "trainer": trainer, "recipe": summary["key"],
        "target": f"fixtures.targets {trained.recipe.target_id}, layer outputs x "
        f"{trained.recipe.layer_output_scale}", "draft": f"{trained.config.num_hidden_layers} layer, hidden "
        f"{trained.config.hidden_size}, draft vocab {trained.config.draft_vocab_size} of {trained.config.vocab_size}",
        "aux layers": str(tuple(summary["aux_layer_ids"])), "ttt steps": trained.trained_steps,
        "optimizer steps": trained.recipe.optimizer_steps, "held-out starts": prediction.starts,
        "held-out full_acc": str([round(f, 3) for f in prediction.full_acc]),
        "emitted tokens outside the draft vocab": summary["heldout_tokens_outside_draft_vocab"]})
    print(f"{trainer}-trained draft {summary['key']}: built in {summary['cpu_seconds']} CPU s; held-out full_acc "
          f"{[round(f, 3) for f in prediction.full_acc]}, cond_acc {[round(c, 3) for c in prediction.cond_acc]}")
    assert prediction.full_acc[0] > LEARNED, (
        f"{trainer}-trained draft [{CASE}]: held-out full_acc_0 {prediction.full_acc[0]:.3f} <= {LEARNED}: it "
        f"learned too little for the bridge; recipe {summary['key']}")
    argmax, _, _ = acceptance.target.run(trained.heldout_ids, trained.config.aux_layer_ids)
    flipped = int((argmax[:, 1:-1] != trained.heldout_ids[:, 2:]).sum())
    assert flipped == 0, (f"{trainer}-trained draft [{CASE}]: {flipped} held-out tokens are not the target's argmax "
                          f"under a full forward (KV-cached generation broke a near-tie): teacher forcing is not the "
                          f"chain there")
    assert summary["heldout_tokens_outside_draft_vocab"] == 0, (
        f"{trainer}-trained draft [{CASE}]: {summary['heldout_tokens_outside_draft_vocab']} held-out tokens outside "
        f"the draft vocabulary: {trainer}' metrics would be optimistic")


def _first(sim: Simulation, n: int) -> Simulation:
    return Simulation(sim.drafts[:n], AcceptStats(sim.stats.accepted[:n]))


def _per_position_rows(report, impl: str, prediction, stats: AcceptStats) -> None:
    for k, row in enumerate(stats.per_position(K_MAX)):
        report.add_row(Section.ACCEPT_PER_POSITION, {
            "implementation": impl, "position": row["position"], "training full_acc": prediction.full_acc[k],
            "simulated cumulative": row["cumulative"], "training cond_acc": prediction.cond_acc[k],
            "simulated conditional": row["conditional"]})


@pytest.mark.cpu
@pytest.mark.parametrize("trainer", TRAINERS)
def test_reference_accepts_what_training_scored(trainer, acceptance_of, report, repro):
    """Row by row: the reference's verify round at start row t accepts exactly the leading drafts that
    the trainer's own metrics scored right at t (up to the steps scored there), on the draft that trainer
    trained. Then the drawn rounds against all held-out rows (1 + sum full_acc, which is the trainer's own
    logged accept length where it logs one: NeMo's train_tau_sim): the one sampled comparison, within
    z * s / sqrt(R)."""
    acceptance = acceptance_of(trainer)
    prediction, ref, requests = acceptance.prediction, acceptance.simulated(REFERENCE), acceptance.requests
    stats, R = ref.stats, len(requests)
    rows = row_mismatches(prediction, ref, requests)
    sampled = []
    for K in range(1, K_MAX + 1):
        trained, simulated_same, compared = same_rows_accept_length(prediction, ref, requests, K)
        predicted, simulated = prediction.accept_length(K), stats.accept_length(K)
        tol = accept_length_tolerance(stats.std(K), stats.rounds)
        in_bound = abs(simulated - predicted) <= tol
        report.add_row(Section.ACCEPT_PREDICTED, {
            "implementation": REFERENCE, "trainer": trainer, "K": K, "simulated": simulated,
            "rows scored to K": compared, "training there": trained, "simulated there": simulated_same,
            "rows equal": f"{R - len(rows)}/{R}",
            "predicted, all rows (1 + sum full_acc)": predicted, "simulated - predicted": simulated - predicted,
            "sampling bound": tol, "verdict": "ok" if not rows and in_bound else "FAIL"})
        if not in_bound:
            sampled.append(f"K = {K}: simulated {simulated:.4f} vs predicted {predicted:.4f}, |difference| "
                           f"{abs(simulated - predicted):.4f} > {tol:.4f} ({ACCEPT_LENGTH_Z:g} * s {stats.std(K):.3f}"
                           f" / sqrt({stats.rounds}))")
    _per_position_rows(report, REFERENCE, prediction, stats)
    logged = prediction.logged_accept_length
    if logged is not None:   # the trainer's own figure is its prediction at the K it trained
        assert logged == pytest.approx(prediction.accept_length(len(prediction.full_acc)), abs=1e-6), (
            f"{trainer} [{CASE}]: its logged accept length {logged} is not 1 + sum full_acc "
            f"{prediction.accept_length(len(prediction.full_acc))} of the same counts")
    if rows:
        trained = acceptance.trained
        pytest.fail(rows_message(rows, R, trained, acceptance.target, ref, CASE, repro), pytrace=False)
    assert not sampled, (f"reference [{CASE}, {trainer}-trained, fp32]: the {R} drawn rounds do not represent the "
                         f"held-out rows (every drawn row matched training exactly)\n  " + "\n  ".join(sampled)
                         + f"\n  repro: {repro}")


@pytest.mark.cpu
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_drafts_equal_the_reference(impl, acceptance, report, repro):
    """Token for token: in every verify round and at every draft position, `impl`'s own drafting loop
    drafts the reference's token. Its accept length is then the reference's, round by round."""
    sim, ref, requests = acceptance.simulated(impl), acceptance.simulated(REFERENCE), acceptance.requests
    mismatches = draft_mismatches(sim, ref, requests)
    R = len(requests)
    for K in range(1, K_MAX + 1):
        report.add_row(Section.ACCEPT_PREDICTED, {
            "implementation": impl, "K": K, "simulated": sim.stats.accept_length(K),
            "reference": ref.stats.accept_length(K), "rounds drafting as the reference": f"{R - len(mismatches)}/{R}",
            "tokens equal": f"{int((sim.drafts[:, :K] == ref.drafts[:, :K]).sum())}/{R * K}",
            "verdict": "ok" if not mismatches else "FAIL"})
    _per_position_rows(report, impl, acceptance.prediction, sim.stats)
    if mismatches:
        trained = acceptance.trained
        pytest.fail(drafts_message(impl, mismatches, R, trained, acceptance.target, trained.checkpoints,
                                   tuple(trained.config.aux_layer_ids), ref, CASE, repro), pytrace=False)


@pytest.mark.cpu
@pytest.mark.meta
def test_oracle_draft_accept_length_is_k_plus_one(acceptance, report):
    """vLLM's oracle check of the loop itself: the target drafting for itself accepts every token."""
    trained, target = acceptance.trained, acceptance.target
    stats = simulate(oracle_drafter(target), trained, target, acceptance.requests[:ORACLE_REQUESTS]).stats
    for K in range(1, K_MAX + 1):
        report.add_row(Section.ACCEPT_ORACLE, {"K": K, "simulated": stats.accept_length(K),
                                                         "expected (K + 1)": K + 1, "rounds": stats.rounds})
    wrong = {K: stats.accept_length(K) for K in range(1, K_MAX + 1) if stats.accept_length(K) != K + 1}
    assert not wrong, f"oracle vs target [{CASE}]: accept length must be K + 1, got {wrong}"


@pytest.mark.cpu
def test_whole_generations_are_lossless(acceptance, report, repro):
    """Round after round, as a server decodes: the text must be the target's own greedy continuation
    for every K. The accept length over whole generations is reported next to the prediction: rounds
    start more often where the draft is weak (a long accept skips rows), so when acceptance clusters
    along the text it is lower than 1 + sum_k full_acc_k, which weighs every row alike."""
    trained, target, prediction = acceptance.trained, acceptance.target, acceptance.prediction
    drafter = make_drafter(REFERENCE, trained.checkpoints)
    expected = trained.heldout_ids[:GENERATIONS, :trained.recipe.prompt_tokens + NEW_TOKENS]
    lossy = {}
    for K in range(1, K_MAX + 1):
        out, stats = generate(drafter, trained, target, GENERATIONS, NEW_TOKENS, K)
        report.add_row(Section.ACCEPT_GENERATIONS, {
            "K": K, "predicted (1 + sum full_acc)": prediction.accept_length(K),
            "one round per request": acceptance.simulated(REFERENCE).stats.accept_length(K),
            "whole generations": stats.accept_length(K), "rounds": stats.rounds,
            "whole - predicted": stats.accept_length(K) - prediction.accept_length(K)})
        if not torch.equal(out, expected):
            where = (out != expected).nonzero()[0].tolist()
            lossy[K] = (f"sequence {where[0]}, token {where[1]}: {int(out[tuple(where)])} instead of "
                        f"{int(expected[tuple(where)])}")
    assert not lossy, (f"reference speculative decoding vs target greedy [{CASE}, fp32]: not lossless at "
                       + "; ".join(f"K = {K}: {w}" for K, w in lossy.items()) + f"\n  repro: {repro}")


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        for f in sorted(p.iterdir()):
            h.update(f.read_bytes())
    return h.hexdigest()


@pytest.mark.cpu
@pytest.mark.meta
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.id)
def test_planted_fault_moves_accept_length(fault, acceptance, report, repro):
    """A planted wiring fault is named at its stage, fails the exact drafts check there, and lowers the
    accept length at every K by more than the sampling bound on its paired per-round drops."""
    trained = acceptance.trained
    before = _digest(trained.checkpoints.values())
    run = acceptance.faulty(fault)
    assert _digest(trained.checkpoints.values()) == before, "planting a fault wrote into the trained draft"
    correct, faulty, first = run.correct.stats, run.faulty.stats, run.comparison.first_divergence
    requests = acceptance.requests[:FAULT_REQUESTS]
    mismatches = draft_mismatches(run.faulty, _first(acceptance.simulated(REFERENCE), FAULT_REQUESTS), requests)
    drops = {}
    for K in range(1, K_MAX + 1):
        diff = correct.lengths(K) - faulty.lengths(K)   # the same rounds, paired
        drops[K] = (float(diff.mean()), accept_length_tolerance(float(diff.std(unbiased=True)), correct.rounds))
    report.add_row(Section.ACCEPT_PLANTED, {
        "fault": fault.id, "served by": fault.host, "what": fault.summary,
        "first divergent stage": "none" if first is None else f"step {first.step} {first.stage}",
        "max abs there": None if first is None else first.max_abs,
        "rounds drafting as the reference": f"{len(requests) - len(mismatches)}/{len(requests)}",
        f"accept length K={K_MAX}": correct.accept_length(K_MAX), "with the fault": faulty.accept_length(K_MAX),
        "drop per K = 1..5": str([round(d, 3) for d, _ in drops.values()]),
        "bound per K = 1..5": str([round(b, 3) for _, b in drops.values()]), "rounds": correct.rounds,
        "accept length tells it from chance": "yes" if all(d > b for d, b in drops.values()) else "no"})
    assert first is not None and (first.step, first.stage) == (0, fault.stage), (
        f"{fault.host} with {fault.id} vs reference [{CASE}]: expected the first divergence at step 0 "
        f"'{fault.stage}'\n{run.comparison.message(repro)}")
    assert mismatches, f"{fault.host} with {fault.id} [{CASE}]: drafts every token as the reference does"
    message = drafts_message(fault.host, mismatches, len(requests), trained, acceptance.target, run.checkpoints,
                             run.aux_ids, acceptance.simulated(REFERENCE), f"{CASE}:{fault.id}", repro)
    assert re.search(rf"first divergent stage: step \d+ '{re.escape(fault.stage)}'", message), message
    small = {K: f"drop {d:.4f} <= bound {b:.4f}" for K, (d, b) in drops.items() if d <= b}
    if fault.costs_acceptance:
        assert not small, (
            f"{fault.host} with {fault.id} [{CASE}]: the accept length does not drop by more than the sampling bound "
            f"({ACCEPT_LENGTH_Z:g} * s / sqrt({correct.rounds}) of the paired drops) at K = {sorted(small)}: {small}; "
            f"first divergent stage step 0 '{first.stage}'\n  repro: {repro}")
    else:   # what docs/acceptance.md says of it: only the exact check tells it from chance
        assert small, (f"{fault.host} with {fault.id} [{CASE}]: now lowers the accept length beyond the sampling "
                       f"bound at every K (drops {[round(d, 4) for d, _ in drops.values()]}): set costs_acceptance "
                       f"in conformance/acceptance/faults.py and update docs/acceptance.md")


@pytest.mark.cpu
@pytest.mark.meta
def test_planted_fault_host_conforms_without_the_fault(acceptance):
    """The control for the fault tests: each host (an implementation, never the reference, which the
    comparison refuses to compare with itself) serving the draft as trained does not part from the
    reference on the probe rows, so the stage a fault is named at is the fault's; the same comparison
    on the host's planted copies does part (the control can fail)."""
    trained, aux_ids = acceptance.trained, tuple(acceptance.trained.config.aux_layer_ids)
    for host in sorted({f.host for f in FAULTS}):
        comparison = first_divergence(trained, acceptance.target, host, trained.checkpoints, aux_ids, CASE)
        assert comparison.first_divergence is None, comparison.message("-")
        for fault in (f for f in FAULTS if f.host == host):
            run = acceptance.faulty(fault)
            planted = first_divergence(trained, acceptance.target, host, run.checkpoints, run.aux_ids, CASE)
            assert planted.first_divergence is not None, f"{host} with {fault.id}: the control sees no divergence"
    with pytest.raises(ValueError, match="against itself"):
        first_divergence(trained, acceptance.target, REFERENCE, trained.checkpoints, aux_ids, CASE)


@pytest.mark.cpu
@pytest.mark.meta
def test_prediction_and_drafting_are_checked_apart(acceptance, monkeypatch):
    """speculators' prediction (its training forward + compute_metrics) and its simulation (its drafting
    loop, no metrics) are different code paths that share the forward. A fault planted in that forward
    (the hidden fed to the next step normed, norm_output flipped on the loaded model) moves both alike,
    so comparing one with the other would not see it; each is checked against the reference, and both
    checks fail."""
    from speculators.models.eagle3 import core

    from conformance.adapters.speculators.adapter import LoadedSpeculators, SpeculatorsAdapter

    trained, target = acceptance.trained, acceptance.target
    real_load = SpeculatorsAdapter.load

    def load(self, *args, **kwargs):
        loaded = real_load(self, *args, **kwargs)
        loaded.model.config.norm_output = not loaded.model.config.norm_output
        return loaded

    def never(*args, **kwargs):
        raise AssertionError("this path must not run here")

    monkeypatch.setattr(SpeculatorsAdapter, "load", load)
    with monkeypatch.context() as m:
        m.setattr(LoadedSpeculators, "drafter", never)          # the prediction never drafts
        prediction = training_prediction(trained)
    requests = acceptance.requests[:SHARED_REQUESTS]
    with monkeypatch.context() as m:
        m.setattr(core, "compute_metrics", never)               # the simulation never scores
        drafted = simulate(make_drafter("speculators", trained.checkpoints), trained, target, requests)
    reference = _first(acceptance.simulated(REFERENCE), SHARED_REQUESTS)
    rows = row_mismatches(prediction, reference, requests)
    drafts = draft_mismatches(drafted, reference, requests)
    cancel = row_mismatches(prediction, drafted, requests)   # the faulty prediction vs the faulty drafting
    assert rows and drafts, (f"speculators with norm_output flipped [{CASE}]: {len(rows)} rows differ from the "
                             f"reference's rounds, {len(drafts)} rounds draft other tokens: a check did not see it")
    assert not cancel, f"the faulty prediction and drafting differ at {len(cancel)} rows: they did not cancel"
    # Both failures name where speculators parts from the reference: the hidden it feeds back.
    for message in (rows_message(rows, len(requests), trained, target, reference, CASE, "-"),
                    drafts_message("speculators", drafts, len(requests), trained, target, trained.checkpoints,
                                   tuple(trained.config.aux_layer_ids), reference, CASE, "-")):
        assert re.search(r"first divergen(ce at step 0, stage|t stage: step 0) 'recurrent_hidden'", message), message


@pytest.mark.cpu
@pytest.mark.meta
@pytest.mark.parametrize("trainer", [t for t in TRAINERS if t != DEFAULT_TRAINER])
def test_row_check_fails_on_a_planted_trainer_forward(trainer, acceptance_of, monkeypatch):
    """The row check on another trainer's draft can fail: its training forward planted (the hidden fed to the
    next step normed, norm_output flipped on the loaded model) scores other rows than the reference's rounds
    accept, and the failure names the first divergent stage of the trainer's forward on that round. (The
    default trainer's: test_prediction_and_drafting_are_checked_apart.)"""
    acceptance = acceptance_of(trainer)
    trained, target = acceptance.trained, acceptance.target
    reference = _first(acceptance.simulated(REFERENCE), SHARED_REQUESTS)
    adapter = ADAPTERS[trainer]
    real_load = adapter.load

    def load(self, *args, **kwargs):
        loaded = real_load(self, *args, **kwargs)
        loaded.model.config.norm_output = not loaded.model.config.norm_output
        return loaded

    monkeypatch.setattr(adapter, "load", load)
    prediction = training_prediction(trained, target=target)
    requests = acceptance.requests[:SHARED_REQUESTS]
    rows = row_mismatches(prediction, reference, requests)
    assert rows, f"{trainer} with norm_output flipped [{CASE}]: its scores equal the reference's rounds at every row"
    message = rows_message(rows, len(requests), trained, target, reference, CASE, "-")
    assert re.search(rf"reference vs {trainer}' training metrics .*first divergence at step \d+, stage '", message,
                     re.S), message


@pytest.mark.cpu
@pytest.mark.meta
def test_accept_stats_per_k():
    """AcceptStats reads every K <= K_max off one K_max-draft round (chain drafts are prefixes)."""
    stats = AcceptStats(torch.tensor([0, 2, 5, 3]))
    assert stats.accept_length(1) == 1 + (0 + 1 + 1 + 1) / 4
    assert stats.accept_length(5) == 1 + (0 + 2 + 5 + 3) / 4
    assert [round(r["conditional"], 3) for r in stats.per_position(3)] == [0.75, 1.0, 0.667]
