"""Training accuracy vs accept length for a tiny draft trained with speculators' own training code.

speculators' predicted accept length (1 + sum_k full_acc_k) against greedy chain speculative decoding
with the draft served by the reference, speculators and SGLang, within conformance/core/tolerances.py's
sampling bound; planted wiring faults must lower it and be named at their stage.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from conformance.acceptance.acceptance import K_MAX, generate, make_drafter, oracle_drafter, simulate
from conformance.acceptance.faults import FAULTS, first_divergence, served_aux_ids
from conformance.core.report import Section
from conformance.core.tolerances import ACCEPT_LENGTH_Z, accept_length_tolerance
from reference.speculative import AcceptStats

DRAFTERS = ("reference", "speculators", "sglang")   # the reference and both implementations
CASE = "trained_draft"
LEARNED = 0.3          # full_acc_0 the trained draft must exceed to be "far from zero" (chance: 1/61)
ORACLE_REQUESTS = 64   # the oracle accepts every draft: no sampling error to average away
GENERATIONS, NEW_TOKENS = 16, 32   # whole generations: the first held-out prompts, 32 new tokens each


def _row_bound(p: float, rounds: int) -> float:
    """The same z for a per-position rate: z * sqrt(p (1 - p) / R)."""
    return ACCEPT_LENGTH_Z * (p * (1 - p) / rounds) ** 0.5


@pytest.mark.cpu
def test_trained_draft_has_learned(acceptance, report):
    """The fixture's preconditions: acceptance far from zero; the held-out tokens are the target's argmax
    under the full forward the simulation verifies with; and every token the target emits there is in
    the draft vocabulary (so speculators' draft-vocab teacher, eagle3-semantics §4.1, scores exactly
    what full-vocabulary verification accepts)."""
    trained, prediction = acceptance.trained, acceptance.prediction
    summary = trained.summary
    report.add_row(Section.TRAINED_DRAFT, {
        "recipe": summary["key"], "target": f"fixtures.targets {trained.recipe.target_id}, layer outputs x "
        f"{trained.recipe.layer_output_scale}", "draft": f"{trained.config.num_hidden_layers} layer, hidden "
        f"{trained.config.hidden_size}, draft vocab {trained.config.draft_vocab_size} of {trained.config.vocab_size}",
        "aux layers": str(tuple(summary["aux_layer_ids"])), "ttt steps": trained.trained_steps,
        "optimizer steps": trained.recipe.optimizer_steps, "held-out starts": prediction.starts,
        "held-out full_acc": str([round(f, 3) for f in prediction.full_acc]),
        "emitted tokens outside the draft vocab": summary["heldout_tokens_outside_draft_vocab"]})
    print(f"trained draft {summary['key']}: built in {summary['cpu_seconds']} CPU s; held-out full_acc "
          f"{[round(f, 3) for f in prediction.full_acc]}, cond_acc {[round(c, 3) for c in prediction.cond_acc]}")
    assert prediction.full_acc[0] > LEARNED, (
        f"trained draft [{CASE}]: held-out full_acc_0 {prediction.full_acc[0]:.3f} <= {LEARNED}: it learned too "
        f"little for the bridge; recipe {summary['key']}")
    argmax, _, _ = acceptance.target.run(trained.heldout_ids, trained.config.aux_layer_ids)
    flipped = int((argmax[:, 1:-1] != trained.heldout_ids[:, 2:]).sum())
    assert flipped == 0, (f"trained draft [{CASE}]: {flipped} held-out tokens are not the target's argmax under a "
                          f"full forward (KV-cached generation broke a near-tie): teacher forcing is not the chain there")
    assert summary["heldout_tokens_outside_draft_vocab"] == 0, (
        f"trained draft [{CASE}]: {summary['heldout_tokens_outside_draft_vocab']} held-out tokens outside the "
        f"draft vocabulary: speculators' metrics would be optimistic")


@pytest.mark.cpu
@pytest.mark.parametrize("impl", DRAFTERS)
def test_predicted_accept_length_matches_simulated(impl, acceptance, report, repro):
    prediction, stats = acceptance.prediction, acceptance.simulated(impl)
    failures = []
    for K in range(1, K_MAX + 1):
        predicted, simulated = prediction.accept_length(K), stats.accept_length(K)
        tol = accept_length_tolerance(stats.std(K), stats.rounds)
        ok = abs(simulated - predicted) <= tol
        report.add_row(Section.ACCEPT_PREDICTED, {
            "implementation": impl, "K": K, "predicted (1 + sum full_acc)": predicted, "simulated": simulated,
            "simulated - predicted": simulated - predicted, "tolerance": tol, "rounds": stats.rounds,
            "verdict": "ok" if ok else "FAIL"})
        if not ok:
            failures.append(f"K = {K}: simulated {simulated:.4f} vs predicted {predicted:.4f}, |difference| "
                            f"{abs(simulated - predicted):.4f} > {tol:.4f} ({ACCEPT_LENGTH_Z:g} * s {stats.std(K):.3f}"
                            f" / sqrt({stats.rounds}))")
    positions = stats.per_position(K_MAX)
    first_position = None
    for k, row in enumerate(positions):
        report.add_row(Section.ACCEPT_PER_POSITION, {
            "implementation": impl, "position": row["position"], "training full_acc": prediction.full_acc[k],
            "simulated cumulative": row["cumulative"], "training cond_acc": prediction.cond_acc[k],
            "simulated conditional": row["conditional"]})
        off = abs(row["cumulative"] - prediction.full_acc[k])
        if first_position is None and off > _row_bound(prediction.full_acc[k], stats.rounds):
            first_position = (row["position"], off)
    if not failures:
        return
    table = "\n".join(f"  position {r['position']}: training full_acc {prediction.full_acc[i]:.3f} cond_acc "
                      f"{prediction.cond_acc[i]:.3f} | simulated cumulative {r['cumulative']:.3f} conditional "
                      f"{r['conditional']:.3f}" for i, r in enumerate(positions))
    where = ("no single draft position out of its bound" if first_position is None else
             f"first draft position out of its bound: {first_position[0]} (|cumulative - full_acc| {first_position[1]:.3f})")
    trained = acceptance.trained
    staged = first_divergence(trained, acceptance.target, impl, trained.checkpoints, served_aux_ids(trained), CASE)
    first = staged.first_divergence
    stage = ("no stage diverges from the reference on the held-out rows" if first is None else
             f"first divergent stage vs the reference: step {first.step} '{first.stage}' (max abs "
             f"{first.max_abs}, at {first.abs_index})")
    pytest.fail(f"{impl} vs predicted [{CASE}, fp32]: accept length out of bound\n  " + "\n  ".join(failures)
                + f"\n  {where}; {stage}\n{table}\n  repro: {repro}", pytrace=False)


@pytest.mark.cpu
@pytest.mark.meta
def test_oracle_draft_accept_length_is_k_plus_one(acceptance, report):
    """vLLM's oracle check of the loop itself: the target drafting for itself accepts every token."""
    trained, target = acceptance.trained, acceptance.target
    stats = simulate(oracle_drafter(target), trained, target, acceptance.requests[:ORACLE_REQUESTS])
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
    drafter = make_drafter("reference", trained.checkpoints)
    expected = trained.heldout_ids[:GENERATIONS, :trained.recipe.prompt_tokens + NEW_TOKENS]
    lossy = {}
    for K in range(1, K_MAX + 1):
        out, stats = generate(drafter, trained, target, GENERATIONS, NEW_TOKENS, K)
        report.add_row(Section.ACCEPT_GENERATIONS, {
            "K": K, "predicted (1 + sum full_acc)": prediction.accept_length(K),
            "one round per request": acceptance.simulated("reference").accept_length(K),
            "whole generations": stats.accept_length(K), "rounds": stats.rounds,
            "whole - predicted": stats.accept_length(K) - prediction.accept_length(K)})
        if not torch.equal(out, expected):
            where = (out != expected).nonzero()[0].tolist()
            lossy[K] = f"sequence {where[0]}, token {where[1]}: {int(out[tuple(where)])} instead of {int(expected[tuple(where)])}"
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
def test_planted_fault_lowers_accept_length(fault, acceptance, report, repro):
    trained = acceptance.trained
    before = _digest(trained.checkpoints.values())
    correct, faulty, comparison = acceptance.faulty(fault)
    assert _digest(trained.checkpoints.values()) == before, "planting a fault wrote into the trained draft"
    first = comparison.first_divergence
    drops = {}
    for K in range(1, K_MAX + 1):
        diff = correct.lengths(K) - faulty.lengths(K)   # the same rounds, paired
        drops[K] = (float(diff.mean()), accept_length_tolerance(float(diff.std(unbiased=True)), correct.rounds))
    report.add_row(Section.ACCEPT_PLANTED, {
        "fault": fault.id, "served by": fault.host, "what": fault.summary,
        "first divergent stage": "none" if first is None else f"step {first.step} {first.stage}",
        "max abs there": None if first is None else first.max_abs,
        f"accept length K={K_MAX}": correct.accept_length(K_MAX), "with the fault": faulty.accept_length(K_MAX),
        "drop per K = 1..5": str([round(d, 3) for d, _ in drops.values()]),
        f"sampling bound K={K_MAX}": drops[K_MAX][1], "rounds": correct.rounds})
    assert first is not None and (first.step, first.stage) == (0, fault.stage), (
        f"{fault.host} with {fault.id} vs reference [{CASE}]: expected the first divergence at step 0 "
        f"'{fault.stage}'\n{comparison.message(repro)}")
    not_lower = {K: round(d, 4) for K, (d, _) in drops.items() if d <= 0}
    assert not not_lower, (
        f"{fault.host} with {fault.id} [{CASE}]: the accept length is not lower with the fault at K = "
        f"{sorted(not_lower)} (drops {not_lower}, over the same {correct.rounds} rounds); first divergent stage "
        f"step 0 '{first.stage}'\n  repro: {repro}")


@pytest.mark.cpu
@pytest.mark.meta
def test_planted_fault_host_conforms_without_the_fault(acceptance):
    """The control for the fault tests: each host serving the draft as trained does not part from the
    reference on the probe rows, so the stage a fault is named at is the fault's."""
    trained = acceptance.trained
    for host in sorted({f.host for f in FAULTS}):
        comparison = first_divergence(trained, acceptance.target, host, trained.checkpoints,
                                      served_aux_ids(trained), CASE)
        assert comparison.first_divergence is None, comparison.message("-")


@pytest.mark.cpu
@pytest.mark.meta
def test_accept_stats_per_k():
    """AcceptStats reads every K <= K_max off one K_max-draft round (chain drafts are prefixes)."""
    stats = AcceptStats(torch.tensor([0, 2, 5, 3]))
    assert stats.accept_length(1) == 1 + (0 + 1 + 1 + 1) / 4
    assert stats.accept_length(5) == 1 + (0 + 2 + 5 + 3) / 4
    assert [round(r["conditional"], 3) for r in stats.per_position(3)] == [0.75, 1.0, 0.667]
