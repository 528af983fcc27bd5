"""Forward hooks on NeMo's `LlamaEagle3DraftModel` (observation only): its modules' inputs and outputs per TTT
step of `Eagle3TrainerModule.forward`, under the canonical stage names of conformance/core/stages.py.

NeMo's packed training runs one row [1, T] (the batch's sequences back to back), so every tensor is the
packed batch's rows in order. The embedding runs once per TTT step (draft_llama.py:996 embed_input_ids)
and its pre-hook opens each step; fc and fc_norm run once before the loop (core.py project_hidden_states)
and land in step 0.
"""
from __future__ import annotations

import torch


class Recorder:
    """Per-TTT-step stage dicts, every tensor [T, ...] in the packed batch's row order."""

    def __init__(self, draft):
        self.draft = draft
        self.steps: list[dict[str, torch.Tensor]] = []
        self.handles: list = []

    def put(self, stage: str, t: torch.Tensor, *shape: int) -> None:
        """`t` is [1, T, ...] (viewed as `shape` per row)."""
        self.steps[-1][stage] = t.detach().reshape(t.shape[1], *shape).clone()

    def out(self, stage: str, *shape: int):
        return lambda _m, _args, output: self.put(stage, output, *shape)

    def inp(self, stage: str, *shape: int):
        return lambda _m, args: self.put(stage, args[0], *shape)

    def __enter__(self):
        d, m = self.draft, self.draft.model
        layer = m.layers[0]
        attn = layer.self_attn
        pending: dict[str, torch.Tensor] = {}   # fc and fc_norm run before step 0 is opened

        def open_step(_m, args):
            self.steps.append(dict(pending) if not self.steps else {})
            self.put("input_ids", args[0])

        def before_steps(stage: str, output: torch.Tensor) -> None:
            pending[stage] = output.detach().reshape(output.shape[1], -1).clone()

        hooks = [(m.embed_tokens, "pre", open_step), (m.embed_tokens, "post", self.out("embeds", -1))]
        if getattr(m, "fc_norm", None) is not None:
            chunks: list[torch.Tensor] = []

            def fc_norm_chunk(_m, _args, output):
                chunks.append(output)
                if len(chunks) == len(m.fc_norm):   # the concatenation fc reads (draft_llama.py:914-921)
                    before_steps("fc_in_norm", torch.cat(chunks, dim=-1))
                    chunks.clear()

            hooks += [(norm, "post", fc_norm_chunk) for norm in m.fc_norm]
        hooks.append((m.fc, "post", lambda _m, _a, output: before_steps("fc_out", output)))

        def hidden_norm_input(_m, args):
            # The raw hidden is also the residual (draft_llama.py:671); at steps >= 1 it is the previous
            # step's output, fed back (core.py cur_hidden_states).
            self.put("layers.0.residual", args[0], -1)
            if len(self.steps) > 1:
                self.put("hidden_in", args[0], -1)

        p = "layers.0."
        mla = hasattr(attn, "kv_lora_rank")   # DeepseekV3Eagle3DraftModel's Eagle3DeepseekMLAAttention
        hooks += [
            (layer.input_layernorm, "post", self.out(p + "embeds_norm", -1)),
            (layer.hidden_norm, "pre", hidden_norm_input),
            (layer.hidden_norm, "post", self.out(p + "hidden_norm", -1)),
            *(self.mla_attention_hooks(p, attn) if mla else self.llama_attention_hooks(p, attn)),
            (attn.o_proj, "pre", self.inp(p + "attn_core", -1)),
            (attn.o_proj, "post", self.out(p + "attn_out", -1)),
            (layer.post_attention_layernorm, "pre", self.inp(p + "post_attn", -1)),
            (layer.post_attention_layernorm, "post", self.out(p + "post_attn_norm", -1)),
            (layer.mlp, "post", self.out(p + "mlp_out", -1)),
            (layer, "post", self.out(p + "layer_out", -1)),
            # What the trainer feeds back: the draft's forward output (post-norm with norm_output,
            # draft_llama.py:1011-1012).
            (d, "post", self.out("recurrent_hidden", -1)),
            (m.norm, "post", self.out("final_norm", -1)),
            (d.lm_head, "post", self.out("logits", -1)),
        ]
        for module, kind, fn in hooks:
            register = module.register_forward_pre_hook if kind == "pre" else module.register_forward_hook
            self.handles.append(register(fn))
        keys = self.mla_cached_keys(p, attn.qk_nope_head_dim) if mla else self.cached_keys(p, attn.num_key_value_heads)
        self.handles.append(attn.register_forward_hook(keys, with_kwargs=True))
        return self

    def llama_attention_hooks(self, p: str, attn) -> list:
        nh, nkv, hd = attn.num_heads, attn.num_key_value_heads, attn.head_dim
        return [(attn.q_proj, "pre", self.inp(p + "attn_in", -1)),
                (attn.q_proj, "post", self.out(p + "q", nh, hd)),
                (attn.k_proj, "post", self.out(p + "k", nkv, hd)),
                (attn.v_proj, "post", self.out(p + "v", nkv, hd))]

    def mla_attention_hooks(self, p: str, attn) -> list:
        """Eagle3DeepseekMLAAttention._project_qkv / _assemble_qkv (draft_deepseek.py:175-206): its projections'
        inputs and outputs. q_rot is a local of forward (:221, q_pe rotated and concatenated in _assemble_qkv)."""
        nh, nope = attn.num_heads, attn.qk_nope_head_dim

        def values(_m, _args, output):   # kv_b_proj's output per head is [k_nope | v] (:198-201)
            self.put(p + "v", output.view(*output.shape[:2], nh, -1)[..., nope:], nh, attn.v_head_dim)

        q_proj = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
        hooks = [(attn.kv_a_proj_with_mqa, "pre", self.inp(p + "attn_in", -1)),
                 (q_proj, "post", self.out(p + "q", nh, attn.qk_head_dim)),
                 (attn.kv_a_layernorm, "post", self.out(p + "kv_latent", -1)),
                 (attn.kv_b_proj, "post", values)]
        if attn.q_lora_rank is not None:
            hooks.append((attn.q_a_layernorm, "post", self.out(p + "q_latent", -1)))
        return hooks

    def mla_cached_keys(self, prefix: str, nope: int):
        """k_rot: the keys this step appended to cache_hidden, [1, nh, T, nope + rope] (draft_deepseek.py:224-225),
        each head [k_nope | the shared rope key after RoPE]; k_rope is that shared slice (head 0's)."""
        def hook(_attn, args, _kwargs, _output):
            cache = args[3]   # the layer passes it positionally (draft_deepseek.py:304)
            if cache:
                keys = cache[0][-1].transpose(1, 2)                           # [1, T, nh, nope + rope]
                self.put(prefix + "k_rot", keys, *keys.shape[2:])
                self.put(prefix + "k_rope", keys[:, :, 0, nope:], -1)
        return hook

    def cached_keys(self, prefix: str, nkv: int):
        """k_rot: the post-RoPE keys this step appended to NeMo's cache_hidden (draft_llama.py:319-333),
        [1, nh, T, hd] after _repeat_kv, which repeats each key head n_rep times in a row (repeat_interleave)."""
        def hook(_attn, _args, kwargs, _output):
            cache = kwargs.get("cache_hidden")
            if cache:
                keys = cache[0][-1]
                keys = keys[:, ::keys.shape[1] // nkv]                       # [1, nkv, T, hd]
                self.put(prefix + "k_rot", keys.transpose(1, 2), nkv, keys.shape[-1])
        return hook

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
