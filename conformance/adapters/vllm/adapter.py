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

import atexit
import builtins
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import weakref
from importlib import metadata
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file

from conformance.adapters.base import Drafter, TimedPass, Trace, chain_drafter
from conformance.core import stages
from reference.eagle3 import DraftBatch, Eagle3Config

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "worker.py"
# The vLLM environment: `make venv-vllm` builds it from requirements-vllm.lock; VLLM_VENV points elsewhere.
VENV_VARIABLE = "VLLM_VENV"
MISSING = "vLLM environment missing: make venv-vllm"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}

# What a benchmark times, per step: the pass replayed in the worker and timed there (worker_replay.py).
TIMED = ("vLLM's step 0 in its worker: combine_hidden_states, the model over every token, compute_logits on each "
         "request's last (timed inside the worker: no pipe)",
         "vLLM's draft step 1 in its worker: one query per request on its last token, compute_logits (timed inside "
         "the worker: no pipe)")


def venv() -> Path:
    return Path(os.environ.get(VENV_VARIABLE) or ROOT / ".venv-vllm").absolute()   # the worker runs elsewhere


def venv_python() -> Path:
    return venv() / "bin" / "python"


class VLLMError(Exception):
    """vLLM refused something in the worker; `kind` is the class of vLLM's own exception."""


def _exception(kind: str, message: str) -> Exception:
    """vLLM's exception again, by class name (a registry load entry matches the class name), as one line."""
    cls = getattr(builtins, kind, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return type(kind, (VLLMError,), {})(message)


class Worker:
    """The one vLLM worker process of this session, started on first use, ended at exit."""

    _instance: "Worker | None" = None

    def __init__(self):
        python = venv_python()
        if not python.exists():
            raise RuntimeError(MISSING)
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-worker-"))
        self.log = open(self.dir / "worker.log", "w+")
        env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               "PYTHONPATH": ""}
        if not torch.cuda.is_available():
            env["VLLM_TARGET_DEVICE"] = "cpu"   # vLLM's own switch (vllm/platforms/__init__.py:176)
        self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=self.dir)
        self.ready = self._answer()
        self.count = 0
        self.dropped: list[int] = []
        atexit.register(self.close)

    @classmethod
    def get(cls) -> "Worker":
        if cls._instance is None or cls._instance.proc.poll() is not None:
            cls._instance = Worker()
        return cls._instance

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise RuntimeError(f"vllm worker ({venv_python()}) exited with {self.proc.wait()}:\n{tail}")
        return json.loads(line)

    def ask(self, op: str, **fields) -> dict:
        # Models dropped since the last request go with this one (a finalizer must never talk to the pipe).
        drop, self.dropped = self.dropped, []
        self.proc.stdin.write(json.dumps({"op": op, "drop": drop, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if not answer["ok"]:
            raise _exception(answer["error"], f"vllm: {answer['message']}")
        return answer

    def scratch(self) -> Path:
        self.count += 1
        path = self.dir / f"job{self.count}"
        path.mkdir()
        return path

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class VLLMAdapter:
    name: ClassVar[str] = "vllm"
    package: ClassVar[str | None] = "vllm"
    releases: ClassVar[tuple[str, ...]] = ("0.33.0",)
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
        return None

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        return True   # combine_hidden_states always runs fc (llama_eagle3.py:397-418)

    def dense_attention(self, device: str) -> bool:
        return False   # paged attention per request over its KV blocks

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedVLLM":
        """Build and load the draft in the worker as vLLM's proposer does; `server_args` (SGLang flags) do
        not apply to vLLM."""
        if torch.device(device).type != "cpu":
            raise NotImplementedError("vllm: the adapter runs the worker on the CPU only")
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

        return account(self, Path(ckpt_dir), dtype, target)


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
        meta = {"cached_prefix": list(batch.cached_prefix) if batch.cached_prefix else None}
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
