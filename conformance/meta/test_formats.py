"""Checkpoint formats: every writer against its reader (bit-exact tensors, every knob), detection,
conversion both ways, legacy names and the partial-rotary key through SGLang's own loader, and the
tensor schema against the model speculators builds from the same config.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.checkpoints import (WRITABLE, CheckpointError, ConversionError, config_json, convert, detect_format,
                                    expected_tensors, open_checkpoint, parse_config, read_weights, write_draft)
from fixtures.cases import ALL_CASES, CASES_BY_ID
from fixtures.checkpoint import write_checkpoints
from fixtures.tiny import make_config, make_draft_weights

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
# SpecForge's EAGLE-3 draft: one layer, three aux states, no extra norms or biases (semantics §1.2).
SPECFORGE_CASES = [c for c in ALL_CASES if c.id in ("gqa", "mha_full_vocab", "target_hidden", "fc_norm",
                                                    "fc_norm_target_hidden", "rope_llama3", "rope_yarn", "rope_linear",
                                                    "default_nemo_0_7")]
# NeMo Automodel 0.7.0's Llama draft: one layer, three aux states, no input norm, raw-hidden residual, no window,
# untied, Llama-shaped, whole-head RoPE (conformance/checkpoints/formats/nemo.py); multi-step cases of those.
NEMO_CASES = [c for c in ALL_CASES if c.id in (
    "gqa", "mha_full_vocab", "target_hidden", "fc_norm", "fc_norm_target_hidden", "norm_output", "attention_bias",
    "mlp_bias", "rope_llama3", "rope_yarn", "rope_linear", "deep_positions", "ms_gqa", "ms_norm_output",
    "ms_target_hidden", "ms_rope_yarn", "ms_positions_from_1", "ms_chunked_extend", "default_nemo_0_7",
    # and its MLA draft (draft_deepseek.py), interleaved RoPE only
    "mla_q_lora", "mla_direct_q", "mla_rope_yarn", "mla_rope_yarn_defaults", "mla_eagle3_1", "mla_deep_positions",
    "mla_full_vocab",
    "ms_mla_q_lora", "ms_mla_direct_q_yarn", "ms_mla_eagle3_1")]
LLAMA_LAYER_CASES = [c for c in ALL_CASES if c.config.draft_arch != "mla"]   # SGLang's Llama-layer formats
MLA_CASES = [c for c in ALL_CASES if c.config.draft_arch == "mla"]   # SGLang's MLA class's format
# formats that cannot express every case: trainers', SGLang's Llama ones for MLA drafts (formats/__init__.py NO_MLA),
# SGLang's MLA one for the rest
PARTIAL = {"specforge": SPECFORGE_CASES, "nemo": NEMO_CASES, "sglang": LLAMA_LAYER_CASES,
           "sglang-legacy": LLAMA_LAYER_CASES, "sglang-mla": MLA_CASES}
# What speculators' own code can build (its adapter's `unsupported`: no MLA draft layer).
SPECULATORS_CASES = [c for c in ALL_CASES if ADAPTERS["speculators"]().unsupported(c.config) is None]


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
    # The trainers' formats refuse exactly the configs their trainer cannot express, naming the knob.
    expressible = fmt not in PARTIAL or any(c.config == cfg for c in PARTIAL[fmt])
    try:
        out = write_draft(cfg, weights, tmp_path / fmt, fmt)
    except ConversionError as exc:
        assert not expressible, f"{case.id} refused by {fmt}: {exc}"
        assert f"{fmt} format cannot express" in str(exc) and "\n" not in str(exc)
        return
    assert expressible, f"{fmt} wrote {case.id}, which its trainer cannot train"
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


@pytest.mark.parametrize("case", SPECULATORS_CASES, ids=lambda c: c.id)
def test_the_tensor_schema_is_what_speculators_builds(case):
    """expected_tensors (what fixtures/tiny.py generates and user checkpoints are checked against) names
    the tensors, with their shapes, that speculators' Eagle3DraftModel holds for the same config.json;
    known exceptions: its fc is A*hidden_size wide (core.py:76-78), a tied lm_head is embed_tokens."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    cfg = case.config
    config = Eagle3SpeculatorConfig.model_validate(config_json(cfg, "speculators"))
    config.transformer_layer_config._attn_implementation = "sdpa"
    with torch.device("meta"):   # shapes only: no memory, no init
        model = Eagle3DraftModel(config)
    # verifier_*: the training-only teacher head, never saved (core.py:39-42)
    built = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith("verifier_")}
    if cfg.tie_word_embeddings:   # tied to embed_tokens when loaded (transformers' tie_weights): never stored
        del built["lm_head.weight"]
    schema = {k: shape for k, (shape, _) in expected_tensors(cfg).items()}
    if cfg.target_hidden_size != cfg.hidden_size:
        wide = {k for k in schema if k == "fc.weight" or k.startswith("fc_norm.")}
        assert {k: built[k] for k in wide} != {k: schema[k] for k in wide}, "speculators now builds fc from Ht"
        built, schema = ({k: v for k, v in d.items() if k not in wide} for d in (built, schema))
    assert built == schema, {k: (built.get(k), schema.get(k)) for k in set(built) | set(schema)
                             if built.get(k) != schema.get(k)}


@pytest.mark.parametrize("case", SPECULATORS_CASES, ids=lambda c: c.id)
def test_what_speculators_saves_reads_back_as_the_same_draft(case, tmp_path):
    """speculators' own save_pretrained (the config.json a user brings) reads back as every knob. A tied
    draft it saves untied: its top-level tie_word_embeddings false and an lm_head tensor, read as written."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    cfg = case.config
    Eagle3DraftModel(Eagle3SpeculatorConfig.model_validate(config_json(cfg, "speculators"))).save_pretrained(tmp_path)
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.config == dataclasses.replace(cfg, tie_word_embeddings=False)
    assert "lm_head.weight" in ckpt.tensors


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_the_harness_checkpoints_read_back_as_their_case(case, tmp_path):
    """fixtures/checkpoint.py's directories (one weight file, one config per format; SpecForge's stores the
    same tensors under its midlayer.* names) read back every knob and every tensor."""
    dirs = write_checkpoints(case.config, weights_of(case.config), tmp_path)
    for fmt, d in dirs.items():
        assert open_checkpoint(d).format == fmt and open_checkpoint(d).config == case.config, fmt
    same_names = [d for d in dirs.values() if set(read_weights(d, stored_names=True)) == set(read_weights(d))]
    weight_bytes = {(d / "model.safetensors").read_bytes() for d in same_names}
    assert len(weight_bytes) == 1, "the formats' weight files differ"
    first = read_weights(same_names[0])
    for d in dirs.values():
        tensors = read_weights(d)
        assert tensors.keys() == first.keys() and all(torch.equal(tensors[k], first[k]) for k in first), d.name


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


# ---------------------------------------------------------------- qwen3 layers and partial rotary

def test_partial_rotary_is_read_where_transformers_reads_it(tmp_path):
    """The RoPE block's partial_rotary_factor wins over the top-level key (transformers'
    convert_rope_params_to_dict); SGLang reads only the top-level one (llama.py:199-200), so a flat
    config whose value sits only in the block is noted as read differently; the writers put it where
    each reader looks."""
    cfg = CASES_BY_ID["partial_rotary"].config
    assert config_json(cfg, "sglang")["partial_rotary_factor"] == 0.5
    spec = config_json(cfg, "speculators")["transformer_layer_config"]
    assert spec["rope_parameters"]["partial_rotary_factor"] == 0.5 and "partial_rotary_factor" not in spec
    raw = config_json(cfg, "sglang")
    raw.update(partial_rotary_factor=0.25, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                            "partial_rotary_factor": 0.5})
    parsed = parse_config(raw, tmp_path / "config.json", "sglang")
    assert parsed.knobs["partial_rotary_factor"] == 0.5
    assert any("SGLang reads only the top-level key" in n and "llama.py:199-200" in n for n in parsed.notes), \
        parsed.notes
    raw.update(partial_rotary_factor=0.5)
    assert not any("partial_rotary_factor" in n for n in parse_config(raw, tmp_path / "config.json", "sglang").notes)
    raw.update(partial_rotary_factor=0.3, rope_parameters=None)   # 0.3 * 12 = 3 channels: no pairs to rotate
    assert parse_config(raw, tmp_path / "config.json", "sglang").problems[0][0] == "field partial_rotary_factor"


def test_sglang_rotates_the_full_head_when_the_factor_is_only_in_the_rope_block(drafts, tmp_path):
    """The reading the note above names, shown on SGLang's own model: the same weights with the factor
    moved from the top level into rope_parameters change SGLang's k_rot (and nothing before it)."""
    case = CASES_BY_ID["partial_rotary"]
    top = write_draft(case.config, weights_of(case.config), tmp_path / "top", "sglang")
    block = convert(top, tmp_path / "block", "sglang")
    raw = json.loads((block / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_theta"],
                              "partial_rotary_factor": raw.pop("partial_rotary_factor")}
    (block / "config.json").write_text(json.dumps(raw))
    assert open_checkpoint(block).config == case.config
    batch = drafts.batch(case)
    runs = [ADAPTERS["sglang"]().load(d, torch.float32).run(batch).steps[0] for d in (top, block)]
    assert torch.equal(runs[0]["layers.0.k"], runs[1]["layers.0.k"])
    assert not torch.equal(runs[0]["layers.0.k_rot"], runs[1]["layers.0.k_rot"]), "SGLang now reads rope_parameters"


def test_mla_layers_are_read_from_model_type_and_the_mla_widths(tmp_path):
    """A DeepseekV3Config layer stating kv_lora_rank is an MLA draft layer (draft_arch mla) in the speculators layout
    (the reference's) and in NeMo's (its MLA draft: speculative/eagle/registry.py:88), whatever the layer's stated
    num_key_value_heads; NeMo never trained rope_interleave false (its draft always interleaves)."""
    cfg = CASES_BY_ID["mla_q_lora"].config
    assert {"layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_b_proj.weight"} <= set(expected_tensors(cfg))
    raw = config_json(cfg, "speculators")
    raw["transformer_layer_config"]["num_key_value_heads"] = 1   # DeepseekV3Config's MLA has no GQA
    assert parse_config(raw, tmp_path / "config.json").config() == cfg
    flat = config_json(cfg, "nemo")
    assert flat["model_type"] == "deepseek_v3" and flat["architectures"] == ["LlamaEagle3DraftModel"]
    assert parse_config(flat, tmp_path / "config.json").config() == cfg
    flat["rope_interleave"] = False
    problems = dict(parse_config(flat, tmp_path / "config.json").problems)
    assert "NeMo did not train it" in problems.get("field rope_interleave", ""), problems
    del flat["kv_lora_rank"]   # a DeepSeek-V3 target's config without MLA widths: not an MLA layer
    assert parse_config(flat, tmp_path / "config.json").knobs["draft_arch"] == "llama"


def test_qwen3_layers_are_read_from_model_type(tmp_path):
    """model_type qwen3 is speculators' draft_arch qwen3 (model_definitions.py:135-142); its MLP has no
    biases whatever the config says; SpecForge and the original EAGLE-3 trainer never trained it."""
    cfg = CASES_BY_ID["qwen3_qk_norm"].config
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= set(expected_tensors(cfg))
    raw = config_json(cfg, "speculators")
    raw["transformer_layer_config"]["mlp_bias"] = True
    parsed = parse_config(raw, tmp_path / "config.json")
    assert parsed.knobs["draft_arch"] == "qwen3" and parsed.knobs["mlp_bias"] is False
    assert any("mlp_bias true is ignored by qwen3 layers" in n for n in parsed.notes), parsed.notes
    flat = config_json(cfg, "sglang")
    assert flat["model_type"] == "qwen3"
    for fmt in ("specforge", "eagle"):
        problems = dict(parse_config(flat, tmp_path / "config.json", fmt).problems)
        assert "did not train it" in problems.get("field model_type", ""), (fmt, problems)
