"""Forward hooks on SGLang's draft modules (observation only), and one pass's hooks mapped to the
canonical stages of conformance/core/stages.py: fused layouts split back, fused residual pairs summed.
"""
from __future__ import annotations

from functools import partial

import torch


class Recorder:
    """Forward hooks on SGLang's modules (observation only); every tensor cloned at call time.

    Some modules are shared between layers (get_rope caches one RotaryEmbedding per shape), so a
    pre-hook on each decoder layer says which layer is running and calls are keyed by it.
    """

    def __init__(self, model):
        self.seen: dict[str, object] = {}
        self.layer: int | None = None
        inner = model.model
        self._hooks: list = []   # (register method, hook): attach() registers them, detach() removes them

        def enter(i):
            def pre_hook(module, args):
                self.layer = i
            return pre_hook

        def leave(module, args, output):
            self.layer = None

        def keep(name, pick):
            def hook(module, args, output):
                key = name if self.layer is None else f"{self.layer}.{name}"
                self.seen.setdefault(key, _clone(pick(args, output)))
            return hook

        def keep_input(name, pick):
            def pre_hook(module, args, kwargs):   # before the call: a fused add-norm updates its inputs in place
                key = name if self.layer is None else f"{self.layer}.{name}"
                self.seen.setdefault(key, _clone(pick(args, kwargs)))
            return pre_hook

        def out(a, o):
            return o

        def arg0(a, o):
            return a[0]

        def residual_arg(args, kwargs):
            return args[1] if len(args) > 1 else kwargs["residual"]

        targets = [(inner.embed_tokens, "embed_tokens", out), (inner.fc, "fc", out), (inner.norm, "norm", out)]
        if inner.input_norm is not None:
            targets.append((inner.input_norm, "input_norm", out))
        for j, norm in enumerate(inner.fc_norm or []):
            targets.append((norm, f"fc_norm.{j}", out))
        for i, layer in enumerate(inner.layers):
            self._hooks += [(layer.register_forward_pre_hook, enter(i)), (layer.register_forward_hook, leave)]
            attn = layer.self_attn
            targets += [
                (layer.hidden_norm, "hidden_norm", out),
                (layer.input_layernorm, "input_layernorm", out),
                (attn.qkv_proj, "qkv_in", arg0),
                (attn.qkv_proj, "qkv", out),
                (attn.rotary_emb, "rotary", out),
                (attn.attn, "attn", out),
                (attn.o_proj, "o_proj", out),
                (layer.post_attention_layernorm, "post_attention_layernorm", out),
                (layer.mlp, "mlp", out),
            ]
            # The residual attention is added to: the residual SGLang's own fused add-norm receives
            # (post_attention_layernorm(attn_out, residual), llama_eagle3.py:114), read at the call.
            self._hooks.append((partial(layer.post_attention_layernorm.register_forward_pre_hook, with_kwargs=True),
                                keep_input("residual", residual_arg)))
        hooked: set[tuple[int, str]] = set()
        for module, name, pick in targets:
            if (id(module), name) not in hooked:   # a shared module is hooked once per name
                hooked.add((id(module), name))
                self._hooks.append((module.register_forward_hook, keep(name, pick)))
        self.attach()

    def attach(self) -> None:
        self.handles = [register(hook) for register, hook in self._hooks]

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def take(self) -> dict[str, object]:
        seen, self.seen, self.layer = self.seen, {}, None
        return seen


def canonical_stages(loaded, seen: dict, spec_hidden: torch.Tensor, input_ids: torch.Tensor, out,
                     aux_in: bool) -> dict:
    """One pass of `loaded` (a LoadedSGLang): what its hooks saw, as canonical stages. `spec_hidden` is
    what the pass was fed (aux states at EXTEND, the previous step's hidden at DECODE)."""
    if not loaded.recorder.handles:   # run(record=False): only what the pass returns
        return {"recurrent_hidden": out.hidden_states, "logits": out.next_token_logits}
    layers = len(loaded.model.model.layers)
    T, nh, nkv, hd = input_ids.shape[0], loaded.num_heads, loaded.num_kv_heads, loaded.head_dim
    # Every hooked module SGLang always calls must have been seen (hooks fire on __call__).
    required = ["embed_tokens", "norm"] + [
        f"{i}.{k}" for i in range(layers)
        for k in ("hidden_norm", "residual", "qkv", "rotary", "attn", "o_proj", "post_attention_layernorm", "mlp")]
    missing = [k for k in required if k not in seen]
    if missing:
        raise RuntimeError(f"forward hooks did not fire for {missing}")
    s: dict[str, torch.Tensor] = {}
    if aux_in:
        s["aux_in"] = spec_hidden.clone()
    else:   # a draft DECODE pass is fed the previous step's returned hidden (spec_info.hidden_states)
        s["hidden_in"] = spec_hidden.clone()
    if "fc" in seen:  # SGLang runs fc only when the spec hidden is not hidden_size wide
        chunks = [seen[k] for k in sorted(k for k in seen if k.startswith("fc_norm."))]
        if chunks:
            s["fc_in_norm"] = torch.cat(chunks, dim=-1)
        elif "input_norm" in seen:
            s["fc_in_norm"] = seen["input_norm"]
        s["fc_out"] = seen["fc"]
    s["input_ids"] = input_ids.clone()
    s["embeds"] = seen["embed_tokens"]
    for i in range(layers):
        p = f"layers.{i}."
        if i == 0:
            s[p + "embeds_norm"] = seen["0.input_layernorm"]
            s[p + "hidden_norm"] = seen["0.hidden_norm"]
        else:
            s[p + "hidden_norm"] = seen[f"{i}.hidden_norm"][0]   # fused (normed, sum)
        s[p + "residual"] = seen[f"{i}.residual"]
        s[p + "attn_in"] = seen[f"{i}.qkv_in"]
        q, k, v = seen[f"{i}.qkv"][0].split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        s[p + "q"], s[p + "k"], s[p + "v"] = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        q_rot, k_rot = seen[f"{i}.rotary"]
        s[p + "q_rot"], s[p + "k_rot"] = q_rot.reshape(T, nh, hd), k_rot.reshape(T, nkv, hd)
        s[p + "attn_core"] = seen[f"{i}.attn"].reshape(T, nh * hd)
        s[p + "attn_out"] = seen[f"{i}.o_proj"][0]
        s[p + "post_attn_norm"], s[p + "post_attn"] = seen[f"{i}.post_attention_layernorm"]
        s[p + "mlp_out"] = seen[f"{i}.mlp"]
        # SGLang carries (mlp_out, residual) unsummed into the next norm; their sum is the layer output.
        s[p + "layer_out"] = s[p + "mlp_out"] + s[p + "post_attn"]
    s["final_norm"] = seen["norm"][0]
    s["recurrent_hidden"] = out.hidden_states.clone()
    s["logits"] = out.next_token_logits.clone()
    return s


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x
