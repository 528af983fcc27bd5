"""Weight accounting, vLLM's side (part of worker.py, in vLLM's environment): the draft loaded as the proposer
loads it (worker_load.py), then its `load_weights` replayed with every parameter's `weight_loader` observed
(conformance/loading/observed_loaders.py, imported by path); the adapter accounts for it
(conformance/adapters/vllm/weights.py)."""
from __future__ import annotations

import torch
from observed_loaders import observed_weight_loaders
from safetensors.torch import save_file
from worker_load import STATE, Loaded, load


# vLLM's rotary classes by the rope_type they implement (model_executor/layers/rotary_embedding/).
ROPE_TYPES = {"RotaryEmbedding": "default", "LinearScalingRotaryEmbedding": "linear",
              "Llama3RotaryEmbedding": "llama3", "YaRNScalingRotaryEmbedding": "yarn",
              "DeepseekScalingRotaryEmbedding": "deepseek_yarn"}


def account(req: dict) -> dict:
    """The draft loaded as `load` does, then its `load_weights` replayed with every parameter's `weight_loader`
    observed (the wrapper records the call and forwards it: values are rewritten with themselves). vLLM's loader
    first collects the renamed tensors in a dict (llama_eagle3.py:420-470), so a call is tied to its checkpoint
    tensor by storage, not by iteration order. Answers the calls (tensor, parameter, rows of a fused one), the
    parameters after loading (a safetensors file: the adapter verifies each landing by value) and the knobs the
    built modules state; the adapter observes the rest by running the draft (`handle`)."""
    answer = load(req)
    loaded: Loaded = STATE["loaded"][answer["handle"]]
    loaded.watch_runs()   # the adapter's probe run then says which modules run (`ran`)
    model = loaded.model
    return {**answer, **observed_load_weights(model, req), "knobs": built_knobs(model),
            "sizes": {"vocab": int(model.config.vocab_size), "draft_vocab": int(model.config.draft_vocab_size),
                      "hidden": int(model.config.hidden_size),
                      "aux_width": int(getattr(model.model, "fc_input_size", model.config.hidden_size))}}


def observed_load_weights(model, req: dict) -> dict:
    """`model.load_weights` over the checkpoint req["weights"] with every parameter's weight_loader observed, the
    parameters afterwards written to req["params"]. -> {"calls": [checkpoint tensor, parameter, rows of a fused one],
    "own": whether the embedding and the head are the draft's own}."""
    from safetensors import safe_open

    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    with safe_open(req["weights"], framework="pt") as f:
        ckpt = {name: f.get_tensor(name) for name in f.keys()}
    by_storage = {t.untyped_storage().data_ptr(): name for name, t in ckpt.items()}
    calls: list[list] = []

    def record(pname, tensor, shard):
        name = by_storage.get(tensor.untyped_storage().data_ptr(), "<not a checkpoint tensor>")
        calls.append([name, pname, shard_rows(model, pname, shard)])

    with observed_weight_loaders(params, default_weight_loader, record), torch.no_grad():
        model.load_weights(iter(ckpt.items()))
    save_file({name: p.detach().contiguous().clone() for name, p in params.items()}, req["params"])
    return {"calls": calls, "own": {"embed_tokens": bool(getattr(model, "has_own_embed_tokens", True)),
                                    "lm_head": bool(getattr(model, "has_own_lm_head", True))}}


def ran(req: dict) -> dict:
    """The modules with parameters that have run in a forward of this draft so far."""
    return {"modules": sorted(STATE["loaded"][req["handle"]].ran)}


def shard_rows(model, pname: str, shard) -> list[int] | None:
    """Rows of a fused parameter (qkv_proj: [q | k | v], gate_up_proj: [gate | up]) one shard fills; None when
    not fused. vLLM's `output_sizes` are the shards' widths (layers/linear.py:727, :1073-1077)."""
    if shard is None:
        return None
    module = model.get_submodule(pname.rsplit(".", 1)[0])
    index = {"q": 0, "k": 1, "v": 2}.get(shard, shard)
    start = sum(module.output_sizes[:index])
    return [start, start + module.output_sizes[index]]


def built_knobs(model) -> dict:
    """The knob values the built modules state (the knob table's rows; observed ones come from the adapter)."""
    inner, cfg = model.model, model.config
    attn = inner.layers[0].self_attn
    rope = attn.rotary_emb
    window = getattr(attn.attn, "sliding_window", None)
    fc = getattr(inner, "fc", None)
    # Llama drafts: num_aux_hidden_states (llama_eagle3.py:209-221); Qwen3: num_aux_layers (qwen3_eagle3.py:201-211)
    aux = getattr(inner, "num_aux_hidden_states", None) or getattr(inner, "num_aux_layers", None)
    return {
        "aux states x width": f"{aux} x {inner.fc_input_size // aux}" if inner.use_aux_hidden_state
                              else "none (use_aux_hidden_state false)",
        "fc in -> out": f"{fc.input_size} -> {fc.output_size}" if fc is not None else "none",
        "norm_before_fc": inner.norm_before_fc, "fc_norm": getattr(inner, "fc_norm", None) is not None,
        "norm_output": bool(inner.norm_output),
        "layers": len(inner.layers),
        "heads / kv heads / head_dim": f"{attn.total_num_heads}/{attn.total_num_kv_heads}/{attn.head_dim}",
        "rope": [ROPE_TYPES.get(type(rope).__name__, type(rope).__name__), float(rope.base)],
        "q/k/v bias": attn.qkv_proj.bias is not None,
        "mlp bias": getattr(inner.layers[0].mlp.gate_up_proj, "bias", None) is not None,
        "sliding window": window if window not in (None, -1) else "none",
        "vocab / draft vocab": f"{cfg.vocab_size}/{cfg.draft_vocab_size}",
    }
