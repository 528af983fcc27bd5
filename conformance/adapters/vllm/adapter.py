"""vLLM 0.33.0's EAGLE-3 draft, run by vLLM's own code in vLLM's own environment (.venv-vllm).

vLLM pins another torch (2.14.0) and ~45 packages the project environment lacks, so it cannot be
imported here: one worker process (worker.py, run by .venv-vllm's python) per test session builds and
runs the drafts, and this adapter drives it over a pipe, with tensors in safetensors files. Step 0 is the
draft over every token of each request; steps >= 1 are the proposer's draft steps on each request's last
token (Trace.rows), as a server runs them. On a host without CUDA two shims (shims.py) replace the
attention backend vLLM's CPU platform picks and its CUDA KV-write op; the trace notes say so.

The tests of this adapter form their own lane (`lane`): `make vllm` / `pytest -m vllm`, never the
default one; without .venv-vllm they skip with one line.
"""
from __future__ import annotations

import contextlib
import weakref
from importlib import metadata
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import ClassVar, Mapping

import torch
from safetensors.torch import load_file, save_file

from conformance.adapters.base import AdapterBase, Drafter, TimedPass, cached_prefix, chain_drafter
from conformance.adapters.vllm import engine, mla
from conformance.adapters.vllm.process import DTYPE_NAMES, MISSING, Worker, venv, venv_python
from conformance.checkpoints.formats import sglang_mla
from conformance.core.trace import Trace
from conformance.core import stages
from reference.eagle3 import DraftBatch, Eagle3Config

# Why a benchmark shape's pass does not compile on a CPU host (cpu_compile_fails).
FLEX_CODEGEN = "vllm on cpu: torch 2.14 Inductor's CPU flex-attention template emits C++ that does not compile"
FLEX_BLOCK_MASK = ("vllm on cpu: torch 2.14 Inductor's flex-attention lowering asserts 'KV seqlen must be smaller "
                   "than the block_mask size' for 32 requests")
# What a benchmark times, per step: the pass replayed in the worker and timed there (worker_replay.py).
TIMED = ("vLLM's step 0 in its worker: combine_hidden_states, the model over every token, compute_logits on each "
         "request's last (timed inside the worker: no pipe)",
         "vLLM's draft step 1 in its worker: one query per request on its last token, compute_logits (timed inside "
         "the worker: no pipe)")


class VLLMAdapter(AdapterBase):
    name: ClassVar[str] = "vllm"
    package: ClassVar[str | None] = "vllm"
    releases: ClassVar[tuple[str, ...]] = ("0.33.0",)
    is_server: ClassVar[bool] = True
    lane: ClassVar[str] = "vllm"               # its tests run in their own lane (pytest -m vllm, make vllm)
    # Its two model runners read the draft config's aux ids each their own way (wiring.py). V2 first: vLLM picks
    # it wherever Triton is installed and the config needs nothing it lacks (config/vllm.py:731-767), i.e. on a
    # CUDA server; V1 where it falls back (or VLLM_USE_V2_MODEL_RUNNER=0).
    runners: ClassVar[tuple[str, ...]] = ("v2", "v1")
    # vLLM serves both the speculators and the SGLang format; speculators is the format vLLM's own
    # training project writes and the one its config translator reads (the wiring area reads both).
    checkpoint_format: ClassVar[str] = "speculators"
    other_formats: ClassVar[tuple[str, ...]] = ("sglang",)   # also served: conformance/draft/test_served_formats.py
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST)
    draft_group: ClassVar[int | None] = None
    serving_decode: ClassVar[bool] = True
    # vLLM's real serving engine (LLM + speculative_config) in the vLLM engine environment (vLLM's CPU build): the
    # vLLM engine lane, `make vllm-engine` (engine.py, engine_worker.py, engine_capture.py).
    engine: ClassVar[ModuleType | None] = engine
    # Its MLA draft's config reading and weight loading, checked without a forward (mla.py; forward_not_run).
    mla_checks: ClassVar[ModuleType | None] = mla
    # Benchmark shapes whose pass does not compile on a CPU host (seen in every dtype and size of the sweep): its
    # attention there is the FLEX_ATTENTION shim (shims.py), which torch 2.14's Inductor compiles; its CPU
    # flex-attention template fails for these (not vLLM's maths: a CUDA server runs another backend).
    cpu_compile_fails: ClassVar[Mapping[tuple[int, int], str]] = MappingProxyType({
        (1, 1024): FLEX_CODEGEN, (32, 128): FLEX_BLOCK_MASK, (32, 1024): FLEX_BLOCK_MASK})
    silent_drop: ClassVar[str | None] = ("Eagle3LlamaForCausalLM.load_weights returns no loaded-name set, so "
                                         "DefaultModelLoader's check of uninitialised weights never runs "
                                         "(vllm/model_executor/models/llama_eagle3.py:420-470)")

    @classmethod
    def version(cls) -> str | None:
        """vLLM's version in its own environment (read from its metadata, no process started)."""
        for site in (venv() / "lib").glob("python*/site-packages"):
            for dist in metadata.distributions(name=cls.package, path=[str(site)]):
                return dist.version
        return None

    @classmethod
    def missing(cls) -> str | None:
        """Why this adapter's lane cannot run here (one line), or None."""
        return None if venv_python().exists() else MISSING

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        if why := self.forward_not_run(cfg):
            return f"{mla.CHECKED}: {why}"
        return None

    def forward_not_run(self, cfg: Eagle3Config) -> str | None:
        # Its MLA draft (deepseek_eagle3.py:274) is read and loaded by vLLM's own code (mla.py,
        # conformance/draft/test_mla_vllm.py); its attention cannot run here.
        return mla.FORWARD_NOT_RUN if cfg.draft_arch == "mla" else None

    def format_for(self, cfg: Eagle3Config) -> str:
        # An MLA draft in the format its published drafts come in (TorchSpec's export, fixtures/mla.py), which vLLM
        # resolves to its MLA class by architectures (model_executor/models/registry.py:712-713).
        return sglang_mla.NAME if cfg.draft_arch == "mla" else self.checkpoint_format

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        return True   # combine_hidden_states always runs fc (llama_eagle3.py:397-418)

    def dense_attention(self, device: str) -> bool:
        return False   # paged attention per request over its KV blocks

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedVLLM":
        """Build and load the draft in the worker as vLLM's proposer does; `server_args` (SGLang flags) do
        not apply to vLLM."""
        from conformance.checkpoints import detect_format

        if torch.device(device).type != "cpu":
            raise NotImplementedError("vllm: the adapter runs the worker on the CPU only")
        if detect_format(Path(ckpt_dir)) == sglang_mla.NAME:   # read and accounted for (mla.py), never run here
            raise NotImplementedError(f"vllm: {mla.CHECKED}: {mla.FORWARD_NOT_RUN}")
        worker = Worker.get()
        answer = worker.ask("load", ckpt=str(Path(ckpt_dir).resolve()), dtype=DTYPE_NAMES[dtype],
                            work=str(worker.scratch()), steps=8)
        return LoadedVLLM(worker, answer, dtype)

    def served_boundaries(self, draft_dir: Path, target_config: Path, num_layers: int,
                          runner: str | None = None) -> dict:
        """The target boundaries vLLM feeds the draft for this config with that model runner (default: the one
        a CUDA server picks) (wiring.py: read by vLLM's own code)."""
        from conformance.adapters.vllm.wiring import served_boundaries

        return served_boundaries(draft_dir, target_config, num_layers, runner or self.runners[0])

    def account(self, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None):
        """vLLM's load observed in the worker (worker_accounting.py), accounted for here (accounting.py)."""
        from conformance.adapters.vllm.weights import account
        from conformance.checkpoints import detect_format

        if detect_format(Path(ckpt_dir)) == sglang_mla.NAME:
            return mla.account(Path(ckpt_dir), dtype)
        return account(self, Path(ckpt_dir), dtype, target, loaded=LoadedVLLM)


class LoadedVLLM:
    def __init__(self, worker: Worker, answer: dict, dtype: torch.dtype):
        self.worker, self.handle, self.dtype = worker, answer["handle"], dtype
        self.num_layers = answer["num_layers"]
        self.reading = answer["reading"]           # what vLLM read from the draft config (its hf_config)
        weakref.finalize(self, _drop, worker, self.handle)

    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True, plant: str | None = None) -> Trace:
        """`plant`: a harness fault of worker_run.PLANTS, for the meta tests only."""
        job = self.worker.scratch()
        tensors = {"aux": batch.aux, "input_ids": batch.input_ids, "positions": batch.positions,
                   "seq_ids": batch.seq_ids}
        if batch.next_ids is not None:
            tensors["next_ids"] = batch.next_ids
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(job / "batch.safetensors"))
        prefix = cached_prefix(batch)
        meta = {"cached_prefix": list(prefix) if prefix else None}
        answer = self.worker.ask("run", handle=self.handle, batch=str(job / "batch.safetensors"),
                                 out=str(job / "trace.safetensors"), steps=steps, record=record, meta=meta,
                                 plant=plant)
        flat = load_file(str(job / "trace.safetensors"))
        trace_steps: list[dict] = [{} for _ in range(steps)]
        for key, value in flat.items():
            step, stage = key.split("/", 1)
            trace_steps[int(step)][stage] = value
        rows = [{name: torch.tensor(r) for name, r in step_rows.items()} for step_rows in answer["rows"]]
        notes = answer["notes"]
        if batch.next_ids is not None and steps > 1:
            notes = [*notes, "steps >= 1 teacher-forced: each request's last row embeds batch.next_ids"]
        return Trace(impl=VLLMAdapter.name, dtype=self.dtype, steps=trace_steps, rows=rows, notes=notes,
                     claimed_stages=VLLMAdapter.claimed_stages, num_layers=self.num_layers)

    def timed_pass(self, batch: DraftBatch, step: int):
        """Pass `step` of a two-step run, replayed alone in the worker (worker_replay.py) and timed there: its clock
        advances by the seconds the worker measured, so the pipe and files are not part of the figure."""
        self.run(batch, 2, record=False)
        clock = WorkerClock()

        def call():
            clock.seconds += self.worker.ask("replay", handle=self.handle, step=step, rounds=1)["pass_seconds"][0]
        return contextlib.nullcontext(TimedPass(call, (step,), TIMED[step], clock=clock))

    def drafter(self) -> Drafter:
        return chain_drafter(self)


class WorkerClock:
    """The worker's seconds spent in timed passes so far: a benchmark's clock (TimedPass.clock)."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def _drop(worker: Worker, handle: int) -> None:
    worker.dropped.append(handle)
