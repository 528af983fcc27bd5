"""SGLang's format: a flat config with `architectures: [LlamaForCausalLMEagle3]` (semantics §3.2).

Aux ids live in `eagle_config` in SGLang's convention (output of layer i: the training id - 1, SGLang
adds 1 back, llama.py:929-941); tensors under the canonical names. Knobs SGLang never reads
(norm_before_residual, sliding_window) are written anyway, so a round trip keeps them.
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.formats.flat import parse_flat
from conformance.checkpoints.knobs import ParsedConfig
from reference.eagle3 import Eagle3Config

NAME = "sglang"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def parse(raw: dict, file: Path) -> ParsedConfig:
    return parse_flat(raw, file, NAME)


def stored_name(name: str) -> str:
    return name


def config_json(cfg: Eagle3Config) -> dict:
    """config.json in the SGLang/EAGLE-3 format (`LlamaForCausalLMEagle3`, semantics §3.2)."""
    out = {
        "architectures": [ARCHITECTURE],
        # qwen3: transformers builds a Qwen3Config, but SGLang's draft is LlamaForCausalLMEagle3 whatever
        # the model_type (its EntryClass, llama_eagle3.py:382): the suite shows what that drops.
        "model_type": cfg.draft_arch,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "norm_before_residual": cfg.norm_before_residual,
    }
    if cfg.partial_rotary_factor != 1:   # the top-level key is the only place SGLang reads (llama.py:199-200)
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.aux_layer_ids:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layer_ids],
                               "use_aux_hidden_state": True}
    elif cfg.num_aux_hidden_states != 3:   # SGLang reads it before falling back to 3 (llama_eagle3.py:157-161)
        out["num_aux_hidden_states"] = cfg.num_aux_hidden_states
    if cfg.sliding_window is not None:     # written for round trips; SGLang's draft never reads it
        out.update(sliding_window=cfg.sliding_window, use_sliding_window=True)
    return out
