"""Self-tests of the wiring checks: both targets agree where they must, planted mis-wirings are named
slot by slot, what "final" means is pinned, SGLang's reader leaves the draft config untouched, and
every registry entry is live.
"""
from __future__ import annotations

import pytest
import torch

from conformance.adapters.sglang.target import AuxIds, DraftConfigRefused, sglang_aux_layer_ids
from conformance.core.compare import OK, compare_tensors
from conformance.core.registry import REGISTRY, applicable
from conformance.wiring.cases import (
    CASES_BY_ID, MISSING, N, SEED_LAYERS, WRONG, layer_list, shrink, runners, wiring_matrix, wiring_names,
)
from conformance.wiring.comparison import compare_capture
from conformance.checkpoints import sha256
from fixtures.targets import CAPTURE_ONLY_TARGETS, TARGETS, TARGETS_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.id)
def test_sglang_target_and_transformers_target_agree(target, wiring):
    """Same weights, same prompt: SGLang's class and transformers' class give the same next-token logits
    (else a slot could not be named by comparing it with transformers' hidden states)."""
    run = wiring.target(target)
    run.sglang.set_capture(AuxIds(True, None))   # SGLang's default list: valid for every class
    _, logits = run.sglang.run(run.input_ids)
    result = compare_tensors(0, "logits", logits[-1], run.hf_logits[-1], torch.float32)
    assert result.verdict == OK, (f"{target.id}: SGLang and transformers logits differ: max abs {result.max_abs:.3e} "
                                  f"at {result.abs_index}")


def test_final_boundary_is_the_last_layer_output_before_the_norm(wiring):
    """What speculators' id N means: the last layer's output before the final norm (speculators normalises
    it itself, models/eagle3/core.py:250-253). transformers' default hidden_states[N] is after the norm."""
    run = wiring.target(TARGETS_BY_ID["llama"])
    run.hf.config.tie_last_hidden_states = True   # transformers' default (utils/output_capturing.py:243-246)
    try:
        with torch.no_grad():
            default_last = run.hf(run.input_ids[None], output_hidden_states=True).hidden_states[N][0]
            normed = run.hf.model.norm(run.states[N][None])[0]
    finally:
        run.hf.config.tie_last_hidden_states = False
    assert compare_tensors(0, "aux_in", default_last, normed, torch.float32).verdict == OK, \
        "transformers' default last hidden state is not norm(pre-norm output): the 'final' boundary is mislabelled"
    assert compare_tensors(0, "aux_in", run.states[N], default_last, torch.float32).verdict != OK, \
        "the store's final boundary equals transformers' post-norm one: tie_last_hidden_states was not switched off"


@pytest.fixture(scope="module")
def llama_run(wiring):
    return wiring.target(TARGETS_BY_ID["llama"])


def test_swapped_slots_are_named(llama_run):
    """Planted: the serving side hands chunks over in another order; every wrong slot is named with its layer."""
    training = (2, 5, 7)
    served = (5, 2, 7)
    aux = torch.cat([llama_run.states[b] for b in served], dim=-1)
    comparison = compare_capture("planted-swap", training, llama_run.states, aux, "planted", None)
    message = comparison.message("python -m pytest 'x::y'")
    assert not comparison.ok and comparison.kind == WRONG, message
    assert f"training: {layer_list(training)}  serving: {layer_list(served)}" in message, message
    assert "slot 0: training 2, serving 5  <- differs" in message, message
    assert "slot 2: training 7, serving 7  ok" in message, message
    assert "max abs" in message and "repro: python -m pytest" in message, message


def test_dropped_slot_is_named(llama_run):
    """Planted: the serving side captured one layer fewer (SGLang's Llama forward never visits layer N)."""
    training = (2, 5, N)
    aux = torch.cat([llama_run.states[b] for b in training[:2]], dim=-1)
    comparison = compare_capture("planted-drop", training, llama_run.states, aux, "planted", None)
    message = comparison.message("-")
    assert comparison.kind == MISSING, message
    assert "slot 2: training final, serving (none)  <- differs" in message, message
    assert "shape (7, 80)" in message, message


def test_a_chunk_from_no_layer_is_marked_unknown(llama_run):
    """Planted: a chunk equal to no boundary (here the embedding scaled) is shown as '?', with its nearest error."""
    aux = torch.cat([llama_run.states[0] * 1.5, llama_run.states[4]], dim=-1)
    comparison = compare_capture("planted-unknown", (0, 4), llama_run.states, aux, "planted", None)
    assert comparison.serving == ("?", "4"), comparison.message("-")
    assert "slot 0: training embed, serving ?  <- differs" in comparison.message("-")


def test_sglang_reader_leaves_the_draft_config_untouched(wiring):
    """SGLang's resolution only reads the draft's config.json (bytes identical afterwards)."""
    case = CASES_BY_ID["speculators_embed"]
    for fmt in ("sglang", "speculators"):
        path = wiring.draft_dir(case, fmt) / "config.json"
        before = sha256(path)
        try:
            sglang_aux_layer_ids(path.parent, wiring.root)
        except DraftConfigRefused:
            pass
        assert sha256(path) == before, f"{fmt}/config.json changed while SGLang read it"


def test_refused_config_is_one_line_naming_file_and_field(wiring):
    directory = wiring.draft_dir(CASES_BY_ID["speculators_embed"], "speculators")
    with pytest.raises(DraftConfigRefused) as info:
        sglang_aux_layer_ids(directory, wiring.root)
    message = str(info.value)
    assert "\n" not in message and "model_type" in message and "config.json" in message, message
    assert str(wiring.root) not in message, f"a session temp path leaked into the message: {message}"


def test_seed_ids_keep_the_61_layer_pattern():
    """shrink() maps the 61-layer ids onto N layers: identity at 61, start kept, middle and end offsets kept."""
    assert [shrink(i, SEED_LAYERS) for i in (0, 3, 31, 59)] == [0, 3, 31, 59]
    assert shrink(31) - N // 2 == 31 - SEED_LAYERS // 2 and N - shrink(59) == SEED_LAYERS - 59
    assert all(0 <= shrink(i) <= N for i in (0, 3, 31, 59))


def test_every_known_wiring_entry_matches_a_case():
    """A registry entry no case triggers is stale (its strict xfail would never run)."""
    cases = wiring_matrix(TARGETS + CAPTURE_ONLY_TARGETS)
    for entry in (e for e in REGISTRY if e.area == "wiring" and e.version_holds()):   # another release: its own run
        decides = any(applicable("wiring", entry.impl, wiring_names(*x, runner))[:1] == (entry,)
                      for x in cases for runner in runners(entry.impl))
        assert decides, f"wiring entry decides no case: {entry.describe()}"


@pytest.mark.parametrize("target", CAPTURE_ONLY_TARGETS, ids=lambda t: t.id)
def test_capture_only_target_still_cannot_run(target, wiring):
    """The reason a class is only exercised through set_eagle3_layers_to_capture still holds; when SGLang
    fixes it, this fails and the class belongs in TARGETS (with a transformers counterpart)."""
    from conformance.adapters.sglang.target import CaptureFailed, build_target
    from fixtures.targets import make_target_input, write_target_config

    built = build_target(target, write_target_config(target, wiring.root / "no_forward" / target.id))
    built.set_capture(AuxIds(True, None))
    with pytest.raises(CaptureFailed) as info:
        built.run(make_target_input(torch.Generator().manual_seed(1)))
    assert str(info.value).split(": ", 1)[1] in target.no_forward, \
        f"{target.id} now fails differently ({info.value}); update TargetSpec.no_forward"


def test_building_targets_leaves_the_global_generator_alone(tmp_path):
    """transformers and SGLang initialise some modules from torch's global generator; the store forks it,
    so whether the wiring tests ran first never changes what another test draws."""
    from conformance.wiring.wiring import WiringStore

    before = torch.random.get_rng_state().clone()
    WiringStore(tmp_path).serve(TARGETS_BY_ID["kimi_k25"], CASES_BY_ID["speculators_default"], "sglang")
    assert torch.equal(before, torch.random.get_rng_state()), \
        "building or running a target drew from the global generator"


def test_speculators_id_rules_are_speculators_own(wiring):
    """The convention table's speculators row against speculators' own resolve_target_layer_ids: its default
    for an N-layer target, and every id the cases use (0 and N included) accepted, N + 1 refused."""
    import warnings

    from speculators.models.utils import resolve_target_layer_ids

    from conformance.wiring.cases import TRAINERS, TRAINING_CASES
    from fixtures.targets import write_target_config

    verifier = str(write_target_config(TARGETS_BY_ID["llama"], wiring.root / "speculators_verifier"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # its "ids not set explicitly" warning
        default = resolve_target_layer_ids(None, verifier)
    assert tuple(default) == TRAINERS["speculators"].default(N), f"speculators' default is {default}"
    for case in TRAINING_CASES:
        if case.trainer == "speculators" and case.ids is not None:
            assert resolve_target_layer_ids(list(case.ids), verifier) == list(case.ids), case.id
    with pytest.raises(ValueError, match="within"):
        resolve_target_layer_ids([0, 4, N + 1], verifier)
