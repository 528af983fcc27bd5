"""SGLang's real serving engine on a CUDA runner: the engine lane's `ServedEngine` without a CPU shim.

What differs from this host's engine (engine.py) and why:
- no shim at all: no Triton interpreter, no XPU tree kernels, no native RoPE, no force_eager; the scheduler
  process only installs the capture, so the tree build and greedy verify are SGLang's CUDA kernels;
- the capture records the rounds only (drafted tokens, accepted drafts; engine_shims.Capture.install(passes=False)):
  with CUDA graphs on, the draft's decode passes replay a graph and run no Python of the model;
- the server arguments come from the configuration being served (conformance/engine/gpu_matrix.py): attention
  backend, CUDA graphs, overlap scheduler, page size, dtype.

It needs SGLang's CUDA kernels (requirements-gpu.lock: sglang-kernel, flashinfer-python), which no host this
suite is tested on has: `missing()` says what is absent, and the gpu gate (conformance/plugin.py) skips on it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from conformance.adapters.sglang.engine import ServedEngine
from conformance.adapters.sglang.engine_shims import Capture, rank_dir

# What every CUDA engine of the lane gets; each configuration adds its own (gpu_matrix.GpuConfig.server_args).
# Greedy, one rank, no tokenizer (the prompts are ids), a small KV pool: the tiny models need no more.
BASE_ARGS = dict(
    speculative_algorithm="EAGLE3", device="cuda", tp_size=1, skip_tokenizer_init=True, max_total_tokens=4096,
    random_seed=0, log_level="error",
    # Decode graphs up to batch size 4 (arg_groups/fields/exec_.py:629, into the decode phase's max_bs at
    # arg_groups/cuda_graph_hook.py:72-73): the scenarios run at most three requests at once, and a start then
    # captures a few graphs instead of one per batch size up to the GPU's default. Not run here (no CUDA).
    cuda_graph_max_bs_decode=4,
)
# What requirements-gpu.lock installs, by import name -> package, and why the lane needs each:
# - sgl_kernel: SGLang's CUDA kernels (activations, sampling, FA3), imported as soon as torch sees a GPU
#   (sglang/srt/layers/activation.py:60);
# - flashinfer: the FlashInfer attention backend, and SGLang's sampling backend wherever it is installed
#   (arg_groups/overrides.py:1019-1025).
KERNELS = {"sgl_kernel": "sglang-kernel", "flashinfer": "flashinfer-python"}


def missing() -> str | None:
    """One line naming the CUDA kernel packages that are not installed, or None."""
    absent = [f"{module} from {package}" for module, package in KERNELS.items()
              if importlib.util.find_spec(module) is None]
    if not absent:
        return None
    return (f"engine gpu: SGLang's CUDA kernels are not installed ({', '.join(absent)}): install "
            "requirements-gpu.lock (make engine-gpu)")


def run_scheduler_process(*args, capture_dir: str | None = None, fault_yaml: str | None = None, **kwargs):
    """SGLang's run_scheduler_process with the rounds' capture and nothing else (no shim: a CUDA runner serves as
    a production server does). Picklable with functools.partial: it is the spawned process's target."""
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run

    if fault_yaml:   # the CUDA lane plants no fault in an engine: its meta tests plant them in recorded rounds
        raise ValueError("the CUDA engine lane takes no planted fault")
    if capture_dir:
        tp_rank = kwargs["tp_rank"] if "tp_rank" in kwargs else args[3]   # run_scheduler_process's 4th argument
        Capture(rank_dir(Path(capture_dir), tp_rank)).install(passes=False)
    return sglang_run(*args, **kwargs)


class CudaServedEngine(ServedEngine):
    """engine.ServedEngine on CUDA: the same start, generate, resolve and shutdown, another scheduler target."""

    BASE_ARGS = BASE_ARGS
    LAUNCH_ENV: dict[str, str] = {}
    SCHEDULER = staticmethod(run_scheduler_process)
