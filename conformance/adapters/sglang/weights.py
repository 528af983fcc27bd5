"""SGLang's weight accounting: `load_weights` replayed with every parameter's `weight_loader` observed.

The wrapper records the call and forwards it (observation only), which says which checkpoint tensor
reached which parameter, and which shard of a fused one (qkv_proj, gate_up_proj); every landed
tensor is then verified bit for bit against the checkpoint (conformance/loading/accounting.py).
"""
from __future__ import annotations

from pathlib import Path

import torch

from conformance.checkpoints import weight_files
from conformance.loading.accounting import (Accounting, finite, load_and_count, mla_text, observed_knobs, rope_text,
                                            vocab_map)
from conformance.loading.observed_loaders import observed_weight_loaders

# SGLang's rotary classes by the rope_type they implement (layers/rotary_embedding/).
ROPE_TYPES = {"RotaryEmbedding": "default", "LinearScalingRotaryEmbedding": "linear",
              "Llama3RotaryEmbedding": "llama3", "YaRNScalingRotaryEmbedding": "yarn",
              "DeepseekScalingRotaryEmbedding": "deepseek_yarn"}


def account(adapter, ckpt_dir: Path, dtype: torch.dtype, target: dict | None) -> Accounting:
    """`adapter` (SGLangAdapter) loads `ckpt_dir`; its load is replayed, observed, and accounted for."""
    acct, ckpt, loaded = load_and_count(adapter.name, ckpt_dir, lambda: adapter.load(ckpt_dir, dtype))
    if loaded is None:
        return acct
    model = loaded.model
    replay(acct, ckpt, ckpt_dir, model)
    cfg = model.config
    acct.vocab_map = vocab_map(ckpt, cfg.vocab_size, cfg.draft_vocab_size)
    acct.uses = _uses(model, target)
    acct.knobs = _knobs(loaded, ckpt)
    return acct


def replay(acct: Accounting, ckpt: dict[str, torch.Tensor], ckpt_dir: Path, model) -> None:
    """`model`'s own `load_weights` run again on `ckpt_dir` with every parameter's weight_loader observed (values
    are rewritten with themselves): each checkpoint tensor's landing verified bit for bit, or it is named as
    dropped; d2t checked where SGLang keeps it (hot_token_id), t2d ignored as its own code does; the parameters
    no tensor reached, and those not finite."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader, safetensors_weights_iterator

    params = dict(model.named_parameters())
    calls: list[tuple[str, str, object]] = []   # (checkpoint tensor, parameter, shard id)
    current: list[str] = [""]

    def named_weights():
        for name, tensor in safetensors_weights_iterator([str(p) for p in weight_files(ckpt_dir)]):
            current[0] = name
            yield name, tensor

    with observed_weight_loaders(params, default_weight_loader,
                                 lambda pname, tensor, shard: calls.append((current[0], pname, shard))):
        model.load_weights(named_weights())

    reached = set()
    for ckpt_name, pname, shard in calls:
        for name, rows in _pieces(model, ckpt_name, pname, shard):
            reached.add(name)
            acct.land_rows(name, pname, params[pname], rows, ckpt[name])
    for name in sorted(ckpt):
        if name in reached:
            continue
        if "d2t" in name:   # hot_token_id = d2t + arange (llama_eagle3.py:349-353, kimi_k25_eagle3.py:437-441)
            hot = model.get_hot_token_id()
            ok = hot is not None and torch.equal(hot.cpu(), ckpt[name] + torch.arange(ckpt[name].shape[0]))
            acct.landed.append((name, "hot_token_id (d2t + arange)"))
            if not ok:
                acct.differs.append("hot_token_id")
        elif "t2d" in name:    # skipped by its own code (llama_eagle3.py:355-356, kimi_k25_eagle3.py:442-443)
            acct.ignored.append(name)
        else:
            acct.dropped.append(name)
    loaded_params = {p for _, p, _ in calls}
    acct.never_loaded = sorted(set(params) - loaded_params)
    acct.nan = sorted(n for n, p in params.items() if not finite(p))


# The MLA draft's one fused parameter that SGLang fills from two checkpoint tensors in a single call, after
# concatenating them itself (kimi_k25_eagle3.py:467-492): [q_a_proj | kv_a_proj_with_mqa] by rows.
FUSED_A = "fused_qkv_a_proj_with_mqa"
A_PARTS = ("q_a_proj", "kv_a_proj_with_mqa")


def _pieces(model, ckpt_name: str, pname: str, shard) -> list[tuple[str, tuple[int, int] | None]]:
    """(checkpoint tensor, rows of the parameter it fills or None for all) of one observed weight_loader call."""
    if FUSED_A not in pname:
        return [(ckpt_name, _shard_rows(model, pname, shard))]
    attn = model.get_submodule(pname.rsplit(".", 2)[0])
    part = next(p for p in A_PARTS if p in ckpt_name)   # the call comes with the second of the pair
    q_rows = attn.q_lora_rank
    return [(ckpt_name.replace(part, "q_a_proj"), (0, q_rows)),
            (ckpt_name.replace(part, "kv_a_proj_with_mqa"),
             (q_rows, q_rows + attn.kv_lora_rank + attn.qk_rope_head_dim))]


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


# ---------------------------------------------------------------- the MLA draft (Eagle3DeepseekV2ForCausalLM)

def account_mla(ckpt_dir: Path, dtype: torch.dtype) -> tuple[Accounting, object | None]:
    """SGLang's MLA EAGLE-3 draft (models/kimi_k25_eagle3.py) built and loaded from `ckpt_dir` as SGLang resolves
    it, its load replayed and accounted for as the Llama draft's; (the account, the loaded model or None when
    SGLang refused it). Its knobs are what its built modules state (_mla_knobs); what only running a layer shows
    (the residual, the window) is not observed here: its MLA layer has no stage recorder."""
    from conformance.adapters.sglang.draft_model import NAME, load_model

    acct, ckpt, model = load_and_count(NAME, ckpt_dir, lambda: load_model(ckpt_dir, dtype))
    if model is None:
        return acct, None
    replay(acct, ckpt, Path(ckpt_dir), model)
    cfg = model.config
    acct.vocab_map = vocab_map(ckpt, cfg.vocab_size, cfg.draft_vocab_size)
    acct.uses = {
        "lm_head": ("embed_tokens (tied)" if model.lm_head is model.model.embed_tokens
                    else "the target's lm_head (no draft_vocab_size, kimi_k25_eagle3.py:355-358)"
                    if model.load_lm_head_from_target else "checkpoint lm_head"),
        "d2t": "hot_token_id = d2t + arange" if model.get_hot_token_id() is not None
               else "none: draft ids used as target ids",
    }
    acct.knobs = _mla_knobs(model)
    return acct, model


def _mla_knobs(model) -> dict:
    """The knobs Eagle3DeepseekV2ForCausalLM's built modules state (models/kimi_k25_eagle3.py:191-255): the aux
    width fc takes, the norms it builds, the MLA widths, the vocabularies; named as the reference's account names
    them (conformance/adapters/reference.py knobs), so a conversion's check compares them (user/servable.py)."""
    inner, cfg = model.model, model.config
    attn = inner.midlayer.self_attn
    return {
        "aux states x width": f"{inner.num_aux_hidden_states} x {inner.fc.input_size // inner.num_aux_hidden_states}",
        "norm_before_fc": getattr(inner, "input_norm", None) is not None,   # Eagle3MLAModel builds none
        "fc_norm": inner.fc_norm is not None,
        "norm_output": bool(inner.norm_output),
        "mla": mla_text(attn.q_lora_rank, attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim,
                        attn.v_head_dim),
        "vocab / draft vocab": f"{cfg.vocab_size}/{getattr(cfg, 'draft_vocab_size', None) or cfg.vocab_size}",
    }
