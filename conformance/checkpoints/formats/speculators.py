"""speculators 0.9.0's format: what `Eagle3DraftModel.save_pretrained` writes (semantics §3.1).

The decoder layer is a nested `transformer_layer_config` (a LlamaConfig, or a Qwen3Config for
`draft_arch qwen3`, RoPE in `rope_parameters`); aux ids are in the training convention (input of
layer i, 0 = the embedding output) at the top level; tensors under the canonical names.
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.errors import CheckpointError, ConversionError, Fields
from conformance.checkpoints.knobs import DEFAULTED, ParsedConfig, check_contradictions, layer_knobs
from reference.eagle3 import Eagle3Config

NAME = "speculators"


def parse(raw: dict, file: Path) -> ParsedConfig:
    f = Fields(raw, file)
    if raw.get("speculators_model_type") != "eagle3":
        raise CheckpointError(file, "field speculators_model_type",
                              f"{raw.get('speculators_model_type')!r} is not an EAGLE-3 draft (expected 'eagle3')")
    problems, notes = [], []
    layer = f.sub("transformer_layer_config", required=True)
    knobs = layer_knobs(layer, problems, notes)
    ids = f.ids("eagle_aux_hidden_state_layer_ids")
    knobs.update(
        draft_vocab_size=f.int("draft_vocab_size"),
        target_hidden_size=f.int("target_hidden_size", knobs["hidden_size"]),
        num_aux_hidden_states=len(ids) if ids else 3,           # core.py:71-75
        norm_before_fc=f.bool("norm_before_fc"),
        fc_norm=f.bool("fc_norm"),
        norm_before_residual=f.bool("norm_before_residual"),
        norm_output=f.bool("norm_output"),
        tie_word_embeddings=f.bool("tie_word_embeddings", layer.bool("tie_word_embeddings")),
        aux_layer_ids=tuple(ids) if ids else None,
    )
    spec = f.sub("speculators_config")
    if spec is not None:
        methods = spec.raw.get("proposal_methods") or [{}]
        first = methods[0] if isinstance(methods, list) and methods else None
        if isinstance(first, dict) and "speculative_tokens" in first:
            notes.append(f"trained with {methods[0]['speculative_tokens']} TTT steps (speculative_tokens)")
        verifier = spec.raw.get("verifier") or {}
        if isinstance(verifier, dict) and verifier.get("architectures"):
            notes.append(f"verifier {verifier['architectures']}")
    if raw.get("embed_requires_grad"):
        notes.append("embed_requires_grad: the draft trained its own embed_tokens, but SGLang serves with the "
                     "target's (eagle_worker_v2.py:355-363)")
    check_contradictions(knobs, problems)
    return ParsedConfig(NAME, knobs, tuple(problems), tuple(notes), tuple(k for k in DEFAULTED if k not in raw))


def stored_name(name: str) -> str:
    return name


def layer_config(cfg: Eagle3Config) -> dict:
    """transformer_layer_config: the HF decoder config of the draft's own layers."""
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(dict(cfg.rope_scaling or {}))}
    if cfg.partial_rotary_factor != 1:   # where transformers 5 keeps it (modeling_rope_utils.py)
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
    layer = {
        "model_type": cfg.draft_arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if cfg.draft_arch == "qwen3":   # Qwen3Config has no mlp_bias (Qwen3MLP: bias=False)
        del layer["mlp_bias"]
    if cfg.draft_arch == "mla":   # a DeepseekV3Config layer: the suite's own (speculators has no MLA draft layer)
        layer.update(model_type="deepseek_v3", q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                     qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                     v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave)
    if cfg.sliding_window is not None:
        layer.update(sliding_window=cfg.sliding_window, use_sliding_window=True,
                     layer_types=["sliding_attention"] * cfg.num_hidden_layers)
    return layer


def config_json(cfg: Eagle3Config) -> dict:
    """config.json as speculators 0.9.0 `Eagle3DraftModel.save_pretrained` writes it (semantics §3.1)."""
    if cfg.aux_layer_ids is None and cfg.num_aux_hidden_states != 3:
        raise ConversionError(f"speculators format cannot express num_aux_hidden_states="
                              f"{cfg.num_aux_hidden_states} without aux layer ids (core.py:71-75: len(ids) or 3)")
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            # No verifier: the tiny draft carries its own embed_tokens and lm_head. Note that
            # speculators' Eagle3DraftModel.from_pretrained still calls AutoConfig.from_pretrained(None)
            # in its load_verifier_weights override (core.py:174-180); see adapters/speculators/adapter.py.
            "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer_config(cfg),
    }
