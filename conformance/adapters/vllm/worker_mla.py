"""vLLM's MLA EAGLE-3 draft (`Eagle3DeepseekV2ForCausalLM`, vllm/model_executor/models/deepseek_eagle3.py) read and
loaded by vLLM's own code (part of worker.py, in vLLM's environment): its config resolution (EngineArgs ->
SpeculativeConfig -> the draft's ModelConfig), the class it builds, what the built modules state, and its
`load_weights` replayed with every parameter's `weight_loader` observed, as for the Llama draft (worker_accounting.py).
Its forward is never run here: its attention on a CPU host is CPU_MLA, whose decode calls a compiled op of vLLM's CPU
build (adapter.py MLA_FORWARD)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from worker_accounting import observed_load_weights
from worker_load import build


def mla_reading(req: dict) -> dict:
    """vLLM's reading of an MLA draft's config: the draft built from it (no weight read: vLLM's dummy loader) and
    what its config and its modules say; its rope table's cos and sin halves at `positions` in a safetensors file
    (`rope`), as its rotary embedding holds them (cos_sin_cache: [cos | sin] per position, the scale applied)."""
    model, _, spec = build(req, load_format="dummy")
    cache = model.model.layers[0].self_attn.rotary_emb.cos_sin_cache
    cos, sin = cache.index_select(0, torch.tensor(req["positions"], dtype=torch.long)).chunk(2, dim=-1)
    save_file({"cos": cos.contiguous(), "sin": sin.contiguous()}, req["rope"])
    return reading(model, spec)


def mla_config(req: dict) -> dict:
    """vLLM's config resolution alone (EngineArgs -> SpeculativeConfig -> the draft's ModelConfig), nothing built:
    for a published draft whose real size this host does not build."""
    from worker_config import engine_config

    spec = engine_config(Path(req["ckpt"]), req["dtype"], 1, Path(req["work"]), load_format="dummy").speculative_config
    mc, hf = spec.draft_model_config, spec.draft_model_config.hf_config
    keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_attention_heads",
            "hidden_size", "num_hidden_layers", "rms_norm_eps", "vocab_size", "draft_vocab_size", "fc_norm",
            "norm_output", "norm_before_residual", "norm_before_fc")
    return {"class": mc.architecture, "config_class": type(hf).__name__, "model_type": hf.model_type,
            "architectures": list(getattr(hf, "architectures", None) or []),
            "is_deepseek_mla": bool(mc.is_deepseek_mla), "use_mla": bool(mc.use_mla),
            "rope_parameters": dict(getattr(hf, "rope_parameters", None) or {}),
            **{k: getattr(hf, k, None) for k in keys}}


def reading(model, spec) -> dict:
    """What vLLM resolved from the draft's config (its ModelConfig and hf_config) and what the built modules state."""
    mc, hf = spec.draft_model_config, spec.draft_model_config.hf_config
    inner = model.model
    layer = inner.layers[0]
    attn = layer.self_attn
    rope = attn.rotary_emb
    fused = getattr(attn, "fused_qkv_a_proj", None)
    backend = next((m.attn_backend for m in model.modules() if hasattr(m, "attn_backend")), None)
    eagle = getattr(hf, "eagle_config", None) or {}
    return {
        "class": type(model).__name__, "config_class": type(hf).__name__, "model_type": hf.model_type,
        "architectures": list(getattr(hf, "architectures", None) or []),
        "is_deepseek_mla": bool(mc.is_deepseek_mla), "use_mla": bool(mc.use_mla),
        "attention_backend": backend.get_name() if backend is not None else None,
        "attention_class": type(attn).__name__, "num_heads": attn.num_heads, "q_lora_rank": attn.q_lora_rank,
        "kv_lora_rank": attn.kv_lora_rank,
        "qk_nope_head_dim": attn.qk_nope_head_dim, "qk_rope_head_dim": attn.qk_rope_head_dim,
        "v_head_dim": attn.v_head_dim,
        # q_a_proj and kv_a_proj_with_mqa in one parameter, by rows (deepseek_v2.py:1052-1058)
        "fused_a_rows": list(fused.output_sizes) if fused is not None else None,
        "attn_input": (fused or attn.kv_a_proj_with_mqa).input_size,
        "softmax_scale": float(attn.scaling),
        "rope_class": type(rope).__name__, "rope_interleaved": not rope.is_neox_style,
        "rotary_dim": rope.rotary_dim, "rope_base": float(rope.base),
        "rope_factor": float(getattr(rope, "scaling_factor", 1.0)), "rope_mscale": float(getattr(rope, "mscale", 1.0)),
        "rope_beta": [getattr(rope, "beta_fast", None), getattr(rope, "beta_slow", None)],
        "rope_context": rope.max_position_embeddings,
        "rope_parameters": dict(getattr(hf, "rope_parameters", None) or {}),
        "rms_norm_eps": float(inner.norm.variance_epsilon),
        "layers": len(inner.layers),
        "num_aux_hidden_states": inner.num_aux_hidden_states,
        "fc": [inner.fc.input_size, inner.fc.output_size],
        "fc_norm": inner.fc_norm is not None, "norm_output": bool(inner.norm_output),
        "norm_before_residual": layer._residual_norm.__name__ == "_norm_before_residual",
        # an input norm over the aux states before fc (norm_before_fc): a module of that role, if any
        "input_norm": any(n.endswith(("input_norm", "norm_before_fc")) for n, _ in inner.named_modules()),
        "aux_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None,
        "vocab": int(hf.vocab_size), "draft_vocab": int(hf.draft_vocab_size),
        "d2t_parameter": model.draft_id_to_target_id is not None,
        "hidden_act": type(layer.mlp.act_fn).__name__,
    }


def mla_account(req: dict) -> dict:
    """The draft built and loaded as the proposer does (get_model -> load_weights), then its `load_weights` replayed
    with every parameter's weight_loader observed; a call is tied to its checkpoint tensor by storage (the loader
    first collects the renamed tensors in a dict, deepseek_eagle3.py:370-398). Answers the calls (tensor, parameter,
    rows of a fused one), the parameters after loading (a safetensors file), what is its own, and the sizes."""
    model, _, _ = build(req)
    return {**observed_load_weights(model, req), "class": type(model).__name__,
            "sizes": {"vocab": int(model.config.vocab_size), "draft_vocab": int(model.config.draft_vocab_size),
                      "hidden": int(model.config.hidden_size)}}
