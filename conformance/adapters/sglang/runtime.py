"""SGLang's per-process runtime and the runtime objects one draft pass needs: the CPU adjustment, the
published ServerArgs and model-parallel state, request/KV pools, the attention backend and the pass.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import torch

from conformance.adapters.sglang import compat

ATTENTION_BACKEND = "torch_native"
# On CUDA: SGLang's Triton attention, the GPU backend that needs no extra package (triton ships with
# torch; flashinfer and fa3 are separate CUDA builds).
GPU_ATTENTION_BACKEND = "triton"
INIT_METHOD = "tcp://127.0.0.1:0"
# Tensor parallelism on this host: a NCCL library name that does not exist (tensor_parallel.py, engine.py).
NO_NCCL = "libnccl-absent-on-this-cpu-host.so"


def cpu_runtime_adjustments() -> dict[str, tuple[object, object]]:
    """The one runtime adjustment SGLang needs on a plain CPU host; returns {what: (before, after)}.

    `RotaryEmbedding.__init__` treats an unknown platform as "not CUDA, not CPU" and imports
    `vllm._custom_ops` for a fallback kernel. SGLang's official switch (`SGLANG_USE_CPU_ENGINE=1`)
    would set this module's `_is_cpu` flag, but it also makes the KV-cache module import the CPU
    build of sgl-kernel, which is not installable. Setting only the flag (what the switch would set
    for this module) makes the rotary embedding dispatch to SGLang's own `forward_native`.
    """
    from sglang.srt.layers.rotary_embedding import base as rope_base

    before = rope_base._is_cpu
    rope_base._is_cpu = True
    return {"sglang.srt.layers.rotary_embedding.base._is_cpu": (before, rope_base._is_cpu)}


_RUNTIME: dict | None = None


def ensure_runtime() -> dict:
    """Set up SGLang's per-process runtime once (gloo world of 1, published ServerArgs, model parallel).

    Idempotent: pytest loads many checkpoints in one process, and SGLang's parallel state is global.
    Returns a description of what was set up (the CPU adjustments included).
    """
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import get_parallel, reset_context
    from sglang.srt.server_args import ServerArgs

    # SGLang picks its kernels per host when its modules are imported (is_cuda()), so the device is
    # the host's: CUDA when there is one (SGLang's own CUDA kernels, no adjustment), else the CPU.
    device = runtime_device()
    if device == "cuda" and importlib.util.find_spec("sgl_kernel") is None:
        # Otherwise the first SGLang layer import fails deep inside SGLang with a bare ImportError.
        raise RuntimeError("sglang on CUDA needs its CUDA kernels (the sgl_kernel module): "
                           "pip install --no-deps -r requirements-gpu.lock")
    adjustments = cpu_runtime_adjustments() if device == "cpu" else {}
    # Idempotent inside SGLang. Port 0: the OS picks a free port for this world of one, so
    # parallel processes (pytest-xdist workers, concurrent runs) never collide; no MASTER_* env.
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=INIT_METHOD)
    if not model_parallel_is_initialized():
        reset_context()
        # model_path "dummy" is SGLang's own "no model" value: server-argument resolution then
        # skips reading a model config (the draft's config is read per checkpoint in load()).
        compat.publish_scheduler(
            ServerArgs(model_path="dummy", device=device, attention_backend=attention_backend(device),
                       tp_size=1, ep_size=1, pp_size=1))
        # reset_context() drops the WORLD handle init_distributed_environment registered.
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    _RUNTIME = {"adjustments": adjustments, "distributed": f"gloo, world 1, {INIT_METHOD}", "device": device}
    return _RUNTIME


def runtime_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def attention_backend(device: str) -> str:
    return ATTENTION_BACKEND if torch.device(device).type == "cpu" else GPU_ATTENTION_BACKEND


# ---------------------------------------------------------------- per run: pools, backend, one pass

def make_pools(loaded, lengths: list[int], steps: int):
    """Request and KV pools for `loaded` (a LoadedSGLang): request r in row r + 1, its tokens in
    contiguous slots (row/slot 0 pad). Returns (the attention backend over them, each request's slots)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    per_req = [n + steps - 1 for n in lengths]
    req_to_token_pool = ReqToTokenPool(size=len(lengths), max_context_len=max(per_req),
                                       device=loaded.device, enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=sum(per_req) + 1, page_size=1, dtype=loaded.dtype,
                               head_num=loaded.num_kv_heads, head_dim=loaded.head_dim,
                               layer_num=len(loaded.model.model.layers), device=loaded.device,
                               enable_memory_saver=False, enable_alt_stream=False)
    slots, base = [], 1
    for r, n in enumerate(per_req):
        s = torch.arange(base, base + n, dtype=torch.int32)
        req_to_token_pool.req_to_token[r + 1, :n] = s
        slots.append(s.long())
        base += n
    if loaded.attention_backend == ATTENTION_BACKEND:
        # The torch_native backend reads only these three fields of a ModelRunner.
        runner = SimpleNamespace(device=loaded.device, req_to_token_pool=req_to_token_pool, token_to_kv_pool=kv_pool)
    else:
        runner = gpu_runner(loaded.device, loaded.dtype, loaded.model_dir, req_to_token_pool, kv_pool)
    return ATTENTION_BACKENDS[loaded.attention_backend](runner), slots


def gpu_runner(device: str, dtype: torch.dtype, model_dir: Path | None, req_to_token_pool, kv_pool):
    """The ModelRunner fields SGLang's Triton backend reads (its __init__ and the KV-index plan),
    as SGLang's own attention test kit fills them (sglang/test/kits/attention_unittest/
    attention_methods/dense_attention.py, MockModelRunner): this draft's ModelConfig, page size 1."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    allocator = SimpleNamespace(page_size=1, get_kvcache=lambda: kv_pool)
    runner = SimpleNamespace(
        device=device, gpu_id=torch.device(device).index or 0, page_size=1,
        req_to_token_pool=req_to_token_pool, token_to_kv_pool=kv_pool, token_to_kv_pool_allocator=allocator,
        model_config=ModelConfig(str(model_dir)), is_draft_worker=True,
        spec_algorithm=SpeculativeAlgorithm.EAGLE3, sliding_window_size=None, kv_cache_dtype=dtype,
        decode_num_tokens_per_req=lambda: 1)
    runner.kv_index_translator = KVIndexTranslator(
        req_to_token=req_to_token_pool.req_to_token, token_to_kv_pool_allocator=allocator,
        token_to_kv_pool=kv_pool, page_size=1, device=device, is_draft_worker=True)
    return runner


def forward_batch_on(fb, device: str):
    """A ForwardBatch with its tensors on `device`; the `*_cpu` host copies stay where SGLang wants them."""
    fb, spec = copy.copy(fb), copy.copy(fb.spec_info)   # shallow: no __post_init__ runs again
    for f in dataclasses.fields(fb):
        value = getattr(fb, f.name)
        if isinstance(value, torch.Tensor) and not f.name.endswith("_cpu"):
            setattr(fb, f.name, value.to(device))
    spec.hidden_states = spec.hidden_states.to(device)
    fb.spec_info = spec
    return fb


def forward_pass(model, backend, fb):
    """One draft pass as SGLang's model runner makes it: the backend's metadata, then the model."""
    from sglang.srt.model_executor.forward_context import ForwardContext

    with torch.no_grad(), compat.forward_context(ForwardContext(attn_backend=backend), fb):
        backend.init_forward_metadata(fb)
        return model.forward(fb.input_ids, fb.positions, fb)
