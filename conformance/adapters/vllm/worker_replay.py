"""Throughput replay (part of worker.py, in vLLM's environment): a draft step's bare pass of the last run
(worker_run.py keeps them) timed here, `rounds` times, so that the pipe and the files are not part of a figure."""
from __future__ import annotations

import time

import torch
from worker_load import STATE, Loaded


def replay(req: dict) -> dict:
    """Draft step `step`'s bare pass of the handle's last run again, `rounds` times, each timed here (no pipe,
    no file, no hook: what a benchmark compares). A pass rewrites the same KV slots with the same values.
    Step 0: combine_hidden_states, the model over every token, compute_logits on the last ones; step k >= 1:
    the model on one query per request and compute_logits (llm_base_proposer.py:549-614, :683-760)."""
    loaded: Loaded = STATE["loaded"][req["handle"]]
    call = loaded.passes[req["step"]]
    hooks = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in loaded.model.modules()]
    for m, _, _ in hooks:   # detached while timed (the Recorder's and the accounting's hooks)
        m._forward_pre_hooks.clear()
        m._forward_hooks.clear()
    seconds = []
    try:
        with torch.no_grad():
            for _ in range(req["rounds"]):
                start = time.perf_counter()
                call()
                seconds.append(time.perf_counter() - start)
    finally:
        for m, pre, post in hooks:
            m._forward_pre_hooks.update(pre)
            m._forward_hooks.update(post)
    return {"pass_seconds": seconds}
