"""SGLang's MLA EAGLE-3 draft (models/kimi_k25_eagle3.py, `Eagle3DeepseekV2ForCausalLM`) drafting a chain, in-process
on CPU over its own MLA KV pool (`MLATokenToKVPool`) and attention backend, with the attention's stages recorded.

At step 0 each request's first token is a DECODE pass and the rest an EXTEND over that cached token: on torch_native an
MLA EXTEND with no cached prefix takes the MHA path, which re-reads the latent cache and fails (the same split
as SGLang's DeepSeek target here, target.py; running-real-implementations.md). Both passes take SGLang's absorbed
MLA path, which a server takes for every draft pass but a no-prefix prefill; steps >= 1 are DECODE passes on each
request's last token, as in serving (drafting.py's chain for the Llama draft). Stages come from forward hooks on
SGLang's own modules (the attention's input and output, q_a_layernorm) and from what its KV pool holds after the
passes (kv_latent and k_rope: the two pieces an MLA pool caches per token).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from conformance.adapters.sglang.runtime import ATTENTION_BACKEND, ensure_runtime, forward_pass
from conformance.core.registry import Known

# What SGLang's MLA draft does otherwise than training, observed through SGLang's own code (the matrix's MLA
# cases, conformance/draft/test_mla_sglang.py) and applied to a user's MLA draft (conformance/user/mla.py): the
# registry's entries with this prefix (conformance/core/registry.toml).
MLA_ENTRY_PREFIX = "sglang-mla-"


def entries() -> tuple[Known, ...]:
    """SGLang's MLA draft's entries in the registry (read at call time, so that a self-test can plant one). Its other
    SGLang entries describe the Llama draft (llama_eagle3.py, llama.py)."""
    from conformance.core import registry

    return tuple(e for e in registry.REGISTRY if e.impl == "sglang" and e.id.startswith(MLA_ENTRY_PREFIX))


# The attention stages the chain records, in the order the attention computes them.
ATTENTION_STAGES = ("layers.0.q_latent", "layers.0.kv_latent", "layers.0.k_rope", "layers.0.attn_out")


def mla_chain(model, aux: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int],
              next_ids=None, steps: int | None = None) -> list[dict[str, torch.Tensor]]:
    """`model`: a loaded Eagle3DeepseekV2ForCausalLM; the packed requests of `lengths` tokens each (>= 2).
    Step 0 is the draft's pass over every token (DECODE of each first token, EXTEND of the rest); step k >= 1 a
    DECODE pass on each request's last token, fed `next_ids[:, k - 1]` and the recurrent hidden SGLang returned
    for that request's previous row, at position last + k, as the serving chain does. Per step (step 0 on packed
    rows, later steps one row per request): "embeds", "fc_in_norm" (fc_norm's, when it has one) and "fc_out" (step 0),
    "hidden_in" (steps >= 1), the layer-0 attention stages ("layers.0.attn_in", "layers.0.q_latent",
    "layers.0.kv_latent", "layers.0.k_rope", "layers.0.attn_out"), "layers.0.mlp_out", "recurrent_hidden" (the hidden
    SGLang returns), and the last rows' "logits".
    Free running: `next_ids` a callable (step k, the logits of step k - 1) -> the ids step k is fed, over `steps`."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput, EagleDraftInput

    device = ensure_runtime()["device"]
    if min(lengths) < 2:
        raise ValueError(f"every request needs 2 tokens or more (a DECODE of the first, an EXTEND of the rest): "
                         f"{lengths}")
    if callable(next_ids):
        feed = next_ids
    else:
        steps = 1 + (0 if next_ids is None else next_ids.shape[1])

        def feed(k, _logits):
            return next_ids[:, k - 1]
    attn = model.model.midlayer.self_attn
    dtype = attn.kv_b_proj.weight.dtype
    B, T = len(lengths), sum(lengths)
    per_req = [n + steps - 1 for n in lengths]
    pool = ReqToTokenPool(size=B, max_context_len=max(per_req), device=device, enable_memory_saver=False)
    kv = MLATokenToKVPool(size=sum(per_req) + 1, page_size=1, dtype=dtype, kv_lora_rank=attn.kv_lora_rank,
                          qk_rope_head_dim=attn.qk_rope_head_dim, layer_num=1, device=device,
                          enable_memory_saver=False)
    bases = (torch.tensor(per_req).cumsum(0) - torch.tensor(per_req) + 1).tolist()   # slot 0: padding
    slots = [torch.arange(b, b + n) for b, n in zip(bases, per_req)]
    for r, s in enumerate(slots):
        pool.req_to_token[r + 1, :per_req[r]] = s.to(torch.int32)
    # The torch_native backend reads only these three fields of a ModelRunner.
    backend = ATTENTION_BACKENDS[ATTENTION_BACKEND](
        SimpleNamespace(device=device, req_to_token_pool=pool, token_to_kv_pool=kv))

    seen: dict[str, list[torch.Tensor]] = {}

    def keep(name, pick=lambda out: out):
        return lambda _m, _i, out: seen.setdefault(name, []).append(pick(out).detach().clone())
    inner = model.model
    def keep_input(name):
        return lambda _m, _a, kw: seen.setdefault(name, []).append(kw["hidden_states"].detach().clone())
    hooks = [attn.register_forward_pre_hook(keep_input("layers.0.attn_in"), with_kwargs=True),
             attn.register_forward_hook(keep("layers.0.attn_out")),
             attn.q_a_layernorm.register_forward_hook(keep("layers.0.q_latent")),
             inner.embed_tokens.register_forward_hook(keep("embeds")),
             inner.fc.register_forward_hook(keep("fc_out", lambda out: out[0])),   # (output, bias)
             inner.midlayer.mlp.register_forward_hook(keep("layers.0.mlp_out"))]
    # fc_norm: one RMSNorm per aux chunk, their outputs concatenated before fc (kimi_k25_eagle3.py:286-292)
    for i, norm in enumerate(inner.fc_norm or ()):
        hooks.append(norm.register_forward_hook(keep(f"fc_in_norm.{i}")))
    aux, input_ids, positions = aux.to(dtype, copy=True), input_ids.long().clone(), positions.long().clone()
    req, one = torch.arange(1, B + 1), torch.ones(B, dtype=torch.int64)
    starts = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    first, rest = starts, torch.cat([torch.arange(s + 1, s + n) for s, n in zip(starts.tolist(), lengths)])
    n_rest = [n - 1 for n in lengths]

    def decode(ids, hidden, pos, k):
        seq_lens = torch.tensor(lengths) + k if k else one
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=ids, req_pool_indices=req, seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(), out_cache_loc=torch.stack([s[n + k - 1] if k else s[0]
                                                                      for s, n in zip(slots, lengths)]),
            seq_lens_sum=int(seq_lens.sum()), positions=pos, capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=EagleDraftInput(hidden_states=hidden, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1))

    out_steps = []
    try:
        out = forward_pass(model, backend, decode(input_ids[first], aux[first], positions[first], 0))
        seen["recurrent_hidden"] = [out.hidden_states]
        seq_lens = torch.tensor(lengths)
        out = forward_pass(model, backend, ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=B, input_ids=input_ids[rest], req_pool_indices=req,
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), out_cache_loc=torch.cat([s[1:n]
                                                                                      for s, n in zip(slots, lengths)]),
            seq_lens_sum=T, positions=positions[rest], extend_num_tokens=T - B,
            extend_seq_lens=torch.tensor(n_rest, dtype=torch.int32), extend_prefix_lens=one.int(),
            extend_start_loc=(torch.tensor(n_rest).cumsum(0) - torch.tensor(n_rest)).int(),
            extend_seq_lens_cpu=n_rest, extend_prefix_lens_cpu=[1] * B, capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=EagleDraftExtendInput(hidden_states=aux[rest], num_tokens_per_req=1,
                                            num_tokens_for_logprob_per_req=1)))
        seen["recurrent_hidden"].append(out.hidden_states)
        stages = {}
        for name, (at_first, at_rest) in _chunks_joined(seen).items():   # back to packed rows
            packed = at_first.new_empty((T, *at_first.shape[1:]))
            packed[first], packed[rest] = at_first, at_rest
            stages[name] = packed
        stages.update(_cached(kv, attn, torch.cat([s[:n] for s, n in zip(slots, lengths)])))
        out_steps.append({**stages, "logits": out.next_token_logits})
        hidden = out.hidden_states[torch.tensor(n_rest).cumsum(0) - 1]   # each request's last row of the EXTEND
        last_pos = positions[starts + torch.tensor(lengths) - 1]
        for k in range(1, steps):
            seen.clear()
            out = forward_pass(model, backend, decode(feed(k, out.next_token_logits).long(), hidden,
                                                          last_pos + k, k))
            seen["recurrent_hidden"] = [out.hidden_states]
            stages = {"hidden_in": hidden, **{name: at[0] for name, at in _chunks_joined(seen).items()}}
            stages.update(_cached(kv, attn, torch.stack([s[n + k - 1] for s, n in zip(slots, lengths)])))
            out_steps.append({**stages, "logits": out.next_token_logits})
            hidden = out.hidden_states
    finally:
        for h in hooks:
            h.remove()
    return [{k: v.cpu() for k, v in st.items()} for st in out_steps]


def _chunks_joined(seen: dict[str, list]) -> dict[str, list]:
    """`seen` with the per-chunk fc_norm outputs (fc_in_norm.i, one list per chunk) joined into fc_in_norm, as the
    model concatenates them, pass by pass."""
    chunks = sorted((n for n in seen if n.startswith("fc_in_norm.")), key=lambda n: int(n.rsplit(".", 1)[1]))
    out = {n: v for n, v in seen.items() if n not in chunks}
    if chunks:
        out["fc_in_norm"] = [torch.cat(parts, dim=-1) for parts in zip(*(seen[n] for n in chunks))]
    return out


def _cached(kv, attn, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """What SGLang's MLA pool holds in `slots`: [kv_latent | k_rope] per token."""
    kv_latent, k_rope = kv.get_key_buffer(0)[slots, 0].split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    return {"layers.0.kv_latent": kv_latent, "layers.0.k_rope": k_rope}


def against_reference(model, weights: dict[str, torch.Tensor], mla, aux: torch.Tensor, input_ids: torch.Tensor,
                      positions: torch.Tensor, lengths: list[int], next_ids: torch.Tensor | None = None,
                      against: torch.dtype | None = None) -> tuple[list, list[torch.Tensor]]:
    """SGLang's chain (`mla_chain`) and, per step, each attention stage compared with the reference's
    `mla_attention` (`mla`: its MLAConfig; `weights`: the checkpoint's, canonical names) fed SGLang's own attention
    input, in the dtype the suite holds the model's dtype against (`against`, default tolerances.AGAINST: fp32 itself,
    bf16 the fp64 reference; a large user draft's plan gives fp32, conformance/user/plan.py). At step k >= 1 SGLang
    runs each request's last row only; the reference runs every row (its other rows' inputs zero: a row's step-k key
    is visible to that row alone) and its last rows are compared. Returns the StageResults, step by step in
    ATTENTION_STAGES order, and SGLang's logits per step (each request's last row)."""
    from conformance.core.compare import compare_tensors
    from conformance.core.tolerances import AGAINST
    from reference import eagle3 as ref
    from reference.rope import rope_cos_sin

    dtype = model.model.midlayer.self_attn.kv_b_proj.weight.dtype
    seen = mla_chain(model, aux, input_ids, positions, lengths, next_ids)
    T = sum(lengths)
    index = torch.cat([torch.arange(n) for n in lengths])
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    last = torch.tensor(lengths).cumsum(0) - 1
    against = against or AGAINST[dtype]
    # The reference in `against` and, when that is another dtype, in SGLang's own: the error model's rho (how far
    # rounding to `dtype` alone moves each stage), as compare_traces gives it the reference in the dtype.
    # Only the attention's tensors, widened: a whole draft in fp32 beside SGLang's would be 4x its bf16 weights (the
    # published Kimi-K2.5 MLA draft's embedding and head alone are 9.4 GB in fp32).
    attention = {k: v for k, v in weights.items() if k.startswith("layers.0.self_attn.")}
    refs = {d: ({k: v.to(d) for k, v in attention.items()}, ([], [])) for d in dict.fromkeys((against, dtype))}
    results = []
    for k, at in enumerate(seen):
        expected = {}
        for d, (w, cache) in refs.items():
            x = at["layers.0.attn_in"].to(d)
            if k:
                x = torch.zeros(T, x.shape[1], dtype=d).index_copy(0, last, x)
            cos, sin = rope_cos_sin(mla, positions + k, d)
            expected[d] = ref.mla_attention(x, w, "layers.0", mla, cos, sin, cache,
                                            ref.visibility(seq_ids, index, step=k, window=None))[1]
        rows = slice(None) if k == 0 else last
        results += [compare_tensors(k, s, at[s], expected[against][s][rows], dtype,
                                    same=expected[dtype][s][rows] if dtype != against else None)
                    for s in ATTENTION_STAGES]
    return results, [at["logits"] for at in seen]


def load(directory, dtype: torch.dtype):
    """SGLang's MLA draft class built and loaded from `directory` as SGLang's model loader does."""
    from conformance.adapters.sglang.draft_model import load_model

    return load_model(directory, dtype)


# What the matrix compares of SGLang's MLA draft (a trace's claimed_stages): what mla_chain records from SGLang's own
# modules and passes (the embedding, fc_norm and fc, the attention's stages and its pool, the MLP, the hidden it
# returns, the logits) and the ids drafted from the logits. Its layer norms are fused with the residual adds
# (RMSNorm(x, residual) returns both), so embeds_norm, hidden_norm, residual, post_attn, post_attn_norm, layer_out and
# final_norm have no module output of their own here; q, v, q_rot and attn_core do not exist as tensors in SGLang's
# absorbed MLA path (q_nope meets kv_b_proj's k half, w_kc, before attention:
# models/deepseek_common/attention_forward_methods/forward_mla.py forward_absorb_prepare). Those stages are absent
# from its trace, never claimed.
CLAIMED = frozenset(("embeds", "fc_in_norm", "fc_out", "hidden_in", "attn_in", "q_latent", "kv_latent", "k_rope",
                     "attn_out", "mlp_out", "recurrent_hidden", "logits", "draft_ids", "target_ids"))


class LoadedMLA:
    """A loaded Eagle3DeepseekV2ForCausalLM run as the matrix runs a draft: `mla_chain` over the batch, teacher
    forced at steps >= 1 (the batch's next_ids) or fed its own target ids (free running, as the Llama chain)."""

    def __init__(self, model, dtype: torch.dtype):
        self.model, self.dtype = model, dtype
        self.hot_token_id = model.get_hot_token_id()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.hot_token_id is None else self.hot_token_id[draft_ids]

    def run(self, batch, steps: int = 1, record: bool = True):
        from conformance.adapters.sglang.drafting import sequence_lengths
        from conformance.core.trace import Trace

        lengths = sequence_lengths(batch)
        last = torch.tensor(lengths).cumsum(0) - 1
        if batch.next_ids is None:   # free running: each step fed the target ids drafted from the last logits
            def next_ids(_k, logits):
                return self.target_ids(torch.argmax(logits, dim=-1))
        else:
            next_ids = None if steps == 1 else batch.next_ids[last, :steps - 1]
        seen = mla_chain(self.model, batch.aux, batch.input_ids, batch.positions, lengths, next_ids, steps)
        trace_steps, rows = [], []
        for k, at in enumerate(seen):
            # As the worker after a draft pass with topk 1 on a CPU host: the argmax of the last tokens' logits.
            draft_ids = torch.argmax(at["logits"], dim=-1)
            trace_steps.append({**at, "draft_ids": draft_ids, "target_ids": self.target_ids(draft_ids)})
            rows.append({name: last for name in trace_steps[-1]} if k else
                        {"logits": last, "draft_ids": last, "target_ids": last})
        notes = [f"attention backend {ATTENTION_BACKEND}",
                 "step 0: DECODE of each request's first token, EXTEND of the rest over it; steps >= 1: DECODE on "
                 "each request's last token (mla_chain)",
                 "config via sglang get_config; weights via Eagle3DeepseekV2ForCausalLM.load_weights",
                 "stages compared: " + ", ".join(sorted(CLAIMED)) + " (the rest of the layer is not claimed)"]
        return Trace(impl="sglang", dtype=self.dtype, steps=trace_steps, rows=rows, notes=notes,
                     claimed_stages=CLAIMED, num_layers=1)


def account(directory, accounting):
    """SGLang's MLA draft loaded from `directory`, every tensor accounted for (weights.account_mla)."""
    from conformance.adapters.sglang.weights import account_mla

    return account_mla(directory, accounting)[0]
