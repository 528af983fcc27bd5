"""Forward hooks on SpecForge's `LlamaForCausalLMEagle3` (observation only): its modules' inputs and
outputs per TTT step of `OnlineEagle3Model.forward`, under the canonical stage names of
conformance/core/stages.py, gathered from SpecForge's padded [B, S] rows back into packed order."""
from __future__ import annotations

import torch


class Recorder:
    """Per-TTT-step stage dicts, every tensor [T, ...] in the packed batch's row order.

    embed_tokens runs once per TTT step (model.py:382 embed_input_ids), so its pre-hook opens each
    step; fc and fc_norm run once before the loop (model.py:315 project_hidden_states) and land in step 0.
    `packed`: for each packed row, its index in the flattened [B * S] rows SpecForge computes.
    """

    def __init__(self, model, B: int, S: int, packed: torch.Tensor):
        self.model, self.B, self.S, self.packed = model, B, S, packed
        self.steps: list[dict[str, torch.Tensor]] = []
        self.handles: list = []

    def put(self, stage: str, t: torch.Tensor, *shape: int) -> None:
        """`t` is [B, S, ...] (viewed as `shape` per row)."""
        self.steps[-1][stage] = t.detach().reshape(self.B * self.S, *shape)[self.packed].clone()

    def out(self, stage: str, *shape: int):
        return lambda _m, _args, output: self.put(stage, output, *shape)

    def inp(self, stage: str, *shape: int):
        return lambda _m, args: self.put(stage, args[0], *shape)

    def __enter__(self):
        m = self.model
        layer, attn = m.midlayer, m.midlayer.self_attn
        nh, nkv, hd = attn.num_heads, attn.num_key_value_heads, attn.head_dim
        pending: dict[str, torch.Tensor] = {}   # fc and fc_norm run before step 0 is opened

        def open_step(_m, args):
            self.steps.append(dict(pending) if not self.steps else {})
            self.put("input_ids", args[0])

        def before_steps(stage: str):
            def hook(_m, _args, output):
                pending[stage] = output.detach().reshape(self.B * self.S, -1)[self.packed].clone()
            return hook

        hooks = [(m.embed_tokens, "pre", open_step), (m.embed_tokens, "post", self.out("embeds", -1))]
        if m.fc_norm is not None:
            chunks: list[torch.Tensor] = []

            def fc_norm_chunk(_m, _args, output):
                chunks.append(output)
                if len(chunks) == len(m.fc_norm):   # the concatenation fc reads (llama3_eagle.py:1764-1768)
                    before_steps("fc_in_norm")(None, None, torch.cat(chunks, dim=-1))
                    chunks.clear()

            hooks += [(norm, "post", fc_norm_chunk) for norm in m.fc_norm]
        hooks.append((m.fc, "post", before_steps("fc_out")))

        def hidden_norm_input(_m, args):
            # The raw hidden is also the residual (llama3_eagle.py:1625); at steps >= 1 it is the
            # previous step's output, fed back (model.py:397).
            self.put("layers.0.residual", args[0], -1)
            if len(self.steps) > 1:
                self.put("hidden_in", args[0], -1)

        p = "layers.0."
        hooks += [
            (layer.input_layernorm, "post", self.out(p + "embeds_norm", -1)),
            (layer.hidden_norm, "pre", hidden_norm_input),
            (layer.hidden_norm, "post", self.out(p + "hidden_norm", -1)),
            (attn.q_proj, "pre", self.inp(p + "attn_in", -1)),
            (attn.q_proj, "post", self.out(p + "q", nh, hd)),
            (attn.k_proj, "post", self.out(p + "k", nkv, hd)),
            (attn.v_proj, "post", self.out(p + "v", nkv, hd)),
            (attn.o_proj, "pre", self.inp(p + "attn_core", -1)),
            (attn.o_proj, "post", self.out(p + "attn_out", -1)),
            (layer.post_attention_layernorm, "pre", self.inp(p + "post_attn", -1)),
            (layer.post_attention_layernorm, "post", self.out(p + "post_attn_norm", -1)),
            (layer.mlp, "post", self.out(p + "mlp_out", -1)),
            (layer, "post", self.out(p + "layer_out", -1)),
            # SpecForge feeds the pre-norm layer output back (model.py:397).
            (layer, "post", self.out("recurrent_hidden", -1)),
            (m.norm, "post", self.out("final_norm", -1)),
            (m.lm_head, "post", self.out("logits", -1)),
        ]
        for module, kind, fn in hooks:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            self.handles.append(register(fn))
        self.handles.append(attn.register_forward_hook(self.cached_keys(p, nkv), with_kwargs=True))
        return self

    def cached_keys(self, prefix: str, nkv: int):
        """k_rot: the post-RoPE keys this step appended to SpecForge's cache_hidden (llama3_eagle.py:739),
        [B, nh, S, hd] after repeat_kv, which repeats each key head n_rep times in a row."""
        def hook(attn, _args, kwargs, _output):
            cache = kwargs.get("cache_hidden")
            if cache:
                keys = cache[0][-1]
                keys = keys[:, ::keys.shape[1] // nkv]                       # [B, nkv, S, hd]
                self.put(prefix + "k_rot", keys.transpose(1, 2), nkv, keys.shape[-1])
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
