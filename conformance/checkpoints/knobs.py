"""What a draft config.json says, in training semantics: the knobs every format shares.

Each format module (conformance/checkpoints/formats/) reads its own keys and uses these helpers for
the decoder-layer part (a LlamaConfig or Qwen3Config: flat, or speculators' transformer_layer_config),
the RoPE block and the knob combinations no implementation can run. Unsupported or contradictory
knobs become `problems` (field, why); facts an implementation reads differently become `notes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from conformance.checkpoints.errors import CheckpointError, Fields
from reference.eagle3 import DRAFT_ARCHS, Eagle3Config
from reference.rope import ROPE_TYPES

CONFIG_FILE = "config.json"
# Knobs of other model families that change the forward pass and that no implementation here models.
FOREIGN_KNOBS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# SGLang reads partial_rotary_factor as a config attribute only (llama.py:199-200); transformers keeps
# it inside rope_parameters, where speculators' rotary embedding reads it (modeling_rope_utils.py).
SGLANG_PARTIAL_ROTARY = "sglang/srt/models/llama.py:199-200"
# How training reads a key the file states otherwise (ParsedConfig.overruled).
TRAINED_AS = {"tie_word_embeddings": False}
# Keys a speculators-format config may leave out, which each reader then defaults its own way.
DEFAULTED = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# The longest context a config may state: above any model's (Llama 4 Scout states 10,485,760), and SGLang's
# rotary embedding allocates its cos/sin cache for every position up to it.
MAX_POSITIONS = 2 ** 24
# model_types whose decoder layer is DeepSeek's MLA (draft_arch "mla") when the config states kv_lora_rank.
MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")


@dataclass(frozen=True)
class ParsedConfig:
    """What a config.json says, in training semantics; `problems` say why the reference cannot run it."""

    format: str
    knobs: dict                                   # Eagle3Config field -> value
    problems: tuple[tuple[str, str], ...] = ()    # (field, why): unsupported or contradictory knobs
    notes: tuple[str, ...] = ()                   # facts for the report (keys an implementation ignores, ...)
    absent: tuple[str, ...] = ()                  # DEFAULTED keys the file leaves to each reader's default

    @property
    def runnable(self) -> bool:
        return not self.problems

    @property
    def overruled(self) -> dict[str, object]:
        """Keys the file states that training does not read as stated: {key: the value as written}. A tie flag
        with a pruned draft vocabulary: no trainer ties (speculators model.py:578, SpecForge modeling/auto.py:
        90-92), so the draft was trained with its own lm_head.weight, while SGLang ties (llama_eagle3.py:303-304)."""
        k = self.knobs
        tied = k.get("tie_word_embeddings") and k.get("draft_vocab_size") != k.get("vocab_size")
        return {"tie_word_embeddings": True} if tied else {}

    def config(self, file: str | Path = CONFIG_FILE) -> Eagle3Config:
        """The config in training semantics: the knobs, with each overruled key as training reads it."""
        if self.problems:
            raise CheckpointError(file, *self.problems[0])
        return Eagle3Config(**{**self.knobs, **{key: TRAINED_AS[key] for key in self.overruled}})


def rope(theta: float, scaling: dict | None, f: Fields, where: str, problems: list):
    """(rope_theta, rope_scaling or None, partial_rotary_factor or None) from one RoPE block, with the
    legacy `type` key and inline `rope_theta` / `partial_rotary_factor` folded in."""
    if not scaling:
        return theta, None, None
    scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:   # legacy key (e.g. qwen2.5-vl's mrope)
        scaling["rope_type"] = scaling.pop("type")
    block = Fields(scaling, f.file, f"{where}.")
    theta_field = f"field {where}.rope_theta" if "rope_theta" in scaling else f"field {f.prefix}rope_theta"
    theta = block.number("rope_theta", theta)
    scaling.pop("rope_theta", None)
    partial = block.number("partial_rotary_factor", 0) or None
    scaling.pop("partial_rotary_factor", None)
    kind = block.string("rope_type", "default")
    if kind == "default" and "mrope_section" not in scaling:
        return theta, None, partial
    if "mrope_section" in scaling:
        kind = "mrope"
    if kind not in ROPE_TYPES:
        problems.append((f"field {where}.rope_type", f"{kind} RoPE is not implemented by the reference "
                                                     f"(implemented: {', '.join(ROPE_TYPES)})"))
        return theta, scaling, partial
    required = {"linear": ("factor",), "yarn": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}[kind]
    for key in required:
        block.number(key)
    # Every other key the reference's RoPE reads (reference/eagle3.py rope_inv_freq), typed as it reads them.
    old_context = block.optional_number("original_max_position_embeddings")
    if old_context is not None and old_context > MAX_POSITIONS:
        problems.append((f"field {where}.original_max_position_embeddings",
                         f"{old_context} is absurdly large (at most {MAX_POSITIONS})"))
    for key in ("attention_factor", "beta_fast", "beta_slow"):
        block.optional_number(key)
    for key in ("mscale", "mscale_all_dim"):
        block.optional_number(key, zero=True)
    block.bool("truncate", True)
    if kind == "yarn" and theta == 1:   # its correction range divides by log(rope_theta)
        problems.append((theta_field, "1 with yarn RoPE: its correction range divides by log(rope_theta)"))
    return theta, scaling, partial


def layer_knobs(f: Fields, problems: list, notes: list) -> dict:
    """The decoder-layer part of a draft config (flat formats, or speculators' transformer_layer_config)."""
    H = f.int("hidden_size")
    nh = f.int("num_attention_heads")
    head_dim = f.int("head_dim", H // nh if H % nh == 0 else None)
    theta = f.number("rope_theta", 10000.0)
    params = f.sub("rope_parameters")
    scaling = f.sub("rope_scaling")
    if params is not None:   # transformers 5 (SGLang reads it first too, llama_eagle3.py:132-136)
        theta, rope_scaling, partial = rope(theta, params.raw, f, f"{f.prefix}rope_parameters", problems)
    else:
        theta, rope_scaling, partial = rope(theta, scaling.raw if scaling else None, f, f"{f.prefix}rope_scaling",
                                            problems)
    # transformers: the value inside the RoPE block wins, the top-level key is the fallback.
    partial = partial or f.number("partial_rotary_factor", 1.0)
    layer_types = f.strings("layer_types") or []
    sliding = "sliding_attention" in layer_types or (not layer_types and f.bool("use_sliding_window"))
    window = f.int("sliding_window", None, minimum=0) if sliding and f.has("sliding_window") else None
    if f.has("sliding_window") and window is None:
        notes.append(f"{f.prefix}sliding_window {f.raw['sliding_window']} is inactive (use_sliding_window false / "
                     "no sliding_attention layer)")
    for key in FOREIGN_KNOBS:
        if key in f.raw:
            problems.append((f"field {f.prefix}{key}", f"{f.raw[key]} changes the forward pass and is not "
                                                       "implemented by the reference or SGLang's Llama draft"))
    model_type = f.string("model_type", "llama")
    mla = model_type in MLA_MODEL_TYPES and f.has("kv_lora_rank")
    arch = "mla" if mla else model_type if model_type in DRAFT_ARCHS and model_type != "mla" else "llama"
    if arch == "llama" and model_type != "llama":
        notes.append(f"{f.prefix}model_type {model_type!r} on a Llama EAGLE-3 draft")
    mlp_bias = f.bool("mlp_bias")
    if arch == "qwen3" and mlp_bias:   # Qwen3MLP is built with bias=False whatever the config says
        notes.append(f"{f.prefix}mlp_bias true is ignored by qwen3 layers (transformers Qwen3MLP has no biases)")
        mlp_bias = False
    if mla:   # DeepseekV3Config: no GQA, head_dim is the rope slice (configuration_deepseek_v3.py)
        nh_kv, head_dim = nh, f.int("qk_rope_head_dim")
        extra = dict(q_lora_rank=f.int("q_lora_rank") if f.has("q_lora_rank") else None,
                     kv_lora_rank=f.int("kv_lora_rank"), qk_nope_head_dim=f.int("qk_nope_head_dim"),
                     qk_rope_head_dim=head_dim, v_head_dim=f.int("v_head_dim"),
                     rope_interleave=f.bool("rope_interleave", True))
    else:
        nh_kv, extra = f.int("num_key_value_heads", nh), {}
    return dict(
        vocab_size=f.int("vocab_size"),
        hidden_size=H,
        intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=f.int("num_hidden_layers"),
        num_attention_heads=nh,
        num_key_value_heads=nh_kv,
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=f.int("max_position_embeddings", deepseek_default("max_position_embeddings") if mla
                                      else 2048, maximum=MAX_POSITIONS),
        attention_bias=f.bool("attention_bias"),
        mlp_bias=mlp_bias,
        hidden_act=f.string("hidden_act", "silu"),
        sliding_window=window,
        draft_arch=arch,
        partial_rotary_factor=partial,
        **extra,
    )


def check_contradictions(knobs: dict, problems: list) -> None:
    """Knob combinations no implementation can run; each becomes a (field, why) problem."""
    V, Vd = knobs["vocab_size"], knobs["draft_vocab_size"]
    if Vd > V:
        problems.append(("field draft_vocab_size", f"{Vd} is larger than vocab_size {V}"))
    if knobs["norm_before_fc"] and knobs["fc_norm"]:
        problems.append(("field fc_norm", "contradicts norm_before_fc: the two are mutually exclusive "
                                          "(speculators config.py:89-96)"))
    nh, nkv = knobs["num_attention_heads"], knobs["num_key_value_heads"]
    if nh % nkv:
        problems.append(("field num_key_value_heads", f"{nkv} does not divide num_attention_heads {nh}"))
    ids = knobs["aux_layer_ids"]
    if ids is not None and len(ids) != knobs["num_aux_hidden_states"]:
        problems.append(("field num_aux_hidden_states", f"{knobs['num_aux_hidden_states']} contradicts the "
                                                        f"{len(ids)} aux layer ids {list(ids)}"))
    if knobs["hidden_act"] != "silu":
        problems.append(("field hidden_act", f"{knobs['hidden_act']!r} is not implemented (SGLang's draft MLP is "
                                             "silu only)"))
    if knobs["sliding_window"] is not None and knobs["sliding_window"] < 1:
        problems.append(("field sliding_window", f"expected a positive window, got {knobs['sliding_window']}"))
    factor, hd = knobs["partial_rotary_factor"], knobs["head_dim"]
    if factor > 1 or int(hd * factor) % 2 or int(hd * factor) < 2:
        problems.append(("field partial_rotary_factor", f"{factor} of head_dim {hd} rotates {int(hd * factor)} "
                                                        "channels: expected an even number >= 2, at most head_dim"))


def deepseek_default(key: str):
    """DeepseekV3Config's default for `key`: what an MLA draft's config reads when it leaves `key` out, in training
    (TorchSpec reads the draft config through it) and in SGLang (model_type kimi_k2 / deepseek_v3,
    utils/hf_transformers/common.py:229-233)."""
    from inspect import signature

    from transformers import DeepseekV3Config

    return signature(DeepseekV3Config.__init__).parameters[key].default
