"""SGLang's MLA EAGLE-3 draft (models/kimi_k25_eagle3.py, `Eagle3DeepseekV2ForCausalLM`) inside the engine's capture
(engine_shims.Capture): forward hooks on its modules (observation only) and what its MLA KV pool holds after a pass,
mapped to the stages SGLang's MLA column claims (mla.CLAIMED), so that the engine lane compares a served MLA round
stage by stage as it compares a Llama one.

The hooks are the column's (mla.mla_chain): the embedding, fc_norm's chunks and fc, the attention's input (a keyword
argument) and output, q_a_layernorm (q_latent), the MLP; kv_latent and k_rope are read from the pool's slots the pass
wrote (`out_cache_loc`), the two pieces an MLA pool caches per token.
"""
from __future__ import annotations

import torch

from conformance.adapters.sglang.mla import CLAIMED

# The engine's capture of an MLA pass: the column's stages, the hand-off the worker feeds (aux states at an extend,
# the previous step's hidden at a decode) and the ids, but not draft_ids (the worker maps them to target ids at once;
# the drafted target ids are read from what draft() hands to verification).
ENGINE_CLAIMED = (CLAIMED | {"aux_in", "input_ids"}) - {"draft_ids"}


class ServedMLADraft:
    """The served MLA draft with its hooks; `stages` maps one pass onto the claimed stages."""

    def __init__(self, model):
        self.model = model
        inner = model.model
        self.attn = inner.midlayer.self_attn
        self.seen: dict[str, torch.Tensor] = {}

        # A forward hook's return value replaces the module's output: these return None.
        def keep(name, pick=lambda out: out):
            def hook(_module, _args, out):
                self.seen.setdefault(name, pick(out).detach().clone())
            return hook

        def keep_input(name):
            def pre_hook(_module, _args, kwargs):
                self.seen.setdefault(name, kwargs["hidden_states"].detach().clone())
            return pre_hook

        self.handles = [self.attn.register_forward_pre_hook(keep_input("layers.0.attn_in"), with_kwargs=True),
                        self.attn.register_forward_hook(keep("layers.0.attn_out")),
                        inner.embed_tokens.register_forward_hook(keep("embeds")),
                        inner.fc.register_forward_hook(keep("fc_out", lambda out: out[0])),   # (output, bias)
                        inner.midlayer.mlp.register_forward_hook(keep("layers.0.mlp_out"))]
        if self.attn.q_lora_rank is not None:
            self.handles.append(self.attn.q_a_layernorm.register_forward_hook(keep("layers.0.q_latent")))
        # fc_norm: one RMSNorm per aux chunk, their outputs concatenated before fc (kimi_k25_eagle3.py:286-292)
        for i, norm in enumerate(inner.fc_norm or ()):
            self.handles.append(norm.register_forward_hook(keep(f"fc_in_norm.{i}")))

    def begin(self) -> None:
        self.seen = {}

    def stages(self, spec_hidden: torch.Tensor, input_ids: torch.Tensor, out, aux_in: bool,
               forward_batch) -> dict[str, torch.Tensor]:
        seen, self.seen = self.seen, {}
        missing = [k for k in ("embeds", "layers.0.attn_in", "layers.0.attn_out", "layers.0.mlp_out") if k not in seen]
        if missing:
            raise RuntimeError(f"forward hooks did not fire for {missing}")
        s = {("aux_in" if aux_in else "hidden_in"): spec_hidden.clone(), "input_ids": input_ids.clone()}
        chunks = sorted((k for k in seen if k.startswith("fc_in_norm.")), key=lambda k: int(k.rsplit(".", 1)[1]))
        if chunks:
            s["fc_in_norm"] = torch.cat([seen.pop(k) for k in chunks], dim=-1)
        s.update(seen)
        # The pool of the pass's attention backend (the forward context the model runner set for this pass).
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        pool = get_token_to_kv_pool()
        cached = pool.get_key_buffer(self.attn.attn_mqa.layer_id)[forward_batch.out_cache_loc.long(), 0]
        s["layers.0.kv_latent"], s["layers.0.k_rope"] = (
            t.clone() for t in cached.split([self.attn.kv_lora_rank, self.attn.qk_rope_head_dim], dim=-1))
        s["recurrent_hidden"] = out.hidden_states.clone()
        s["logits"] = out.next_token_logits.clone()
        return s
