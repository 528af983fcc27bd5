"""A draft pass observed and named (part of worker.py, in vLLM's environment): forward hooks on vLLM's modules
(Recorder: observation only) and the canonical stages read off them, vLLM's fused layouts split back. The names
are conformance/core/stages.py's, written out: the project's modules do not load in vLLM's environment."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker_load import Loaded


class Recorder:
    """Forward hooks on vLLM's modules (observation only; every hook returns None), per decoder layer."""

    def __init__(self, model):
        self.seen: dict = {}
        self.layer = None
        self.on = True
        inner = model.model

        def enter(i):
            def pre(module, args, kwargs):
                self.layer = i
            return pre

        def keep(name, pick):
            def hook(module, args, output):
                if self.on:
                    key = name if self.layer is None else f"{self.layer}.{name}"
                    self.seen.setdefault(key, clone(pick(args, output)))
            return hook

        def keep_in(name, pick):
            def pre(module, args, kwargs):   # before the call: a fused add-norm may update its inputs in place
                if self.on:
                    key = name if self.layer is None else f"{self.layer}.{name}"
                    self.seen.setdefault(key, clone(pick(args, kwargs)))
            return pre

        def out(a, o):
            return o

        def residual_arg(args, kwargs):
            return args[1] if len(args) > 1 else kwargs["residual"]

        hooks = [(inner.embed_tokens, "embed_tokens"), (inner.norm, "norm"), (inner.fc, "fc"),
                 (model.logits_processor, "logits")]
        if getattr(inner, "input_norm", None) is not None:
            hooks.append((inner.input_norm, "input_norm"))
        for j, norm in enumerate(getattr(inner, "fc_norm", None) or []):
            hooks.append((norm, f"fc_norm.{j}"))
        self.handles = []
        for i, layer in enumerate(inner.layers):
            self.handles.append(layer.register_forward_pre_hook(enter(i), with_kwargs=True))
            self.handles.append(layer.register_forward_hook(lambda m, a, o: setattr(self, "layer", None)))
            attn = layer.self_attn
            hooks += [(layer.hidden_norm, "hidden_norm"), (layer.input_layernorm, "input_layernorm"),
                      (attn.qkv_proj, "qkv"), (attn.rotary_emb, "rotary"), (attn.attn, "attn"),
                      (attn.o_proj, "o_proj"), (layer.post_attention_layernorm, "post_attention_layernorm"),
                      (layer.mlp, "mlp")]
            # Qwen3 draft layers: per-head RMSNorm of q and k before RoPE (model_executor/models/qwen3.py:163-169)
            hooks += [(getattr(attn, n), n) for n in ("q_norm", "k_norm") if getattr(attn, n, None) is not None]
            self.handles.append(attn.qkv_proj.register_forward_pre_hook(keep_in("qkv_in", lambda a, k: a[0]),
                                                                        with_kwargs=True))
            # The residual the attention output is added to: what the fused add-norm receives.
            self.handles.append(layer.post_attention_layernorm.register_forward_pre_hook(
                keep_in("residual", residual_arg), with_kwargs=True))
        done = set()
        for module, name in hooks:
            if (id(module), name) not in done:   # a shared module (get_rope's cache) is hooked once per name
                done.add((id(module), name))
                self.handles.append(module.register_forward_hook(keep(name, out)))

    def take(self) -> dict:
        seen, self.seen, self.layer = self.seen, {}, None
        return seen


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(clone(v) for v in x)
    return x


def first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def canonical(loaded: Loaded, seen: dict, ids, hidden_fed, aux_out) -> dict:
    """One pass's hooks as canonical stages (conformance/core/stages.py), fused layouts split back."""
    model = loaded.model
    hf = model.config
    nh, nkv = hf.num_attention_heads, hf.num_key_value_heads
    hd = getattr(hf, "head_dim", None) or hf.hidden_size // nh
    T = ids.shape[0]
    layers = len(model.model.layers)
    s: dict = {}
    if hidden_fed is not None:   # a draft step >= 1 is fed the previous step's second output
        s["hidden_in"] = hidden_fed
    s["input_ids"] = ids.clone().long()
    s["embeds"] = seen["embed_tokens"]
    for i in range(layers):
        p = f"layers.{i}."
        if i == 0:
            s[p + "embeds_norm"] = first(seen["0.input_layernorm"])
            s[p + "hidden_norm"] = first(seen["0.hidden_norm"])
        else:   # later layers: the fused input_layernorm(h, residual) -> (normed, sum) (llama_eagle3.py:138)
            s[p + "hidden_norm"] = seen[f"{i}.input_layernorm"][0]
            s[f"layers.{i - 1}.layer_out"] = seen[f"{i}.input_layernorm"][1]
        s[p + "residual"] = seen[f"{i}.residual"]
        s[p + "attn_in"] = seen[f"{i}.qkv_in"]
        q, k, v = first(seen[f"{i}.qkv"]).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        s[p + "q"], s[p + "k"], s[p + "v"] = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        for name, heads in (("q_norm", nh), ("k_norm", nkv)):
            if f"{i}.{name}" in seen:
                s[p + name] = seen[f"{i}.{name}"].reshape(T, heads, hd)
        q_rot, k_rot = seen[f"{i}.rotary"]
        s[p + "q_rot"], s[p + "k_rot"] = q_rot.reshape(T, nh, hd), k_rot.reshape(T, nkv, hd)
        s[p + "attn_core"] = seen[f"{i}.attn"].reshape(T, nh * hd)
        s[p + "attn_out"] = first(seen[f"{i}.o_proj"])
        s[p + "post_attn_norm"], s[p + "post_attn"] = seen[f"{i}.post_attention_layernorm"]
        s[p + "mlp_out"] = seen[f"{i}.mlp"]
    s["final_norm"], s[f"layers.{layers - 1}.layer_out"] = seen["norm"]   # the fused (normed, sum) of the last layer
    s["recurrent_hidden"] = aux_out
    return s
