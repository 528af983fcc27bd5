"""A draft run as vLLM's proposer runs it (part of worker.py, in vLLM's environment; its docstring says what is
vLLM's and what is the harness's): the harness's KV cache, block tables and slot mapping, the proposer's step 0
and draft steps, each step's stages recorded (worker_record.py) and its bare pass kept for `replay`
(worker_replay.py)."""
from __future__ import annotations

import shims
import torch
from safetensors.torch import load_file, save_file
from worker_load import STATE, Loaded
from worker_pipe import first_line
from worker_record import canonical, first

# Harness faults the meta tests plant (conformance/meta/test_vllm_worker.py) to show the comparison catches them.
# inductor_error_once: the first attempt fails inside layer 0's attention as Inductor's codegen can (run's retry).
PLANTS = ("kv_write_next_slot", "null_block", "inductor_error_once")


class InductorError(RuntimeError):
    """The planted failure: named as torch._inductor's, which is what run() retries on."""


def kv_cache(loaded: Loaded, num_blocks: int):
    """One KV cache per draft layer: the logical view [blocks, kv heads, block, 2*head] in the memory layout
    the backend asks for (vllm/v1/worker/utils.py allocate_kv_cache): FLEX_ATTENTION LBNHC, memory [blocks,
    block, kv heads, 2*head] (flex_attention.py:130-133); CPU_ATTN LBHNC, the view itself (cpu_attn.py:82-84)."""
    layout = loaded.backend.supported_kv_cache_layouts()[0].name
    specs = []
    for attn in loaded.attn:
        spec = attn.get_kv_cache_spec(loaded.vllm_config)
        if layout == "LBNHC":
            cache = torch.zeros(num_blocks, spec.block_size, spec.num_kv_heads, 2 * spec.head_size,
                                dtype=spec.dtype).permute(0, 2, 1, 3)
        else:
            cache = torch.zeros(num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=spec.dtype)
        attn.kv_cache = cache
        specs.append(spec)
    return specs


def run(req: dict) -> dict:
    """One draft run; once more from a fresh compile cache when Inductor's codegen fails.

    torch 2.14.0 (vLLM's pin) can emit C++ that does not compile for the CPU flex-attention template when it
    recompiles with dynamic shapes after a sliding-window run (`'cur_kvSplitSize9' was not declared`,
    seen with the suite's window cases): torch._dynamo.reset() drops the compiled frames, so the next call
    compiles for the static shapes it sees. The same vLLM code runs; the trace notes say when this happened.
    """
    plant = req.get("plant")
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"unknown plant {plant!r}: {PLANTS}")
    shims.SLOT_SHIFT = 1 if plant == "kv_write_next_slot" else 0
    fail_once = STATE["loaded"][req["handle"]].attn[0].register_forward_pre_hook(_fail_once()) \
        if plant == "inductor_error_once" else None
    try:
        return _run(req)
    except Exception as exc:
        if type(exc).__name__ != "InductorError":
            raise
        torch._dynamo.reset()
        answer = _run(req)
        answer["notes"].append(f"torch Inductor codegen failed ({first_line(exc)}); recompiled from an empty "
                               "dynamo cache (torch._dynamo.reset()) and ran again")
        return answer
    finally:
        shims.SLOT_SHIFT = 0
        if fail_once is not None:
            fail_once.remove()


def _fail_once():
    calls = []

    def hook(module, args):
        calls.append(1)
        if len(calls) == 1:
            raise InductorError("planted: C++ compile error")
    return hook


def _run(req: dict) -> dict:
    import vllm
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    loaded: Loaded = STATE["loaded"][req["handle"]]
    model, cfg, dt = loaded.model, loaded.vllm_config, loaded.dtype
    batch = load_file(req["batch"])
    meta = req["meta"]
    steps, record = req["steps"], req.get("record", True)
    aux, ids, positions, seq_ids = batch["aux"], batch["input_ids"], batch["positions"], batch["seq_ids"]
    next_ids = batch.get("next_ids")
    lengths = torch.bincount(seq_ids).tolist()
    B, T = len(lengths), sum(lengths)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    last = starts + torch.tensor(lengths) - 1
    index_in_request = torch.arange(T) - starts[seq_ids]
    prefix = meta.get("cached_prefix") or [0] * B
    if not all(0 <= p < n for p, n in zip(prefix, lengths)):
        raise ValueError(f"cached_prefix {prefix} must leave at least one token of each sequence {lengths}")

    # Blocks: each request owns enough for its tokens and the draft steps; block 0 is the null block.
    block_size = loaded.attn[0].get_kv_cache_spec(cfg).block_size
    per_req = (max(lengths) + steps + block_size - 1) // block_size
    num_blocks = 1 + B * per_req
    specs = kv_cache(loaded, num_blocks)
    cfg.cache_config.num_gpu_blocks = num_blocks   # set by the engine after profiling
    first_block = 0 if req.get("plant") == "null_block" else 1   # planted: requests own vLLM's null block 0
    block_table = (first_block + torch.arange(B * per_req).reshape(B, per_req)).int()
    builders = [loaded.backend.get_builder_cls()(spec, [name], cfg, torch.device("cpu"))
                for spec, name in zip(specs, loaded.layer_names)]

    def slots(req_ids, index):   # the KV slot of a request's token `index` (its logical position in the request)
        return block_table[req_ids, index // block_size].long() * block_size + index % block_size

    def forward(input_ids, pos, hidden, query_lens, seq_lens, slot_map):
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=B,
            num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table, slot_mapping=slot_map, causal=True, positions=pos)
        md = {name: b.build(common_prefix_len=0, common_attn_metadata=cad) for name, b in zip(loaded.layer_names,
                                                                                          builders)}
        loaded.recorder.take()
        with set_forward_context(md, cfg, num_tokens=int(qsl[-1]),
                                 slot_mapping={name: slot_map for name in loaded.layer_names}):
            last_hidden, aux_out = model(input_ids=input_ids, positions=pos, hidden_states=hidden)
        return last_hidden, aux_out, loaded.recorder.take()

    loaded.recorder.on = record
    loaded.passes = []   # each draft step's bare pass (no hooks recorded), for `replay`
    out_steps, out_rows = [], []
    with torch.no_grad():
        # Step 0: combine_hidden_states, then the model over every scheduled token (llm_base_proposer.py:549-601),
        # in two chunks when the request extends over a cached prefix (chunked prefill).
        aux_dt = aux.to(dt)
        # A failed attempt (run's retry after an Inductor error) leaves its partial pass in the recorder, the
        # layer it failed in included: what this run records starts empty.
        loaded.recorder.take()
        fed = model.combine_hidden_states(aux_dt)
        fc_seen = loaded.recorder.take()
        st: dict = {}
        if record:
            st["aux_in"] = aux_dt
            norms = [first(fc_seen[k]) for k in sorted(k for k in fc_seen if k.startswith("fc_norm."))]
            if norms:
                st["fc_in_norm"] = torch.cat(norms, dim=-1)
            elif "input_norm" in fc_seen:
                st["fc_in_norm"] = first(fc_seen["input_norm"])
            st["fc_out"] = fed
        chunks = [[(0, p) for p in prefix], [(p, n) for p, n in zip(prefix, lengths)]] if any(prefix) else \
            [[(0, n) for n in lengths]]
        for chunk in chunks:
            rows = torch.cat([torch.arange(a, b) + s0 for (a, b), s0 in zip(chunk, starts.tolist())])
            args = (ids[rows].int(), positions[rows].long(), fed[rows], [b - a for a, b in chunk],
                    [b for _, b in chunk], slots(seq_ids[rows], index_in_request[rows]))
            last_hidden, aux_out, seen = forward(*args)
            if record:
                part = canonical(loaded, seen, ids[rows], None, aux_out)
                for name, value in part.items():
                    st.setdefault(name, value.new_empty((T, *value.shape[1:])))[rows] = value
            else:
                st.setdefault("recurrent_hidden", aux_out.new_empty((T, *aux_out.shape[1:])))[rows] = aux_out
            hidden_rows = rows
        # logits on each request's last token (:614), greedy: argmax of compute_logits (d2t scatter) (:447)
        sample_rows = torch.searchsorted(hidden_rows, last)
        sample = last_hidden[sample_rows]
        target_logits = model.compute_logits(sample)

        def step0(args=args):   # the proposer's step 0: fc, the model over the scheduled tokens, the logits
            fed_again = model.combine_hidden_states(aux_dt)
            out = forward(*args[:2], fed_again[rows] if len(chunks) == 1 else args[2], *args[3:])[0]
            return model.compute_logits(out[sample_rows])
        loaded.passes.append(step0)
        draft_logits = loaded.recorder.take().get("logits") if record else None
        st["target_ids"] = target_logits.argmax(-1)
        st["draft_ids"] = draft_ids(model, target_logits)
        if record:
            st["logits"] = first(draft_logits)
        out_steps.append(st)
        out_rows.append({"logits": last, "draft_ids": last, "target_ids": last})

        # Steps >= 1: one query per request (its last token), positions + 1, seq_lens + 1 (:683-760).
        hidden = st["recurrent_hidden"][last]
        prev = st["target_ids"]
        pos = positions[last].long()
        for k in range(1, steps):
            tok = next_ids[last, k - 1] if next_ids is not None else prev
            pos = pos + 1
            seq_lens = [n + k for n in lengths]
            slot_map = slots(torch.arange(B), torch.tensor(lengths) + k - 1)
            args = (tok.int(), pos, hidden, [1] * B, seq_lens, slot_map)
            last_hidden, aux_out, seen = forward(*args)
            loaded.passes.append(lambda args=args: model.compute_logits(forward(*args)[0]))
            st = canonical(loaded, seen, tok, hidden, aux_out) if record else {"recurrent_hidden": aux_out}
            target_logits = model.compute_logits(last_hidden)
            if record:
                st["logits"] = first(loaded.recorder.take()["logits"])
            st["target_ids"] = target_logits.argmax(-1)
            st["draft_ids"] = draft_ids(model, target_logits)
            out_steps.append(st)
            out_rows.append({name: last for name in st})
            hidden, prev = aux_out, st["target_ids"]

    tensors = {f"{k}/{name}": v.contiguous().clone() for k, st in enumerate(out_steps) for name, v in st.items()}
    save_file(tensors, req["out"])
    notes = [f"vLLM {vllm.__version__} Eagle3LlamaForCausalLM via EngineArgs -> get_model (its proposer's loader); "
             f"attention backend {loaded.backend.get_name()}",
             "step 0: the model over every token of each request" + (f" in two chunks (cached prefix {prefix})"
                                                                      if any(prefix) else "")
             + "; steps >= 1: one query per request on its last token, as the proposer's draft loop",
             *loaded.shared, *(f"shim: {s}" for s in shims.APPLIED)]
    return {"rows": [{n: r.tolist() for n, r in rows.items()} for rows in out_rows], "notes": notes}


def draft_ids(model, target_logits):
    """The draft-vocab id behind each target id compute_logits' argmax picked (the inverse of its scatter)."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    target = target_logits.argmax(-1)
    if d2t is None:
        return target
    base = torch.arange(d2t.shape[0]) + d2t
    return (base.unsqueeze(0) == target.unsqueeze(1)).int().argmax(-1)
