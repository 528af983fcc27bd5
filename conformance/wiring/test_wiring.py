"""Target-side wiring: the aux tensor SGLang's real target class hands the draft against the one the
trainer captured from the transformers target, per target class x training convention x draft config
format; the seed case; and end to end, target -> aux -> draft through SGLang vs through speculators.
"""
from __future__ import annotations

import pytest

from conformance.core.matching import known_param, match_wiring, settle
from conformance.core.registry import Known
from conformance.core.sections import Section
from conformance.wiring.cases import CASES_BY_ID, boundary_name, config_ids, known_wiring, layer_list, wiring_matrix
from conformance.wiring.comparison import WiringComparison
from fixtures.targets import CAPTURE_ONLY_TARGETS, TARGETS, TARGETS_BY_ID

pytestmark = pytest.mark.cpu


def params(triples):
    """pytest params (target, case, format); a registered wiring mismatch makes its param a strict xfail."""
    for target, case, fmt in triples:
        known = known_wiring(target, case, fmt)
        yield known_param(target, case, fmt, id=f"{target.id}-{case.id}-{fmt}", known=known[:1])


def assert_wiring(comparison: WiringComparison, known: tuple[Known, ...], report, repro: str) -> None:
    """Record the case's row and fail with both layer lists; only the registered kind of mismatch (for an error,
    its exception class and message) raises KnownDivergenceHit (matching.match_wiring)."""
    __tracebackhide__ = True
    kind = comparison.kind
    hit = None if comparison.ok else match_wiring(known, comparison.observed)
    outcome = "pass" if comparison.ok else (f"known: {kind}" if hit else f"FAIL: {kind}")
    report.add_row(Section.WIRING, comparison.row(outcome))
    if comparison.ok:
        return
    settle(comparison.message(repro), hit)


@pytest.mark.parametrize("target,case,fmt", list(params(wiring_matrix(TARGETS + CAPTURE_ONLY_TARGETS))))
def test_serving_capture_matches_training(target, case, fmt, wiring, report, repro):
    if target.no_forward:   # its forward cannot run here: what set_eagle3_layers_to_capture asks for
        comparison = wiring.capture_ids_only(target, case, fmt)
    else:
        comparison, _ = wiring.serve(target, case, fmt)
    assert_wiring(comparison, known_wiring(target, case, fmt), report, repro)


@pytest.mark.parametrize("target_id", [t.id for t in TARGETS if t.capture_rule == "first_id_is_one"])
def test_seed_case_is_reported_slot_by_slot(target_id, wiring, repro):
    """The seed (trained on [embed, 3, 31], config says [3, 31, 59]; shrunk): the suite must fail it and say
    which tensor entered which slot; the same draft with its config rewired to the training capture passes."""
    target, shipped, rewired = TARGETS_BY_ID[target_id], CASES_BY_ID["seed_as_shipped"], CASES_BY_ID["seed_rewired"]
    comparison, _ = wiring.serve(target, shipped, "sglang")
    message = comparison.message(repro)
    assert not comparison.ok, f"the seed mis-wiring went unreported:\n{message}"
    # DeepSeek-family targets take ids whose first entry is not 1 verbatim (deepseek_v2.py:3472-3473).
    training, served = shipped.boundaries, config_ids(shipped, "sglang")
    expected = f"training: {layer_list(training)}  serving: {layer_list(served)}"
    assert expected in message, f"the message lacks the side-by-side lists {expected!r}:\n{message}"
    for slot, (t, s) in enumerate(zip(map(boundary_name, training), map(boundary_name, served))):
        line = f"slot {slot}: training {t}, serving {s}  " + ("ok" if t == s else "<- differs")
        assert line in message, f"the message does not name slot {slot} as {line!r}:\n{message}"
    fixed, _ = wiring.serve(target, rewired, "sglang")
    assert fixed.ok, f"the correctly wired seed draft does not conform:\n{fixed.message(repro)}"


# Wired as trained (Llama with the embedding output; the seed rewired) and mis-wired (DeepSeek one layer
# shallower; the seed as shipped).
E2E_CASES = tuple((TARGETS_BY_ID[t], CASES_BY_ID[c], f) for t, c, f in (
    ("llama", "speculators_embed", "sglang"), ("deepseek_v3", "specforge_explicit", "sglang"),
    ("kimi_k25", "seed_as_shipped", "sglang"), ("kimi_k25", "seed_rewired", "sglang")))


@pytest.mark.parametrize("target,case,fmt", list(params(E2E_CASES)))
def test_end_to_end_logits(target, case, fmt, wiring, report, repro):
    """Target -> aux -> draft through SGLang (its target, its draft) vs through training (transformers
    target, trainer's capture, speculators' draft), same draft weights, compared stage by stage to the
    logits and draft ids. A known wiring mismatch must show first at the draft's input, `aux_in`."""
    known = known_wiring(target, case, fmt)
    served, aux = wiring.serve(target, case, fmt)
    if aux is None:   # SGLang served no aux tensor (a release's capture failure): the capture's own verdict
        assert_wiring(served, known, report, repro)
    comparison, wiring_result = wiring.end_to_end(target, case, fmt)
    first = comparison.first_divergence
    logits = [r for r in comparison.results if r.stage == "logits"]
    # Known only when SGLang's capture shows the registered kind and the draft first differs at its input.
    at_input = first is not None and (first.step, first.stage) == (0, "aux_in")
    hit = match_wiring(known, wiring_result.observed) if at_input and not wiring_result.ok else None
    report.add_row(Section.WIRING_END_TO_END, {
        "Case": comparison.case_id, "training captured": layer_list(case.boundaries),
        "SGLang captured": "-" if wiring_result.serving is None else layer_list(wiring_result.serving),
        "first divergent stage": "-" if first is None else f"step {first.step} {first.stage}",
        "logits max abs": logits[0].max_abs if logits else None,
        "outcome": "pass" if first is None else ("known divergence" if hit else "FAIL")})
    if first is None:
        return
    settle(f"{comparison.message(repro)}\n  wiring: {wiring_result.lists()} ({wiring_result.kind})", hit)
