"""The one vLLM worker process of a session (worker.py, run by vLLM's own environment's python), the pipe
to it, and where that environment is. The adapter (adapter.py), its weight accounting (weights.py) and its
wiring (wiring.py) all talk to vLLM through it.
"""
from __future__ import annotations

import atexit
import builtins
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "worker.py"
# The vLLM environment: `make venv-vllm` builds it from requirements-vllm.lock; VLLM_VENV points elsewhere.
VENV_VARIABLE = "VLLM_VENV"
MISSING = "vLLM environment missing: make venv-vllm"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}

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
