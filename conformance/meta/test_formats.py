"""Checkpoint formats: every writer against its reader (bit-exact tensors, every knob), detection,
conversion both ways, legacy names through SGLang's own loader, and the format knowledge kept in
step with the tiny-weight factory and the harness's own speculators reader.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conformance.adapters import ADAPTERS
from fixtures.cases import ALL_CASES, CASES_BY_ID
from fixtures.checkpoint import read_speculators_config, write_checkpoints
from conformance.checkpoints.formats import (WRITABLE, CheckpointError, ConversionError, convert, detect_format, expected_tensors,
                              open_checkpoint, read_weights, write_draft)
from fixtures.tiny import make_config, make_draft_weights

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
# SpecForge's EAGLE-3 draft: one layer, three aux states, no extra norms or biases (semantics §1.2).
SPECFORGE_CASES = [c for c in ALL_CASES if c.id in ("gqa", "mha_full_vocab", "target_hidden", "fc_norm",
                                                    "fc_norm_target_hidden", "rope_llama3", "rope_yarn", "rope_linear")]


def weights_of(cfg, seed=0):
    return make_draft_weights(cfg, torch.Generator().manual_seed(seed))


def assert_same_tensors(got: dict, want: dict, where: str):
    __tracebackhide__ = True
    assert set(got) == set(want), f"{where}: tensor names differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        assert got[name].dtype == want[name].dtype, f"{where}: {name} dtype {got[name].dtype} != {want[name].dtype}"
        assert torch.equal(got[name], want[name]), f"{where}: {name} is not bit-exact"


@pytest.mark.parametrize("fmt", WRITABLE)
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_write_then_read_keeps_every_tensor_and_knob(case, fmt, tmp_path):
    cfg = case.config
    weights = {k: (v.to(torch.bfloat16) if v.is_floating_point() and k.startswith("layers.") else v)
               for k, v in weights_of(cfg).items()}   # mixed dtypes must survive too
    try:
        out = write_draft(cfg, weights, tmp_path / fmt, fmt)
    except ConversionError as exc:
        assert case not in SPECFORGE_CASES and fmt == "specforge", f"{case.id} refused by {fmt}: {exc}"
        assert "specforge format cannot express" in str(exc) and "\n" not in str(exc)
        return
    ckpt = open_checkpoint(out)
    assert ckpt.format == fmt
    assert ckpt.config == cfg, f"{fmt}: knobs changed in the round trip:\n{ckpt.config}\n!=\n{cfg}"
    assert_same_tensors(read_weights(out), weights, f"{case.id} via {fmt}")


@pytest.mark.parametrize("case", SPECFORGE_CASES[:3] + [CASES_BY_ID["two_layers"]], ids=lambda c: c.id)
def test_conversion_chain_through_every_format_and_back(case, tmp_path):
    """speculators -> sglang -> sglang-legacy -> specforge -> speculators: same bytes, same knobs."""
    cfg = case.config
    start = write_draft(cfg, weights_of(cfg), tmp_path / "start", "speculators")
    chain = [f for f in ("sglang", "sglang-legacy", "specforge") if case in SPECFORGE_CASES or f != "specforge"]
    src = start
    for fmt in chain + ["speculators"]:
        dst = convert(src, tmp_path / f"{fmt}-{len(list(tmp_path.iterdir()))}", fmt)
        assert detect_format(dst) == fmt
        assert open_checkpoint(dst).config == cfg, f"knobs changed converting to {fmt}"
        src = dst
    assert_same_tensors(read_weights(src), read_weights(start), "round trip")
    assert json.loads((src / "config.json").read_text()) == json.loads((start / "config.json").read_text())


def test_legacy_names_load_like_current_names_in_sglang(drafts, tmp_path):
    """SGLang's own legacy mapping (midlayer, aux_norm_*, use_aux_norm; llama_eagle3.py:184-187, 337-343):
    the same weights under both name sets give bit-identical stages (semantics R2)."""
    case = CASES_BY_ID["fc_norm"]
    weights = weights_of(case.config)
    current = write_draft(case.config, weights, tmp_path / "current", "sglang")
    legacy = write_draft(case.config, weights, tmp_path / "legacy", "sglang-legacy")
    names = set(read_weights(legacy, stored_names=True))
    assert {"midlayer.hidden_norm.weight", "aux_norm_low.weight", "aux_norm_high.weight"} <= names
    assert json.loads((legacy / "config.json").read_text())["use_aux_norm"] is True
    batch = drafts.batch(case)
    runs = [ADAPTERS["sglang"]().load(d, torch.float32).run(batch) for d in (current, legacy)]
    differing = [s for s in runs[0].steps[0] if not torch.equal(runs[0].steps[0][s], runs[1].steps[0][s])]
    assert not differing, f"legacy names change SGLang's stages: {differing}"


def test_specforge_norm_output_means_pre_norm_feedback(tmp_path):
    """SpecForge's norm_output (default true) is "logits from the normed hidden" with the pre-norm hidden
    fed back (llama3_eagle.py:1690, 1772-1777; model.py:397): training semantics norm_output false.
    Its false (logits without the final norm) is not expressible and is named, not dropped."""
    cfg = make_config(hidden_size=40, target_hidden_size=40, aux_layer_ids=None)
    out = write_draft(cfg, weights_of(cfg), tmp_path / "sf", "specforge", drop_embed=True)
    assert "embed_tokens.weight" not in read_weights(out)
    raw = json.loads((out / "config.json").read_text())
    for value, expect in ((True, False), (None, False)):
        raw.pop("norm_output", None)
        if value is not None:
            raw["norm_output"] = value
        (out / "config.json").write_text(json.dumps(raw))
        assert open_checkpoint(out).config.norm_output is expect
    raw["norm_output"] = False
    (out / "config.json").write_text(json.dumps(raw))
    problems = open_checkpoint(out).parsed.problems
    assert problems and problems[0][0] == "field norm_output", problems


def test_aux_ids_follow_each_formats_convention(tmp_path):
    """speculators: input of layer i; SGLang's eagle_config: output of layer i (id - 1, llama.py:929-941)."""
    cfg = make_config(aux_layer_ids=(2, 4, 5))
    spec = write_draft(cfg, weights_of(cfg), tmp_path / "spec", "speculators")
    sg = convert(spec, tmp_path / "sg", "sglang")
    assert json.loads((spec / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert json.loads((sg / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert open_checkpoint(sg).config.aux_layer_ids == (2, 4, 5)


def test_speculators_cannot_express_four_aux_states_without_ids(tmp_path):
    cfg = make_config(num_aux_hidden_states=4, aux_layer_ids=None)
    with pytest.raises(ConversionError, match="num_aux_hidden_states=4"):
        write_draft(cfg, weights_of(cfg), tmp_path / "s", "speculators")
    out = write_draft(cfg, weights_of(cfg), tmp_path / "g", "sglang")   # SGLang: num_aux_hidden_states key
    assert open_checkpoint(out).config.num_aux_hidden_states == 4


def test_sharded_and_bin_checkpoints_read_like_one_file(tmp_path):
    cfg = CASES_BY_ID["gqa"].config
    weights = weights_of(cfg)
    one = write_draft(cfg, weights, tmp_path / "one", "sglang")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((one / "config.json").read_bytes())
    from safetensors.torch import save_file
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in halves.items() for k in keys}}))
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_bytes((one / "config.json").read_bytes())
    torch.save(weights, binary / "pytorch_model.bin")
    for d in (sharded, binary):
        assert open_checkpoint(d).config == cfg
        assert_same_tensors(read_weights(d), weights, d.name)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_expected_tensors_match_the_tiny_weight_factory(case):
    expected = expected_tensors(case.config)
    weights = weights_of(case.config)
    assert set(expected) == set(weights), sorted(set(expected) ^ set(weights))
    for name, (shape, kind) in expected.items():
        assert tuple(weights[name].shape) == shape, name


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_reader_agrees_with_the_harness_speculators_reader(case, tmp_path):
    """conformance/checkpoints/formats.py and fixtures/checkpoint.read_speculators_config read the same knobs."""
    dirs = write_checkpoints(case.config, weights_of(case.config), tmp_path)
    assert open_checkpoint(dirs["speculators"]).config == read_speculators_config(dirs["speculators"]) == case.config
    assert open_checkpoint(dirs["sglang"]).config == case.config


def test_detection_names_the_field_when_it_is_no_draft(tmp_path):
    cfg = CASES_BY_ID["gqa"].config
    out = write_draft(cfg, weights_of(cfg), tmp_path / "d", "sglang")
    raw = json.loads((out / "config.json").read_text())
    raw["architectures"] = ["LlamaForCausalLM"]
    raw.pop("draft_vocab_size")
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="field architectures: LlamaForCausalLM without draft_vocab_size"):
        detect_format(out)


def test_original_eagle_configs_read_as_eagle(tmp_path):
    cfg = dataclasses.replace(CASES_BY_ID["gqa"].config, aux_layer_ids=None)
    out = write_draft(cfg, weights_of(cfg), tmp_path / "e", "specforge")
    raw = json.loads((out / "config.json").read_text())
    raw["architectures"] = ["LlamaForCausalLM"]
    (out / "config.json").write_text(json.dumps(raw))
    ckpt = open_checkpoint(out)
    assert ckpt.format == "eagle" and ckpt.config == cfg
