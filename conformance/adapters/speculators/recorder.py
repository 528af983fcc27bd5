"""Forward hooks on speculators' `Eagle3DraftModel` (observation only): its modules' inputs and
outputs per TTT step, under the canonical stage names of conformance/core/stages.py."""
from __future__ import annotations

import torch


class Recorder:
    """Forward hooks that copy module inputs/outputs into per-TTT-step stage dicts.

    embed_tokens runs exactly once per TTT step (core.py:271), so its pre-hook opens each step after
    the first; fc and its input norms run once, before it, and land in step 0. The forward runs on
    `rows` packed rows (padded as training pads); the first `T` are the batch's and are kept.
    """

    def __init__(self, model, rows: int, T: int):
        self.model, self.rows, self.T = model, rows, T
        self.steps: list[dict[str, torch.Tensor]] = [{}]
        self.embed_calls = 0
        self.handles: list = []

    def put(self, stage: str, t: torch.Tensor, *shape: int) -> None:
        self.steps[-1][stage] = t.detach().reshape(self.rows, *shape)[:self.T].clone()

    def out(self, stage: str, *shape: int):
        return lambda _m, _args, output: self.put(stage, output, *shape)

    def inp(self, stage: str, *shape: int):
        return lambda _m, args: self.put(stage, args[0], *shape)

    def __enter__(self):
        m, cfg = self.model, self.model.config.transformer_layer_config
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hooks = []   # (module, "pre" | "post", fn)

        def open_step(_m, args):
            if self.embed_calls:
                self.steps.append({})
            self.embed_calls += 1
            self.put("input_ids", args[0])

        hooks += [(m.embed_tokens, "pre", open_step), (m.embed_tokens, "post", self.out("embeds", -1))]
        if m.input_norm is not None:
            hooks.append((m.input_norm, "post", self.out("fc_in_norm", -1)))
        if m.fc_norm is not None:
            chunks: list[torch.Tensor] = []

            def fc_norm_chunk(_m, _args, output):
                chunks.append(output)
                if len(chunks) == len(m.fc_norm):   # the concatenation fc reads (core.py:239-243)
                    self.put("fc_in_norm", torch.cat(chunks, dim=-1), -1)

            hooks += [(norm, "post", fc_norm_chunk) for norm in m.fc_norm]
        hooks.append((m.fc, "post", self.out("fc_out", -1)))

        def hidden_fed_back(_m, args):
            if self.embed_calls > 1:   # steps >= 1: layer 0 reads cat([embeds, fed-back hidden]) (core.py:281)
                self.put("hidden_in", args[0].chunk(2, dim=-1)[1], -1)

        hooks.append((m.layers[0], "pre", hidden_fed_back))
        for i, layer in enumerate(m.layers):
            p, attn = f"layers.{i}.", layer.self_attn
            if i == 0:   # first layer: input_layernorm on the embeds, hidden_norm on the hidden
                hooks += [(layer.input_layernorm, "post", self.out(p + "embeds_norm", -1)),
                          (layer.hidden_norm, "post", self.out(p + "hidden_norm", -1))]
            else:
                hooks.append((layer.input_layernorm, "post", self.out(p + "hidden_norm", -1)))
            hooks += [
                (attn.q_proj, "pre", self.inp(p + "attn_in", -1)),
                (attn.q_proj, "post", self.out(p + "q", nh, hd)),
                (attn.k_proj, "post", self.out(p + "k", nkv, hd)),
                (attn.v_proj, "post", self.out(p + "v", nkv, hd)),
                *([(attn.q_norm, "post", self.out(p + "q_norm", nh, hd)),     # qwen3 layers: per-head norms
                   (attn.k_norm, "post", self.out(p + "k_norm", nkv, hd))] if hasattr(attn, "q_norm") else []),
                (attn.o_proj, "pre", self.inp(p + "attn_core", -1)),
                (attn.o_proj, "post", self.out(p + "attn_out", -1)),
                (layer.post_attention_layernorm, "pre", self.inp(p + "post_attn", -1)),
                (layer.post_attention_layernorm, "post", self.out(p + "post_attn_norm", -1)),
                (layer.mlp, "post", self.out(p + "mlp_out", -1)),
                (layer, "post", self.out(p + "layer_out", -1)),
            ]
            self.handles.append(attn.register_forward_hook(self.cached_keys(p), with_kwargs=True))

        hooks += [(m.norm, "post", self.out("final_norm", -1)), (m.lm_head, "post", self.out("logits", -1))]
        # What the next TTT step is fed: the norm output when norm_output, else the last layer's
        # output (core.py:302-306).
        last = m.norm if m.config.norm_output else m.layers[-1]
        hooks.append((last, "post", self.out("recurrent_hidden", -1)))

        for module, kind, fn in hooks:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            self.handles.append(register(fn))
        return self

    def cached_keys(self, prefix: str):
        """k_rot: the post-RoPE keys this step appended to speculators' DynamicCache (its last T rows)."""
        def hook(attn, _args, kwargs, _output):
            cache = kwargs.get("past_key_values")
            if cache is not None:
                keys = cache.layers[attn.layer_idx].keys          # [1, nkv, S, hd], S = (step + 1) * rows
                self.put(prefix + "k_rot", keys[0, :, -self.rows:].transpose(0, 1), keys.shape[1], keys.shape[-1])
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
