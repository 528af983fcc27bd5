"""Target-side wiring, the training side by a trainer's own code: a trainer whose adapter has a `training_capture`
(its target backends: NeMo Automodel's HF target and its SGLang runner, conformance/adapters/nemo/wiring.py) is
run on the suite's tiny targets, and every aux chunk it captures is matched exactly to a boundary of the
transformers target's forward. Observed, not transcribed:

- its default ids are its own function's, for any depth (TRAINERS' `default`);
- its HF target captures the boundaries its TRAINERS convention says, for the default and explicit ids (the
  training side of every wiring case of that trainer); a convention one layer off is caught;
- its SGLang runner hands SGLang's target class the ids, and SGLang captures what it makes of them, which is
  what it makes of the same ids in a served eagle_config: where that is not what the HF target captured, the
  registered SGLang wiring entry for such ids is the cause (a strict xfail bound to it), else it fails;
- it trains drafts for the target classes TRAINERS' `trains_for` says (its own draft registry); the others are
  skipped here with its refusal.
"""
from __future__ import annotations

import dataclasses

import pytest

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS
from conformance.core.matching import known_param
from conformance.wiring.cases import N, TRAINERS, WiringCase, known_wiring
from conformance.wiring.comparison import compare_capture
from conformance.wiring.test_wiring import assert_wiring
from fixtures.targets import CAPTURE_ONLY_TARGETS, TARGETS

pytestmark = pytest.mark.cpu

CAPTURES = [impl for impl in ALL_IMPLEMENTATIONS if ADAPTERS[impl].training_capture is not None]
# Its default, explicit ids (first id 2: SGLang's DeepSeek class reads those verbatim), the first layer's output
# and the last layer's (id N-1: the final hidden), and explicit ids whose first is 1.
IDS = [None, (2, 5, 8), (0, 4, N - 1), (1, 4, 8)]


def ids_name(ids) -> str:
    return "default" if ids is None else "-".join(map(str, ids))


def params(served: bool = False):
    """(impl, target, ids); `served`: a strict xfail where SGLang's reading of the ids the runner hands it is
    registered (the runner hands them as given, or its default, validated: target_runner.py:110-113)."""
    for impl in CAPTURES:
        for target in TARGETS:
            for ids in IDS:
                known = known_wiring(target, served_as(impl, target, ids), "sglang") if served else ()
                yield known_param(impl, target, ids, id=f"{impl}-{target.id}-{ids_name(ids)}", known=known[:1])


def served_as(impl: str, target, ids) -> WiringCase:
    """The runner's ids as a served draft config carries them (eagle_config), for the registry's conditions."""
    _, trainer = trainer_of(impl)
    return WiringCase(f"{target.id}-{impl}-{ids_name(ids)}-runner", trainer.name, ids,
                      config_ids=trainer.default(N) if ids is None else ids)


def trainer_of(impl: str):
    capture = ADAPTERS[impl].training_capture
    return capture, TRAINERS[capture.TRAINER]


def skip_unless_trained(impl: str, target) -> None:
    capture, trainer = trainer_of(impl)
    if not trainer.trains(target):
        pytest.skip(f"{impl} trains no draft for {target.config['architectures'][0]}: "
                    f"{capture.refusal(target.config['architectures'])}")


def mismatch(impl: str, backend: str, comparison) -> str:
    lines = [f"{impl} {backend} vs its convention [{comparison.case_id}]: {comparison.kind}",
             f"  {comparison.lists()}", f"  convention: {comparison.trained}", f"  {comparison.read}"]
    lines += [f"  slot {s.slot}: table {s.training or '(none)'}, captured {s.serving or '(none)'}"
              + ("" if s.training == s.serving else "  <- differs") for s in comparison.slots]
    return "\n".join(lines)


@pytest.mark.parametrize("impl", CAPTURES)
@pytest.mark.parametrize("num_layers", [10, 32, 61])
def test_default_ids_are_the_trainers_own(impl, num_layers):
    capture, trainer = trainer_of(impl)
    assert capture.default_ids(num_layers) == trainer.default(num_layers), \
        f"{impl}'s own default for {num_layers} layers is {capture.default_ids(num_layers)}, TRAINERS says " \
        f"{trainer.default(num_layers)} ({trainer.source})"


def hf_comparison(impl: str, target, ids, wiring, trainer=None):
    capture, table = trainer_of(impl)
    trainer = trainer or table
    run = wiring.target(target)
    captured = capture.hf_capture(run.hf, run.input_ids, ids)
    assert captured.ids == (capture.default_ids(N) if ids is None else ids), captured.ids
    comparison = compare_capture(f"{target.id}-{impl}-{ids_name(ids)}", trainer.boundaries(ids), run.states,
                                 captured.aux, f"{capture.BACKENDS[0]} captured ids {list(captured.ids)}", None)
    return dataclasses.replace(comparison, trained=f"{trainer.meaning}; {trainer.source}")


@pytest.mark.parametrize("impl,target,ids", list(params()))
def test_hf_capture_is_the_conventions(impl, target, ids, wiring):
    skip_unless_trained(impl, target)
    comparison = hf_comparison(impl, target, ids, wiring)
    assert comparison.ok, mismatch(impl, "HF target", comparison)


@pytest.mark.parametrize("impl", CAPTURES)
def test_a_convention_one_layer_off_is_caught(impl, wiring):
    """Planted: the trainer's convention read as input-of-layer ids; its own capture must contradict it."""
    _, trainer = trainer_of(impl)
    planted = dataclasses.replace(trainer, offset=trainer.offset - 1)
    comparison = hf_comparison(impl, TARGETS[0], None, wiring, planted)
    assert not comparison.ok and comparison.kind == "one layer deeper", mismatch(impl, "HF target", comparison)
    assert "<- differs" in mismatch(impl, "HF target", comparison)


@pytest.mark.parametrize("impl,target,ids", list(params(served=True)))
def test_runner_capture_is_sglangs_reading_of_the_ids(impl, target, ids, wiring, report, repro):
    """The trainer's SGLang runner on SGLang's own target class, against what its HF target trains on; a
    difference is SGLang's reading of those ids, judged by the entry a served eagle_config with them meets."""
    skip_unless_trained(impl, target)
    capture, trainer = trainer_of(impl)
    run = wiring.target(target)
    handed = capture.runner_capture(run.sglang.model, ids)
    layers = tuple(run.sglang.layers_to_capture)
    aux, _ = wiring.forward(run, True)
    comparison = compare_capture(f"{target.id}-{impl}-{ids_name(ids)}-runner", trainer.boundaries(ids), run.states,
                                 aux, f"{impl}'s {capture.BACKENDS[1]} handed set_eagle3_layers_to_capture "
                                      f"{list(handed)}", layers)
    comparison = dataclasses.replace(comparison, trained=f"{impl}'s HF target: {trainer.meaning}")
    # The same ids as a served draft config carries them: SGLang's entry for that reading is the cause.
    served = served_as(impl, target, ids)
    assert handed == served.config_ids, f"{impl}'s runner handed SGLang {list(handed)}, not {served.config_ids}"
    assert_wiring(comparison, known_wiring(target, served, "sglang"), report, repro)


@pytest.mark.parametrize("impl", CAPTURES)
def test_trains_for_is_the_trainers_registry(impl):
    capture, trainer = trainer_of(impl)
    for target in TARGETS + CAPTURE_ONLY_TARGETS:
        refused = capture.refusal(target.config["architectures"])
        assert (refused is None) == trainer.trains(target), \
            f"{impl} on {target.id}: its registry says {refused or 'it trains one'}, TRAINERS' trains_for says " \
            f"{'it does' if trainer.trains(target) else 'it does not'}"
    assert all(capture.refusal([arch]) is None for arch in trainer.trains_for or ()), trainer.trains_for
