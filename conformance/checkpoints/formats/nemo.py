"""NeMo Automodel 0.7.0's EAGLE-3 draft as its recipe saves it (recipes/llm/train_eagle3.py:610-659, the
consolidated checkpointer's `model/consolidated/` directory): the *target's* LlamaConfig with the draft keys
set, `architectures: ["LlamaEagle3DraftModel"]`, no `eagle_config`, and the draft's state dict as
`LlamaEagle3DraftModel` names it: `model.`-prefixed except `lm_head.weight`, `d2t` and `t2d`
(draft_llama.py:21-32), in one shard `model-00001-of-00001.safetensors` behind `model.safetensors.index.json`.

What the file says differently from what the draft is:
- `num_hidden_layers` is the target's depth (the recipe copies the target's config, train_eagle3.py:610);
  the draft has one layer whatever it says (draft_llama.py:760, `layers = [Eagle3LlamaDecoderLayer(...)]`).
- `model_type` is the target's; the draft layer is Llama-shaped for every target (no q_norm/k_norm).
- aux layer ids are not stated: NeMo's trainer captures `default_eagle3_aux_layer_ids(depth)` =
  outputs of layers [1, depth // 2 - 1, depth - 4] (target.py:42-61) unless the run set
  `recipe_args.aux_layer_ids`; in the training convention (input of layer i + 1) [2, depth // 2, depth - 3].
MLA drafts (DeepseekV3Eagle3DraftModel, draft_deepseek.py: a DeepSeek-V3 target's draft) are saved the same way: the
target's DeepseekV3Config with the draft keys and `architectures: ["LlamaEagle3DraftModel"]` (train_eagle3.py:613);
model_type and the MLA widths (kv_lora_rank, ...) say which draft it is (speculative/eagle/registry.py:88).
The writer refuses what NeMo cannot train (ConversionError naming it). Aux ids other than NeMo's default for
the target depth (a run with recipe_args.aux_layer_ids) are not in NeMo's file: this writer adds them where
SGLang reads them (`eagle_config`, output of layer i), as the SpecForge writer does, so a round trip keeps them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from conformance.checkpoints.errors import ConversionError
from conformance.checkpoints.formats.flat import parse_flat
from conformance.checkpoints.knobs import ParsedConfig
from reference.eagle3 import Eagle3Config

NAME = "nemo"
ARCHITECTURE = "LlamaEagle3DraftModel"
SHARD_FILE = "model-00001-of-00001.safetensors"   # the consolidated checkpointer's one shard
UNPREFIXED = ("lm_head.weight", "d2t", "t2d")     # outside `model.` in LlamaEagle3DraftModel (draft_llama.py:810-823)

# Knobs NeMo Automodel 0.7.0's Llama draft (draft_llama.py) cannot have: knob -> why. The same table decides
# what the NeMo adapter skips (conformance/adapters/nemo: `unsupported`).
CANNOT_EXPRESS = {
    "norm_before_fc": "no input norm over the aux states: project_hidden_states is fc_norm (optional) then fc "
                      "(draft_llama.py:900-922)",
    "norm_before_residual": "the residual is always the raw hidden (draft_llama.py:671)",
    "num_hidden_layers": "one EAGLE-3 layer: the model builds [Eagle3LlamaDecoderLayer(config, layer_id=0)] "
                         "(draft_llama.py:760); deeper layers exist only for P-EAGLE (parallel_drafting), "
                         "outside the TTT recurrence",
    "num_aux_hidden_states": "its trainer captures exactly 3 target layers (validate_eagle3_aux_layer_ids, "
                             "target.py:71-75)",
    "sliding_window": "its draft attention has no window (draft_llama.py:379-417 _eager_attention_forward)",
    "tie_word_embeddings": "the recipe forces tie_word_embeddings false (train_eagle3.py:621)",
    "draft_arch": "its draft layer is Llama-shaped for every dense target, without q_norm/k_norm "
                  "(draft_llama.py:252-264 Eagle3LlamaAttention); DeepSeek-V3 targets get its MLA draft "
                  "(speculative/eagle/registry.py:88)",
    # MLA drafts (DeepseekV3Eagle3DraftModel, draft_deepseek.py):
    "rope_interleave": "its MLA draft always rotates the rope slice interleaved (draft_deepseek.py:221-222, "
                       "models/deepseek_v3/rope_utils.py:122-156 apply_rotary_emb); it never reads rope_interleave",
    "mlp_bias": "its MLA draft's MLP is nn.Linear(bias=False) (draft_deepseek.py:267-269)",
    "partial_rotary_factor": "its rotary computes inv_freq for the partial width (rope_utils.py:199-200) but "
                             "apply_rotary_pos_emb multiplies the whole head by it (rope_utils.py:71): a shape error",
}
DEFAULTS = {"num_hidden_layers": 1, "num_aux_hidden_states": 3, "draft_arch": "llama", "partial_rotary_factor": 1}


def nemo_default_aux_ids(depth: int) -> tuple[int, ...] | None:
    """NeMo's default aux ids for a `depth`-layer target, in the training convention (input of layer i; its own
    ids are outputs of layers [1, depth // 2 - 1, depth - 4], target.py:56), or None where it refuses the depth."""
    outputs = [1, depth // 2 - 1, depth - 4]
    if any(c < 0 or c >= depth for c in outputs) or len(set(outputs)) != 3:
        return None   # target.py:57-61 raises: too shallow for the default recipe
    return tuple(i + 1 for i in outputs)


def target_depth(cfg: Eagle3Config) -> int:
    """The target depth a NeMo config states (it copies the target's num_hidden_layers): the one whose NeMo
    default is `cfg`'s aux ids, else the shallowest target the ids fit (NeMo's own ids are outputs of layers,
    so the deepest training id - 1 must be a layer of it: target.py:81-83)."""
    ids = cfg.aux_layer_ids
    if ids is None:
        return cfg.num_hidden_layers
    depth = ids[-1] + 3
    return depth if nemo_default_aux_ids(depth) == tuple(ids) else max(ids)


def inexpressible(cfg: Eagle3Config) -> dict[str, str]:
    """knob -> why, for every knob of `cfg` NeMo's draft cannot have (empty: it can express `cfg`)."""
    mla = cfg.draft_arch == "mla"
    differs = {"sliding_window": cfg.sliding_window is not None,
               **{knob: getattr(cfg, knob) != default for knob, default in DEFAULTS.items()},
               "draft_arch": cfg.draft_arch not in ("llama", "mla"),
               "rope_interleave": mla and not cfg.rope_interleave, "mlp_bias": mla and cfg.mlp_bias}
    return {knob: why for knob, why in CANNOT_EXPRESS.items() if differs.get(knob, getattr(cfg, knob))}


def format_checks(knobs: dict, problems: list, notes: list) -> None:
    """What a NeMo config states differently from the draft it describes (module docstring)."""
    depth = knobs["num_hidden_layers"]
    knobs["num_hidden_layers"] = 1
    notes.append(f"num_hidden_layers {depth} is the target's (NeMo copies the target's config, train_eagle3.py:610); "
                 "the draft has one layer (draft_llama.py:760)")
    if knobs["draft_arch"] == "mla":
        notes.append("a DeepSeek-V3 target's config: NeMo trains its MLA draft, DeepseekV3Eagle3DraftModel "
                     "(speculative/eagle/registry.py:88), although the file says LlamaEagle3DraftModel "
                     "(train_eagle3.py:613)")
    elif knobs["draft_arch"] != "llama":
        notes.append(f"model_type {knobs['draft_arch']!r} is the target's; NeMo's draft layer is Llama-shaped "
                     "(draft_llama.py:252-264)")
        knobs["draft_arch"] = "llama"
    if knobs["aux_layer_ids"] is None:
        ids = nemo_default_aux_ids(depth)
        knobs["aux_layer_ids"] = ids
        notes.append(f"aux ids not stated: NeMo's default for a {depth}-layer target, outputs of layers "
                     f"{[i - 1 for i in ids]} (target.py:42-61), unless the run set recipe_args.aux_layer_ids"
                     if ids else f"aux ids not stated, and NeMo has no default for a {depth}-layer target "
                                 "(target.py:57-61)")
    for knob in ("norm_before_fc", "norm_before_residual"):
        if knobs[knob]:
            problems.append((f"field {knob}", f"true: NeMo did not train it ({CANNOT_EXPRESS[knob]})"))
    if knobs["sliding_window"] is not None:
        problems.append(("field sliding_window", f"{knobs['sliding_window']}: NeMo did not train it "
                                                 f"({CANNOT_EXPRESS['sliding_window']})"))
    if knobs["draft_arch"] == "mla" and not knobs["rope_interleave"]:
        problems.append(("field rope_interleave",
                         f"false: NeMo did not train it ({CANNOT_EXPRESS['rope_interleave']})"))
    if knobs["partial_rotary_factor"] != 1:
        problems.append(("field partial_rotary_factor", f"{knobs['partial_rotary_factor']}: NeMo did not train it "
                                                        f"({CANNOT_EXPRESS['partial_rotary_factor']})"))


def parse(raw: dict, file: Path, name: str = NAME) -> ParsedConfig:
    """`name`: the format as detected (NeMo's layout under another class name reads the same, nemo_sglang.py)."""
    parsed = parse_flat(raw, file, name, format_checks=format_checks)
    if raw.get("parallel_drafting"):
        problems = (("field parallel_drafting", "true: a P-EAGLE head, not an EAGLE-3 TTT draft "
                                                "(draft_llama.py:84-103)"), *parsed.problems)
        return ParsedConfig(parsed.format, parsed.knobs, problems, parsed.notes, parsed.absent)
    return parsed


def stored_name(name: str) -> str:
    return name if name in UNPREFIXED else "model." + name


def config_json(cfg: Eagle3Config) -> dict:
    """The config.json NeMo's checkpointer writes for this draft: the target's LlamaConfig, serialized in
    full (`to_json_string(use_diff=False)`, checkpoint/addons.py), with the recipe's draft keys."""
    for knob, reason in inexpressible(cfg).items():
        raise ConversionError(f"nemo format cannot express {knob}={getattr(cfg, knob)!r}: {reason}")
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})}
    depth = target_depth(cfg)
    if cfg.draft_arch == "mla":
        return mla_config_json(cfg, rope, depth)
    stated = {} if cfg.aux_layer_ids is None or nemo_default_aux_ids(depth) == tuple(cfg.aux_layer_ids) else \
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                          "use_aux_hidden_state": True}}
    return {
        "_name_or_path": "",
        "architectures": [ARCHITECTURE],
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "chunk_size_feed_forward": 0,
        "draft_vocab_size": cfg.draft_vocab_size,
        "dtype": None,
        "eos_token_id": 2,
        "fc_norm": cfg.fc_norm,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "hidden_size": cfg.hidden_size,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "initializer_range": 0.02,
        "intermediate_size": cfg.intermediate_size,
        "is_encoder_decoder": False,
        "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "max_position_embeddings": cfg.max_position_embeddings,
        "mlp_bias": cfg.mlp_bias,
        "model_type": "llama",
        "norm_output": cfg.norm_output,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": depth,
        "num_key_value_heads": cfg.num_key_value_heads,
        "output_attentions": False,
        "output_hidden_states": False,
        "pad_token_id": None,
        "parallel_drafting": False,
        "pretraining_tp": 1,
        "problem_type": None,
        "return_dict": True,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "transformers_version": "5.19.0",
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
        **stated,
    }


def mla_config_json(cfg: Eagle3Config, rope: dict, depth: int) -> dict:
    """An MLA draft's config.json as the recipe writes it: the DeepSeek-V3 target's config `to_dict()` with the
    draft keys (train_eagle3.py:610-646), `architectures` LlamaEagle3DraftModel as for every draft (:613: the file
    never names DeepseekV3Eagle3DraftModel; NeMo picks that class from the *target's* architectures,
    speculative/eagle/registry.py:88, 156-158)."""
    from transformers import DeepseekV3Config

    target = DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=depth, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
        rope_interleave=cfg.rope_interleave, attention_bias=False, tie_word_embeddings=False)
    out = target.to_dict()
    out.update(architectures=[ARCHITECTURE], draft_vocab_size=cfg.draft_vocab_size,
               target_hidden_size=cfg.target_hidden_size, tie_word_embeddings=False, fc_norm=cfg.fc_norm,
               norm_output=cfg.norm_output, parallel_drafting=False)
    if cfg.aux_layer_ids is not None and nemo_default_aux_ids(depth) != tuple(cfg.aux_layer_ids):
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                               "use_aux_hidden_state": True}
    return out


def save_weights(stored: dict[str, torch.Tensor], out_dir: Path) -> list[Path]:
    """The consolidated checkpointer's layout: one shard and its index (consolidate_hf_safetensors), no
    safetensors metadata; every tensor keeps its dtype and bytes."""
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out_dir / SHARD_FILE))
    total = sum(v.numel() * v.element_size() for v in stored.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(stored, SHARD_FILE)}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out_dir / SHARD_FILE]
