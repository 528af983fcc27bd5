"""SGLang's real serving engine (`sglang.Engine`) on this host, with the scheduler-process shims.

Unmodified `sglang.Engine`: the tokenizer manager in this process, scheduler and detokenizer as
spawned processes, `TpModelWorker`/`ModelRunner`, the EAGLE-3 spec-v2 worker, the radix cache and
SGLang's own accept accounting (`meta_info`). What the scheduler process needs on a CPU host is set
up there by engine_shims.py; `read_events()` returns what its capture recorded.
"""
from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from conformance.adapters.sglang import engine_shims
from conformance.adapters.sglang.runtime import NO_NCCL
from conformance.adapters.sglang.engine_shims import SHIMS  # noqa: F401  (the engine lane reports them)

# Server arguments every engine of the lane gets (greedy fp32 on CPU; SGLang resolves the rest).
NAME = "sglang"   # the report's server column (conformance/engine/reporting.py)
# What SGLang's own accept length is (the engine lane's accept-length bridge, conformance/engine/bridge.py).
ACCEPT_LENGTH = ("completion tokens / verify count (meta_info spec_accept_length: it counts the prefill's token and "
                 "not the last round's tokens past the length limit)")
BASE_ARGS = dict(
    speculative_algorithm="EAGLE3", device="cpu", attention_backend="triton", disable_cuda_graph=True,
    tp_size=1, skip_tokenizer_init=True, dtype="float32", max_total_tokens=4096, random_seed=0,
    log_level="error",
)
# The server arguments SGLang may resolve differently from what was asked: reported per engine.
RESOLVED_FIELDS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                   "attention_backend", "speculative_draft_attention_backend", "disable_overlap_schedule",
                   "chunked_prefill_size", "max_running_requests", "disable_radix_cache", "page_size",
                   "disable_cuda_graph", "dtype", "device",
                   "max_total_num_tokens")   # the KV pool's tokens, as the scheduler sized it (get_init_info)


def claimed_stages(cfg) -> frozenset[str] | None:
    """The stages the scheduler's capture records of a served draft of `cfg` (engine_shims.Capture) when they are not
    the engine lane's default (every canonical stage but draft_ids: the Llama draft's): the MLA draft's own."""
    from conformance.adapters.sglang.engine_mla import ENGINE_CLAIMED

    return ENGINE_CLAIMED if cfg.draft_arch == "mla" else None


def tp_environment(tp_size: int) -> dict[str, str]:
    """What SGLang's CPU tensor parallelism needs on this host, in its own variables (none at TP 1).

    - SGLANG_CPU_OMP_THREADS_BIND: SGLang refuses more CPU ranks than NUMA nodes unless each rank's cores
      are given (utils/numa_utils.py:460-470, its own message suggests the variable): one core per rank.
    - SGLANG_NCCL_SO_PATH names a library that does not exist: this torch is a CUDA build that ships
      libnccl, so SGLang's group set-up would open a PyNccl communicator on the CPU and fail in
      torch.cuda.device(cpu) (distributed/parallel_state.py:463, pynccl.py:116); with the library absent SGLang
      disables PyNccl itself (pynccl.py:73-79), as under a CPU torch build, and its collectives go over gloo.
    """
    if tp_size <= 1:
        return {}
    cores = os.cpu_count() or 1
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(rank % cores) for rank in range(tp_size)),
            "SGLANG_NCCL_SO_PATH": NO_NCCL}


@functools.cache
def shimmed_engine_class():
    """The subclass of sglang.Engine, made on first use: importing SGLang's entrypoint pulls in uvloop,
    fastapi and the rest, which only the engine lane needs."""
    from sglang.srt.entrypoints.engine import Engine

    class ShimmedEngine(Engine):
        """sglang.Engine whose scheduler process runs `scheduler` (SGLang's extension point for private
        schedulers, entrypoints/engine.py:266): engine_shims.run_scheduler_process on this CPU host, the capture
        alone on a CUDA runner (engine_cuda.py)."""

        def __init__(self, capture_dir: str | None = None, fault_yaml: str | None = None,
                     scheduler=engine_shims.run_scheduler_process, **kwargs):
            # An instance attribute: Engine.__init__ reads self.run_scheduler_process_func; a partial of a
            # module-level function pickles into the spawned process.
            self.run_scheduler_process_func = functools.partial(scheduler, capture_dir=capture_dir,
                                                                fault_yaml=fault_yaml)
            super().__init__(**kwargs)

    return ShimmedEngine


@contextlib.contextmanager
def launch_environment(extra: dict[str, str]):
    """The spawned processes copy this process's environment when they start: TRITON_INTERPRET=1 (read
    when triton decorates SGLang's kernels, at import) and SGLang's own debug switches reach them
    from here. Restored afterwards, so that nothing else in this process runs interpreted."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def ipc_names_in(directory: str):
    """SGLang names its IPC sockets with tempfile.NamedTemporaryFile(delete=False) in the parent while the
    engine starts (PortArgs.init_new, server_args.py:781-811) and never removes them: every engine left four
    or five files in the host's temp directory. With tempfile's directory pointed at the engine's own
    (short: a socket path has about 107 bytes), shutdown removes them with it."""
    saved = tempfile.tempdir
    tempfile.tempdir = directory
    try:
        yield
    finally:
        tempfile.tempdir = saved


@dataclass
class Served:
    """One request as SGLang served it."""

    prompt: list[int]
    output_ids: list[int]
    meta: dict             # SGLang's meta_info: spec_verify_ct, spec_accept_length, histogram, ...


class EngineFailed(RuntimeError):
    """A spawned SGLang process failed (it sent SIGQUIT to this process)."""


def sigquit_during_launch(signum, frame):
    """SGLang's `custom_sigquit_handler` while the engine starts. Its default kills the whole process tree,
    this test session included; raising here fails only the engine's start (ServedEngine cleans up)."""
    raise EngineFailed("an SGLang process failed while the engine started (SIGQUIT from a child)")


class ServedEngine:
    """A started engine with its capture directory; `generate`, then `shutdown` (always).

    The class attributes are what makes it this CPU host's engine; engine_cuda.CudaServedEngine changes them for
    a CUDA runner."""

    BASE_ARGS = BASE_ARGS
    # What the spawned processes need in their environment (launch_environment) besides tp_environment.
    LAUNCH_ENV = {"TRITON_INTERPRET": "1"}
    SCHEDULER = staticmethod(engine_shims.run_scheduler_process)

    def __init__(self, target_dir: Path, draft_dir: Path, capture_dir: Path, server_args: dict,
                 env: dict[str, str] | None = None, fault_yaml: str | None = None):
        from sglang.srt.utils import kill_process_tree

        self.capture_dir = capture_dir
        self.requested = dict(server_args)
        self.failed: str | None = None
        # Engine.__init__ sets process-wide state for its children (environment variables, the spawn start
        # method: entrypoints/engine.py:1878-2000); shutdown() gives this process its own back.
        self._environ, self._start_method = dict(os.environ), multiprocessing.get_start_method(allow_none=True)
        self.ipc_dir = tempfile.mkdtemp(prefix="e3c-ipc-")
        start = time.perf_counter()
        try:
            with ipc_names_in(self.ipc_dir), launch_environment(
                    {**self.LAUNCH_ENV, **tp_environment(server_args.get("tp_size", 1)), **(env or {})}):
                self.engine = shimmed_engine_class()(
                    capture_dir=str(capture_dir), fault_yaml=fault_yaml, scheduler=self.SCHEDULER,
                    model_path=str(target_dir), speculative_draft_model_path=str(draft_dir),
                    custom_sigquit_handler=sigquit_during_launch, **{**self.BASE_ARGS, **server_args})
        except BaseException:
            kill_process_tree(os.getpid(), include_parent=False)   # what Engine.shutdown does
            self._restore()
            raise
        finally:
            signal.signal(signal.SIGQUIT, signal.SIG_DFL)
        # Once running, SGLang's tokenizer manager answers a child's SIGQUIT by killing the process tree
        # (tokenizer_manager.py:4072-4081). Instead: stop the event loop, so that the request in flight
        # fails with EngineFailed and the caller shuts the engine down.
        manager = self.engine.tokenizer_manager

        async def handle_loop():   # made on first use otherwise, on the running loop, with SGLang's handler
            manager.auto_create_handle_loop()

        self.engine.loop.run_until_complete(handle_loop())
        self.loop = manager.event_loop
        self.loop.add_signal_handler(signal.SIGQUIT, self._child_failed)
        self.start_seconds = time.perf_counter() - start
        self.generate_seconds = 0.0

    def _child_failed(self) -> None:
        self.failed = "an SGLang process failed while serving (SIGQUIT from a child)"
        self.loop.stop()

    def resolved(self) -> dict:
        """The server arguments as SGLang resolved them: what the running engine reports (the
        scheduler's own resolution included, e.g. the overlap schedule it turns off on CPU)."""
        info = self.engine.get_server_info()
        return {name: info.get(name) for name in RESOLVED_FIELDS}

    def ipc_paths(self) -> list[str]:
        """The files behind the engine's IPC sockets (its PortArgs' ipc:// names)."""
        args = vars(self.engine.port_args)
        return sorted(v.removeprefix("ipc://") for k, v in args.items()
                      if k.endswith("_ipc_name") and isinstance(v, str) and v.startswith("ipc://"))

    def shims(self) -> dict[str, str]:
        path = self.capture_dir / "shims.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def drafter(self) -> str:
        """The speculative worker class SGLang's scheduler built (speculative/spec_info.py create_worker:
        EAGLEWorkerV2, MultiLayerEagleWorkerV2, ...), as the capture saw it; "" when no capture ran."""
        path = self.capture_dir / "drafter.txt"
        return path.read_text().strip() if path.is_file() else ""

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[Served]:
        """Greedy generations of `prompts`, submitted together (one batch when they fit)."""
        start = time.perf_counter()
        try:
            outs = self.engine.generate(input_ids=prompts, sampling_params={
                "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True})
        except RuntimeError as exc:
            if self.failed:
                raise EngineFailed(self.failed) from exc
            raise
        self.generate_seconds += time.perf_counter() - start
        return [Served(list(p), list(o["output_ids"]), dict(o["meta_info"])) for p, o in zip(prompts, outs)]

    def shutdown(self) -> None:
        """SGLang's shutdown (it ends every child process of this process), then this process's state back."""
        try:
            self.loop.remove_signal_handler(signal.SIGQUIT)
            self.engine.shutdown()
        finally:
            self._restore()

    def _restore(self) -> None:
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        os.environ.clear()
        os.environ.update(self._environ)
        multiprocessing.set_start_method(self._start_method, force=True)


def read_events(capture_dir: Path, tp_rank: int = 0) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """Every event the scheduler's capture of rank `tp_rank` wrote, in order: (metadata, tensors)."""
    events = []
    for path in sorted(engine_shims.rank_dir(capture_dir, tp_rank).glob("event_*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["meta"])
            events.append((meta, {k: f.get_tensor(k) for k in f.keys()}))
    return events
