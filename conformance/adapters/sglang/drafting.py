"""SGLang's drafting loops over one LoadedSGLang (adapter.py): the chain (draft EXTEND, then DECODE
passes on each request's last token, as in serving) and the EAGLE tree (topk > 1) over SGLang's own
helpers. Each pass goes through `loaded.forward`, which records it for the benchmarks' replay.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from conformance.adapters.base import cached_prefix
from conformance.core.trace import Trace
from conformance.adapters.sglang.runtime import ATTENTION_BACKEND, make_pools
from reference.eagle3 import DraftBatch


def eager_tree_helpers():
    """Scope in which SGLang's tree helper runs eagerly: the one adjustment tree drafting needs.

    `select_top_k_tokens` dispatches to `_select_top_k_tokens_later`, which SGLang wraps in
    torch.compile on every host but NPU/XPU (speculative/spec_utils.py:437). On a CPU host that is an
    inductor C++ build, 17-34 s on first use, far over the CPU lane's budget. torch's own switch
    `set_stance("force_eager")` runs the same Python function without compiling it (the math that
    torch.compile must reproduce), only inside this scope (test_tree.py checks both).
    """
    return torch.compiler.set_stance("force_eager")


def sequence_lengths(batch: DraftBatch) -> list[int]:
    """Tokens per sequence of a packed batch (each sequence is one SGLang request)."""
    seq_ids = batch.seq_ids.tolist()
    lengths = [seq_ids.count(s) for s in dict.fromkeys(seq_ids)]
    if seq_ids != [s for s, n in zip(dict.fromkeys(seq_ids), lengths) for _ in range(n)]:
        raise ValueError("sequences must be contiguous in the packed batch")
    return lengths


def draft_kv_layout(slots: list[torch.Tensor], lengths: list[int], topk: int, steps: int):
    """SGLang's KV layout of a tree draft, for requests whose tokens sit in `slots` (prefix first).

    Returns (out_cache_loc, rows). out_cache_loc: each request's topk*steps slots after its prefix,
    what assign_draft_cache_locs_contiguous copies for the draft to write (eagle_worker_common.py:
    263-300, kernels/ops/speculative/cache_locs.py:43-82); SGLang's per_step_draft_out_cache_loc
    then gives tree row b*topk+r column r. rows[b*topk+r]: what that row reads, request b's prefix
    then column r's slots (the first n + i + 1 at draft pass i): the expanded req_to_token of SGLang's
    CPU draft backend (intel_amx_backend.py:461-487) and the rows generate_draft_decode_kv_indices
    emits on GPU (cache_locs.py:224-268). Those kernels do not run on this host (Triton; sgl_kernel's
    CPU build is not installable), so the layout is filled here; test_tree.py checks it against
    SGLang's Triton kernels run in Triton's interpreter.
    """
    out_cache_loc = torch.cat([sl[n:n + topk * steps] for sl, n in zip(slots, lengths)])
    rows = [torch.cat([sl[:n], sl[n + r * steps:n + (r + 1) * steps]])
            for sl, n in zip(slots, lengths) for r in range(topk)]
    return out_cache_loc, rows


def row_slot_kv(nodes: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """draft_kv_layout as an attention rule of the reference tree (reference/tree.py, `attends`): tree row
    r reads column r, so a row of the next depth attends to the nodes that held its row before, wherever
    its parent was (test_tree.py, note 4). The exact tree's rule follows the parent (`nodes[parent]`); the
    reference with this one is what shows that SGLang's tree divergence is this layout and nothing else."""
    return nodes


# ------------------------------------------------------------ the chain (topk == 1)

def extend(loaded, batch: DraftBatch, backend, slots: list[torch.Tensor], lengths: list[int]):
    """Step 0: SGLang's draft EXTEND; returns (its stages on packed rows, whether fc ran, the cached prefix)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    from sglang.srt.speculative.spec_utils import renorm_draft_probs
    from sglang.srt.utils.common import fast_topk

    B, T = len(lengths), sum(lengths)
    last = torch.tensor(lengths).cumsum(0) - 1
    req_pool_indices = torch.arange(1, B + 1, dtype=torch.int64)
    # Each sequence is one request. With a cached prefix (ServedBatch), the leading tokens of each request are
    # extended first and the rest extends over that cached prefix (chunked prefill), as a server
    # does with long prompts.
    # Copies: SGLang's forward must never write into the caller's batch.
    aux = batch.aux.to(loaded.dtype, copy=True)
    input_ids = batch.input_ids.long().clone()
    starts = last + 1 - torch.tensor(lengths)
    prefix = list(cached_prefix(batch) or [0] * B)
    if not all(0 <= p < n for p, n in zip(prefix, lengths)):
        raise ValueError(f"cached_prefix {prefix} must leave at least one token of each sequence {lengths}")
    chunks = [[(0, p) for p in prefix], [(p, n) for p, n in zip(prefix, lengths)]] if any(prefix) else \
        [[(0, n) for n in lengths]]
    st, fc_ran = {}, False
    for chunk in chunks:
        rows = torch.cat([torch.arange(a, b) + s0 for (a, b), s0 in zip(chunk, starts.tolist())])
        chunk_lens = [b - a for a, b in chunk]
        seq_lens = torch.tensor([b for _, b in chunk], dtype=torch.int64)
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=B, input_ids=input_ids[rows],
            req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
            out_cache_loc=torch.cat([sl[a:b] for sl, (a, b) in zip(slots, chunk)]),
            seq_lens_sum=int(seq_lens.sum()), positions=batch.positions[rows].long().clone(),
            extend_num_tokens=len(rows),
            extend_seq_lens=torch.tensor(chunk_lens, dtype=torch.int32),
            extend_prefix_lens=torch.tensor([a for a, _ in chunk], dtype=torch.int32),
            extend_start_loc=(torch.tensor(chunk_lens).cumsum(0) - torch.tensor(chunk_lens)).to(torch.int32),
            extend_seq_lens_cpu=chunk_lens, extend_prefix_lens_cpu=[a for a, _ in chunk],
            capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=EagleDraftExtendInput(hidden_states=aux[rows], num_tokens_per_req=1,
                                            num_tokens_for_logprob_per_req=1),
        )
        out, seen = loaded.forward(backend, fb)
        fc_ran = "fc" in seen
        part = loaded.stages(seen, aux[rows], input_ids[rows], out, aux_in=True)
        logits = part.pop("logits")
        for name, value in part.items():   # back to packed rows
            st.setdefault(name, value.new_empty((T, *value.shape[1:])))[rows] = value
    st["logits"] = logits   # the last chunk's: one row per request, its last token
    # As the worker after a draft extend: top-1 of the softmax of the last tokens' logits.
    _, draft_ids = fast_topk(renorm_draft_probs(out.next_token_logits, None, False), 1, dim=-1)
    st["draft_ids"] = draft_ids.flatten().clone()
    st["target_ids"] = loaded.target_ids(st["draft_ids"])
    return st, fc_ran, prefix


def chain(loaded, batch: DraftBatch, steps: int) -> Trace:
    """Step 0: the draft EXTEND; steps >= 1: SGLang's draft DECODE on each request's last token."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    lengths = sequence_lengths(batch)
    B = len(lengths)
    last = torch.tensor(lengths).cumsum(0) - 1                            # packed row of each last token
    backend, slots = make_pools(loaded, lengths, steps)
    loaded.passes = []
    req_pool_indices = torch.arange(1, B + 1, dtype=torch.int64)
    st, fc_ran, prefix = extend(loaded, batch, backend, slots, lengths)
    trace_steps = [st]
    trace_rows = [{"logits": last, "draft_ids": last, "target_ids": last}]

    # Steps >= 1: SGLang's draft DECODE, one query per request (its last token).
    hidden = st["recurrent_hidden"][last]
    prev_target = st["target_ids"]
    last_pos = batch.positions[last].long()
    for k in range(1, steps):
        ids = batch.next_ids[last, k - 1].long() if batch.next_ids is not None else prev_target
        seq_lens = torch.tensor(lengths, dtype=torch.int64) + k
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=B, input_ids=ids,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
            out_cache_loc=torch.stack([sl[n + k - 1] for sl, n in zip(slots, lengths)]),
            seq_lens_sum=int(seq_lens.sum()), positions=last_pos + k,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            spec_info=EagleDraftInput(hidden_states=hidden, num_tokens_per_req=1,
                                      num_tokens_for_logprob_per_req=1),
        )
        out, seen = loaded.forward(backend, fb)
        st = loaded.stages(seen, hidden, ids, out, aux_in=False)
        # The worker's topk == 1 draft step on a CPU host: argmax of the logits.
        st["draft_ids"] = torch.argmax(out.next_token_logits, dim=-1).clone()
        st["target_ids"] = loaded.target_ids(st["draft_ids"])
        trace_steps.append(st)
        trace_rows.append({name: last for name in st})
        hidden, prev_target = out.hidden_states, st["target_ids"]

    notes = [
        f"attention backend {loaded.attention_backend}",
        f"fc ran at step 0: {'yes' if fc_ran else 'no (aux width equals hidden_size)'}",
        "runtime adjustments: " + ", ".join(f"{k} {a}->{b}" for k, (a, b) in loaded.runtime["adjustments"].items()),
        f"step 0: EXTEND of {B} requests" + (f" in two chunks (cached prefix {prefix})" if any(prefix) else "")
        + "; steps >= 1: DECODE on each request's last token",
        "config via sglang get_config; weights via LlamaForCausalLMEagle3.load_weights",
    ]
    return loaded.trace(trace_steps, trace_rows, notes)


# ------------------------------------------------------------ the tree (topk > 1)

def tree(loaded, batch: DraftBatch, steps: int, topk: int, num_draft_tokens: int) -> Trace:
    """SGLang's EAGLE tree draft (EagleWorkerV2.draft_forward, eagle_worker_v2.py:742-923) over its
    own helpers. Step 0 is the draft EXTEND; step k >= 1 is draft-decode pass k - 1, one query per
    tree row b*topk + r. Each step also holds the candidates its rows propose (`candidate_ids`,
    `candidate_scores` as log of SGLang's probability products, `selected` within the candidates);
    the last step holds organize_draft_results' tree (`tree_tokens`, `tree_index`, `tree_parents`).
    See conformance/draft/test_tree.py for the semantics and the KV layout."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.eagle_utils import organize_draft_results, per_step_draft_out_cache_loc
    from sglang.srt.speculative.spec_utils import renorm_draft_probs, select_top_k_tokens
    from sglang.srt.utils.common import fast_topk

    if loaded.attention_backend != ATTENTION_BACKEND:
        raise NotImplementedError(f"tree drafting is driven through {ATTENTION_BACKEND} only")
    if not 2 <= num_draft_tokens <= topk + (steps - 1) * topk * topk + 1:
        raise ValueError(f"num_draft_tokens {num_draft_tokens} does not fit a tree of topk {topk}, {steps} steps")
    lengths = sequence_lengths(batch)
    B, N = len(lengths), len(lengths) * topk
    last = torch.tensor(lengths).cumsum(0) - 1
    backend, slots = make_pools(loaded, lengths, topk * steps + 1)       # prefix + topk*steps draft slots each
    loaded.passes = []
    st, fc_ran, _ = extend(loaded, batch, backend, slots, lengths)
    trace_steps, trace_rows = [st], [{"logits": last, "draft_ids": last, "target_ids": last}]

    out_cache_loc, branch_rows = draft_kv_layout(slots, lengths, topk, steps)
    write_locs = per_step_draft_out_cache_loc(out_cache_loc, B, topk, steps)     # [steps, N]: SGLang's slicing
    # torch_native reads a row's keys through req_to_token: one request row per tree row.
    rows_pool = ReqToTokenPool(size=N, max_context_len=max(lengths) + steps, device=loaded.device,
                               enable_memory_saver=False)
    for j, row in enumerate(branch_rows):
        rows_pool.req_to_token[1 + j, :row.numel()] = row.to(torch.int32)
    tree_backend = ATTENTION_BACKENDS[ATTENTION_BACKEND](SimpleNamespace(
        device=loaded.device, req_to_token_pool=rows_pool, token_to_kv_pool=backend.token_to_kv_pool))

    # As the worker after a draft extend (eagle_worker_v2.py:1071-1085), then draft_forward's entry
    # mapping to target ids (eagle_worker_v2.py:757-758).
    topk_p, topk_index = fast_topk(renorm_draft_probs(st["logits"], None, False), topk, dim=-1)
    topk_index = loaded.target_ids(topk_index)
    hidden = st["recurrent_hidden"][last]
    positions = (batch.positions[last].long() + 1).repeat_interleave(topk)   # seq_lens.repeat_interleave(topk)
    scores, score_list, token_list, parents_list = None, [], [], []
    for i in range(steps):
        with eager_tree_helpers():
            input_ids, hidden, scores, (cand_scores, cand_ids, parents) = select_top_k_tokens(
                i, topk_p, topk_index, hidden, scores, topk)
        score_list.append(cand_scores)
        token_list.append(cand_ids)
        parents_list.append(parents)
        # Layout -> canonical: parents are ids in the flat candidate list (-1 the root).
        offset = 0 if i == 0 else topk * topk * (i - 1) + topk
        trace_steps[i].update({"candidate_ids": cand_ids.clone(),
                               "candidate_scores": cand_scores.flatten(1).log(),
                               "selected": (parents[:, 1:] if i == 0 else parents) - offset})
        if i == steps - 1:
            break
        seq_lens = torch.tensor(lengths, dtype=torch.int64).repeat_interleave(topk) + i + 1
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=N, input_ids=input_ids,
            req_pool_indices=torch.arange(1, N + 1, dtype=torch.int64), seq_lens=seq_lens,
            seq_lens_cpu=seq_lens.clone(), out_cache_loc=write_locs[i], seq_lens_sum=int(seq_lens.sum()),
            positions=positions + i, capture_hidden_mode=CaptureHiddenMode.LAST,
            spec_info=EagleDraftInput(hidden_states=hidden, num_tokens_per_req=1,
                                      num_tokens_for_logprob_per_req=1),
        )
        out, seen = loaded.forward(tree_backend, fb)
        trace_steps.append(loaded.stages(seen, hidden, input_ids, out, aux_in=False))
        trace_rows.append({})
        # draft_forward's topk > 1 branch without rejection sampling (eagle_worker_v2.py:881-898).
        topk_p, topk_index = fast_topk(renorm_draft_probs(out.next_token_logits, None, False), topk, dim=-1)
        topk_index = loaded.target_ids(topk_index)
        hidden = out.hidden_states

    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        score_list, token_list, parents_list, num_draft_tokens)
    trace_steps[-1].update({"tree_tokens": draft_tokens, "tree_index": top_scores_index,
                            "tree_parents": parent_list})
    notes = [f"attention backend {loaded.attention_backend}", f"fc ran at step 0: {'yes' if fc_ran else 'no'}",
             f"tree: topk {topk}, {steps} steps, {num_draft_tokens} draft tokens; EXTEND then {steps - 1} "
             "draft-decode passes over batch*topk rows"]
    return loaded.trace(trace_steps, trace_rows, notes)
