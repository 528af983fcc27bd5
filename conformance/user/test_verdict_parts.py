"""The verdict's parts that a planted draft run end to end does not isolate, in process: the conversion's
aux ids on the target's own class, and the reduced plan a large draft gets (conformance/user/plan.py),
exercised on tiny drafts with the size threshold lowered.
"""
from __future__ import annotations

import pytest
import torch

from conformance.checkpoints.directory import open_checkpoint, write_draft
from conformance.user import plan
from conformance.user.example_draft import EXAMPLE, write_example
from conformance.user.plan import STEPS
from conformance.session.harness import compare_with_reference
from conformance.user.store import UserDraftStore
from conformance.user.trainer import resolve_trainer
from conformance.user.user_draft import validate_inputs
from fixtures.real_configs import REAL_CONFIGS
from fixtures.tiny import make_config, make_draft_weights

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
KIMI = REAL_CONFIGS / "target" / "moonshotai--Kimi-K2.5.json"            # DeepSeek class: ids as written
LLAMA = REAL_CONFIGS / "target" / "meta-llama--Meta-Llama-3.1-8B.json"   # Llama class: id + 1


def test_the_conversion_writes_ids_the_targets_class_captures(tmp_path):
    """A speculators draft trained on [embed, 3, 31]: converted without a target, its ids are the Llama
    convention, which Llama captures as trained and Kimi-K2.5 does not; converted for Kimi-K2.5 they are
    the ids its class captures as trained (both judged by SGLang's own capture on the targets' twins)."""
    from conformance.user.convert import main as convert
    from conformance.user.wiring import check_user_wiring

    cfg = make_config(**EXAMPLE, aux_layer_ids=(0, 3, 31))
    draft = write_draft(cfg, make_draft_weights(cfg, torch.Generator().manual_seed(0)), tmp_path / "draft",
                        "speculators")
    trainer = resolve_trainer(open_checkpoint(draft))
    assert convert([str(draft), str(tmp_path / "plain")]) == 0
    assert convert([str(draft), str(tmp_path / "kimi"), "--target-config", str(KIMI)]) == 0
    twins = tmp_path / "twins"
    assert check_user_wiring(tmp_path / "plain", LLAMA, trainer, twins).ok
    plain_on_kimi = check_user_wiring(tmp_path / "plain", KIMI, trainer, twins)
    assert [p.key for p in plain_on_kimi.problems] == ["wiring:aux-layers"], plain_on_kimi.lines()
    fitted = check_user_wiring(tmp_path / "kimi", KIMI, trainer, twins)
    assert fitted.ok and fitted.serving == ("embed", "3", "31"), fitted.lines()


@pytest.fixture
def reduced(monkeypatch):
    """Every draft is 'large': the reduced plan on tiny drafts."""
    monkeypatch.setattr(plan, "LARGE_PARAMS", 0)


def store_for(root, fmt: str, plant: str | None = None) -> UserDraftStore:
    draft, _, _ = write_example(root / "in", fmt, plant=plant)
    return UserDraftStore(root / "store", validate_inputs(draft))


def test_step0_of_the_steps_run_is_the_one_step_run(tmp_path):
    """What step0_from_steps rests on: each implementation's step 0 is the same computation whether or not
    more steps follow (full plan: both runs are real)."""
    store = store_for(tmp_path, "sglang")
    assert not store.plan.step0_from_steps
    for impl in ("reference", "speculators", "sglang"):
        one = store.trace(impl, store.case, torch.bfloat16, 1)
        first = store.trace(impl, store.case, torch.bfloat16, STEPS).steps[0]
        differs = [k for k, v in one.steps[0].items() if k in first and not torch.equal(v, first[k])]
        assert not differs and one.steps[0].keys() <= first.keys(), f"{impl}: step 0 differs at {differs}"


def test_the_reduced_plan_keeps_a_clean_draft_clean(reduced, tmp_path):
    store = store_for(tmp_path, "sglang")
    assert store.plan.dtypes == ("bf16",) and store.plan.precise == torch.float32 and store.plan.reduced
    for impl in ("speculators", "sglang"):
        for steps in (1, STEPS):
            first = compare_with_reference(store, impl, store.case, "bf16", steps).first_divergence
            assert first is None, f"{impl}, {steps} step(s): {first}"


def test_the_reduced_plan_still_finds_a_planted_divergence(reduced, tmp_path):
    """norm_before_residual, which SGLang serves with the raw residual: found where the full plan finds it."""
    store = store_for(tmp_path, "sglang", plant="norm_before_residual")
    first = compare_with_reference(store, "sglang", store.case, "bf16", 1).first_divergence
    assert first is not None and (first.step, first.stage) == (0, "layers.0.residual"), first


# ---------------------------------------------------------------- one reading per file: the directories given

def written_store(root, fmt: str, keys: dict | None = None, servers=("sglang", "vllm")) -> UserDraftStore:
    """A store on the example draft in `fmt` with config keys rewritten as a user wrote them, judged for `servers`
    (vLLM's directory is prepared whether or not its environment is built: nothing here starts it)."""
    import json

    draft, _, _ = write_example(root / "in", fmt)
    if keys:
        config = json.loads((draft / "config.json").read_text())
        config.update(keys)
        (draft / "config.json").write_text(json.dumps(config))
    return UserDraftStore(root / "store", validate_inputs(draft), servers)


@pytest.mark.parametrize("fmt,vllm_reads", [("speculators", "speculators"), ("sglang", "sglang")])
def test_every_implementation_that_reads_the_format_gets_the_file_as_written(fmt, vllm_reads, tmp_path):
    """config.json byte for byte and the weights linked, for the implementation of that format and for vLLM, which
    reads both; the user's files unchanged."""
    store = written_store(tmp_path, fmt)
    user = store.inputs.checkpoint.path
    before = {p.name: p.read_bytes() for p in user.iterdir()}
    own = "sglang" if fmt == "sglang" else "speculators"
    assert store.read_format("vllm") == vllm_reads and store.as_written("vllm") and store.as_written(own)
    for impl in ("vllm", own):
        given = store.directory(impl, store.case)
        assert (given / "config.json").read_bytes() == before["config.json"], f"{impl}: config.json rewritten"
        assert (given / "model.safetensors").resolve() == (user / "model.safetensors").resolve(), impl
    other = "speculators" if own == "sglang" else "sglang"
    assert not store.as_written(other), f"{other} cannot read the {fmt} format: a conversion"
    assert "vllm: the directory as written" in store.context()["served_as"], store.context()
    assert before == {p.name: p.read_bytes() for p in user.iterdir()}, "the user's directory changed"


def test_a_format_vllm_cannot_read_is_converted_and_the_verdict_says_so(tmp_path):
    store = written_store(tmp_path, "specforge")
    assert store.read_format("vllm") == "speculators" and not store.as_written("vllm") and store.as_written("sglang")
    served = store.context()["served_as"]
    assert ("vllm: this suite's conversion to the speculators format (vllm does not read the specforge format)"
            in served), served


def test_a_conversion_keeps_the_keys_the_file_states(tmp_path):
    """A tie flag with a pruned vocabulary, which training overrules: the conversion speculators reads still
    says it (both levels), so speculators' reading of the flag is the one observed."""
    import json

    store = written_store(tmp_path, "sglang", {"tie_word_embeddings": True}, servers=("sglang",))
    assert store.inputs.checkpoint.parsed.overruled == {"tie_word_embeddings": True}
    assert not store.inputs.config.tie_word_embeddings, "training reads the stored head"
    config = json.loads((store.directory("speculators", store.case) / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["transformer_layer_config"]["tie_word_embeddings"] is True


def test_a_nemo_checkpoint_says_who_trained_it(tmp_path):
    """NeMo's own save path (the example's nemo format, its checkpointer) names the trainer by its class; NeMo's own
    SGLang export (serve_sglang's rewrite of architectures, in place) keeps its recipe-only key and its model.-prefixed
    tensors, which still name it. Planted: either mark alone is not NeMo's."""
    import json
    import shutil

    from nemo_automodel.components.speculative.serve_sglang import _rewrite_config_for_sglang

    from conformance.checkpoints.weights import read_weights, save_weights

    draft, _, _ = write_example(tmp_path / "nemo", "nemo")
    trainer = resolve_trainer(open_checkpoint(draft))
    assert trainer.name == "nemo" and "architectures LlamaEagle3DraftModel" in trainer.source, trainer
    # NeMo's default for the depth its config names (the target's, 8): inputs of [2, 4, 5], output ids [1, 3, 4]
    assert trainer.training_ids() == (2, 4, 5) and "8-layer target" in trainer.describe(), trainer.describe()
    renamed = shutil.copytree(draft, tmp_path / "renamed")
    _rewrite_config_for_sglang(renamed / "config.json", renamed / "config.json", "EAGLE3")
    found = resolve_trainer(open_checkpoint(renamed))
    assert found.name == "nemo" and "parallel_drafting" in found.source, found

    no_key = shutil.copytree(renamed, tmp_path / "no_key")
    config = json.loads((no_key / "config.json").read_text())
    del config["parallel_drafting"]
    (no_key / "config.json").write_text(json.dumps(config))
    unprefixed = shutil.copytree(renamed, tmp_path / "unprefixed")
    weights = read_weights(unprefixed, stored_names=True)
    for f in unprefixed.glob("*.safetensors*"):
        f.unlink()
    save_weights({k.removeprefix("model."): v for k, v in weights.items()}, unprefixed / "model.safetensors")
    for planted in (no_key, unprefixed):
        assert resolve_trainer(open_checkpoint(planted)).name is None, planted.name
    assert resolve_trainer(open_checkpoint(no_key), "nemo").source == "stated by --trainer"


def test_nemo_prepared_by_its_serve_sglang_is_read_as_nemo_reads_it(tmp_path):
    """NeMo's serve_sglang renames the class of its saved directory and keeps the target's depth: read as NeMo reads
    it (one layer, the nemo-sglang format), not bad input, and the converter writes one layer. Planted: the same
    directory with its depth rewritten to the stored layer is plain SGLang format."""
    import json
    import shutil

    from conformance.checkpoints.directory import convert

    draft, _, _ = write_example(tmp_path / "nemo", "nemo", prepared_for="sglang")
    stated = json.loads((draft / "config.json").read_text())
    assert stated["architectures"] == ["LlamaForCausalLMEagle3"] and stated["num_hidden_layers"] == 8, stated
    ckpt = open_checkpoint(draft)
    assert ckpt.format == "nemo-sglang" and ckpt.config.num_hidden_layers == 1, (ckpt.format, ckpt.config)
    assert any("the target's" in note for note in ckpt.parsed.notes), ckpt.parsed.notes
    assert resolve_trainer(ckpt).name == "nemo"
    converted = json.loads((convert(draft, tmp_path / "converted", "sglang") / "config.json").read_text())
    assert converted["num_hidden_layers"] == 1, converted

    rewritten = shutil.copytree(draft, tmp_path / "rewritten")
    config = json.loads((rewritten / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (rewritten / "config.json").write_text(json.dumps(config))
    assert open_checkpoint(rewritten).format == "sglang"
