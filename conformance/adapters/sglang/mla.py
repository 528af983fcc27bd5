"""SGLang's MLA EAGLE-3 draft (models/kimi_k25_eagle3.py, `Eagle3DeepseekV2ForCausalLM`) at step 0, in-process on
CPU over its own MLA KV pool (`MLATokenToKVPool`) and attention backend, with the attention's stages recorded.

Each request's first token is a DECODE pass and the rest an EXTEND over that cached token: on torch_native an
MLA EXTEND with no cached prefix takes the MHA path, which re-reads the latent cache and fails (the same split
as SGLang's DeepSeek target here, target.py; running-real-implementations.md). Both passes take SGLang's absorbed
MLA path, which a server takes for every draft pass but a no-prefix prefill. Stages come from forward hooks on
SGLang's own modules (the attention's input and output, q_a_layernorm) and from what its KV pool holds after the
passes (kv_latent and k_rope: the two pieces an MLA pool caches per token).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from conformance.adapters.sglang.runtime import ATTENTION_BACKEND, ensure_runtime, forward_pass


def mla_step0(model, aux: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
              lengths: list[int]) -> dict[str, torch.Tensor]:
    """`model`: a loaded Eagle3DeepseekV2ForCausalLM; the packed requests of `lengths` tokens each (>= 2).
    Returns its layer-0 attention stages on packed rows ({"layers.0.attn_in", "layers.0.q_latent",
    "layers.0.kv_latent", "layers.0.k_rope", "layers.0.attn_out"}) and each request's last-token "logits"."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput

    device = ensure_runtime()["device"]
    if min(lengths) < 2:
        raise ValueError(f"every request needs 2 tokens or more (a DECODE of the first, an EXTEND of the rest): "
                         f"{lengths}")
    attn = model.model.midlayer.self_attn
    dtype = attn.kv_b_proj.weight.dtype
    B, T = len(lengths), sum(lengths)
    pool = ReqToTokenPool(size=B, max_context_len=max(lengths), device=device, enable_memory_saver=False)
    kv = MLATokenToKVPool(size=T + 1, page_size=1, dtype=dtype, kv_lora_rank=attn.kv_lora_rank,
                          qk_rope_head_dim=attn.qk_rope_head_dim, layer_num=1, device=device,
                          enable_memory_saver=False)
    starts = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    slots = [torch.arange(1 + s, 1 + s + n) for s, n in zip(starts.tolist(), lengths)]   # slot 0: padding
    for r, s in enumerate(slots):
        pool.req_to_token[r + 1, :lengths[r]] = s.to(torch.int32)
    # The torch_native backend reads only these three fields of a ModelRunner.
    backend = ATTENTION_BACKENDS[ATTENTION_BACKEND](
        SimpleNamespace(device=device, req_to_token_pool=pool, token_to_kv_pool=kv))

    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name):
        return lambda _m, _i, out: seen.setdefault(name, []).append(out.detach().clone())
    hooks = [attn.register_forward_pre_hook(
                 lambda _m, _a, kw: seen.setdefault("attn_in", []).append(kw["hidden_states"].detach().clone()),
                 with_kwargs=True),
             attn.register_forward_hook(keep("attn_out")), attn.q_a_layernorm.register_forward_hook(keep("q_latent"))]
    aux, input_ids, positions = aux.to(dtype, copy=True), input_ids.long().clone(), positions.long().clone()
    req = torch.arange(1, B + 1)
    first, rest = starts, torch.cat([torch.arange(s + 1, s + n) for s, n in zip(starts.tolist(), lengths)])
    try:
        one = torch.ones(B, dtype=torch.int64)
        decode = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=input_ids[first], req_pool_indices=req,
            seq_lens=one, seq_lens_cpu=one.clone(), out_cache_loc=torch.stack([s[0] for s in slots]), seq_lens_sum=B,
            positions=positions[first], capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=EagleDraftInput(hidden_states=aux[first], num_tokens_per_req=1,
                                      num_tokens_for_logprob_per_req=1))
        forward_pass(model, backend, decode)
        n = [x - 1 for x in lengths]
        seq_lens = torch.tensor(lengths)
        extend = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=B, input_ids=input_ids[rest], req_pool_indices=req,
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), out_cache_loc=torch.cat([s[1:] for s in slots]),
            seq_lens_sum=T, positions=positions[rest], extend_num_tokens=T - B,
            extend_seq_lens=torch.tensor(n, dtype=torch.int32), extend_prefix_lens=one.int(),
            extend_start_loc=(torch.tensor(n).cumsum(0) - torch.tensor(n)).int(), extend_seq_lens_cpu=n,
            extend_prefix_lens_cpu=[1] * B, capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=EagleDraftExtendInput(hidden_states=aux[rest], num_tokens_per_req=1,
                                            num_tokens_for_logprob_per_req=1))
        out = forward_pass(model, backend, extend)
    finally:
        for h in hooks:
            h.remove()
    stages = {}
    for name, (at_first, at_rest) in seen.items():   # back to packed rows
        packed = at_first.new_empty((T, *at_first.shape[1:]))
        packed[first], packed[rest] = at_first, at_rest
        stages[f"layers.0.{name}"] = packed
    cached = kv.get_key_buffer(0)[1:T + 1, 0]   # slot 1 + i holds packed row i: [kv_latent | k_rope]
    stages["layers.0.kv_latent"], stages["layers.0.k_rope"] = cached.split(
        [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    stages["logits"] = out.next_token_logits
    return {k: v.cpu() for k, v in stages.items()}
