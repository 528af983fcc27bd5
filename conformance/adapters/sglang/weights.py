"""SGLang's weight accounting: `load_weights` replayed with every parameter's `weight_loader` observed.

The wrapper records the call and forwards it (observation only), which says which checkpoint tensor
reached which parameter, and which shard of a fused one (qkv_proj, gate_up_proj); every landed
tensor is then verified bit for bit against the checkpoint (conformance/loading/accounting.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from conformance.checkpoints import weight_files
from conformance.loading.accounting import Accounting, finite, load_and_count, observed_knobs, rope_text, vocab_map
from conformance.loading.observed_loaders import observed_weight_loaders

# SGLang's rotary classes by the rope_type they implement (layers/rotary_embedding/).
ROPE_TYPES = {"RotaryEmbedding": "default", "LinearScalingRotaryEmbedding": "linear",
              "Llama3RotaryEmbedding": "llama3", "YaRNScalingRotaryEmbedding": "yarn",
              "DeepseekScalingRotaryEmbedding": "deepseek_yarn"}


def account(adapter, ckpt_dir: Path, dtype: torch.dtype, target: dict | None) -> Accounting:
    """`adapter` (SGLangAdapter) loads `ckpt_dir`; its load is replayed, observed, and accounted for."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader, safetensors_weights_iterator

    acct, ckpt, loaded = load_and_count(adapter.name, ckpt_dir, lambda: adapter.load(ckpt_dir, dtype))
    if loaded is None:
        return acct
    model = loaded.model
    params = dict(model.named_parameters())
    calls: list[tuple[str, str, object]] = []   # (checkpoint tensor, parameter, shard id)
    current: list[str] = [""]

    def named_weights():
        for name, tensor in safetensors_weights_iterator([str(p) for p in weight_files(ckpt_dir)]):
            current[0] = name
            yield name, tensor

    # the same load the adapter just did, observed: values are rewritten with themselves
    with observed_weight_loaders(params, default_weight_loader,
                                 lambda pname, tensor, shard: calls.append((current[0], pname, shard))):
        model.load_weights(named_weights())

    reached = {c for c, _, _ in calls}
    for ckpt_name, pname, shard in calls:
        acct.land_rows(ckpt_name, pname, params[pname], _shard_rows(model, pname, shard), ckpt[ckpt_name])
    for name in sorted(ckpt):
        if name in reached:
            continue
        if "d2t" in name:      # becomes hot_token_id = d2t + arange (llama_eagle3.py:349-353)
            hot = model.get_hot_token_id()
            ok = hot is not None and torch.equal(hot.cpu(), ckpt[name] + torch.arange(ckpt[name].shape[0]))
            acct.landed.append((name, "hot_token_id (d2t + arange)"))
            if not ok:
                acct.differs.append("hot_token_id")
        elif "t2d" in name:    # skipped by its own code (llama_eagle3.py:355-356)
            acct.ignored.append(name)
        else:
            acct.dropped.append(name)
    loaded_params = {p for _, p, _ in calls}
    acct.never_loaded = sorted(set(params) - loaded_params)
    acct.nan = sorted(n for n, p in params.items() if not finite(p))

    cfg = model.config
    acct.vocab_map = vocab_map(ckpt, cfg.vocab_size, cfg.draft_vocab_size)
    acct.uses = _uses(model, target)
    acct.knobs = _knobs(loaded, ckpt)
    return acct


def _uses(model, target: dict | None) -> dict[str, str]:
    """What embed_tokens, lm_head and d2t really are when SGLang serves this draft."""
    inner, cfg = model.model, model.config
    tied = model.lm_head is inner.embed_tokens
    Ht, H = inner.hidden_size_in, cfg.hidden_size
    serve_embed = "the target's (set_embed, eagle_worker_v2.py:355-363)" if Ht == H else \
        "its own (target_hidden_size != hidden_size disables set_embed, llama.py:910-916)"
    if target is not None and Ht == H:
        t_vocab, t_hidden = target.get("vocab_size"), target.get("hidden_size")
        if (t_vocab, t_hidden) != (cfg.vocab_size, H):
            serve_embed += (f"; MISMATCH: target embedding is [{t_vocab}, {t_hidden}], "
                            f"the draft's [{cfg.vocab_size}, {H}]")
    return {
        "embed_tokens": f"checkpoint in this run; in serving {serve_embed}",
        "lm_head": ("embed_tokens (tied; becomes the target's embedding when served)" if tied
                    else "the target's lm_head (no draft_vocab_size, llama_eagle3.py:306-308)"
                    if model.load_lm_head_from_target else "checkpoint lm_head"),
        "d2t": "hot_token_id = d2t + arange" if model.get_hot_token_id() is not None
               else "none: draft ids used as target ids",
    }


def _knobs(loaded, ckpt: dict[str, torch.Tensor]) -> dict:
    """The effective knob values: read from the built model's own modules, and what no attribute states
    (fc run or skipped, the residual, the norm of layers >= 1) observed by running it (observed_knobs)."""
    model = loaded.model
    inner, cfg = model.model, model.config
    Ht = inner.hidden_size_in
    attn = inner.layers[0].self_attn
    window = attn.attn.sliding_window_size
    seen = observed_knobs(loaded, inner.num_aux_hidden_states * Ht, cfg.vocab_size, ckpt,
                          dict(model.named_parameters()))
    return {
        "aux states x width": f"{inner.num_aux_hidden_states} x {Ht}",
        "fc": f"{inner.fc.in_features} -> {inner.fc.out_features}, {seen['fc']}",
        "norm_before_fc": inner.input_norm is not None, "fc_norm": inner.fc_norm is not None,
        "norm_before_residual": seen["norm_before_residual"],
        "norm_output": bool(inner.norm_output),
        "layers": len(inner.layers),
        "heads / kv heads / head_dim": f"{attn.num_heads}/{attn.num_kv_heads}/{attn.head_dim}",
        "rope": rope_text(ROPE_TYPES.get(type(attn.rotary_emb).__name__, type(attn.rotary_emb).__name__),
                          attn.rotary_emb.base),
        "q/k/v bias": attn.qkv_proj.bias is not None,
        "mlp bias": getattr(inner.layers[0].mlp.gate_up_proj, "bias", None) is not None,
        "sliding window": window if window not in (None, -1) else "none",
        "vocab / draft vocab": f"{cfg.vocab_size}/{cfg.draft_vocab_size}",
        "layers >= 1 pre-norm": seen["layers >= 1 pre-norm"],
    }


def _shard_rows(model, pname: str, shard) -> tuple[int, int] | None:
    """Rows of a fused parameter (qkv_proj, gate_up_proj) that one shard fills; None when not fused."""
    if shard is None:
        return None
    module = model.get_submodule(pname.rsplit(".", 1)[0])
    if hasattr(module, "q_proj_shard_size"):   # QKVParallelLinear: [q | k | v]
        q, kv = module.q_proj_shard_size, module.kv_proj_shard_size
        start = {"q": 0, "k": q, "v": q + kv}[shard]
        return start, start + (q if shard == "q" else kv)
    sizes = module.output_sizes                  # MergedColumnParallelLinear: [gate | up]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]
