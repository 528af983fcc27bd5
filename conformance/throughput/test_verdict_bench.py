"""Speed and memory of the user verdict (`pytest --draft-checkpoint=D ...`), measured, not asserted.

Per draft shape (fixtures/real_shapes.py: tiny, Llama-3.1-8B, Kimi-K2.5; and the MLA draft Kimi-K2.5 is served with,
the published config as it is, fixtures/data/real-configs/mla/) a draft is written in SGLang's format (the real
shapes in bf16, drawn tensor by tensor as conformance/draft/real_size.py does) and the
whole verdict runs as a user runs it, with the draft's real target config and a chain of server flags,
in its own process: wall time, peak RSS (the child's own rusage, so nothing else in this process
counts) and peak anonymous memory (sampled). RSS also counts the checkpoint's memory-mapped pages, once
per mapping (the implementations map the same file several times); those are the page cache's, which
the kernel reclaims, so the anonymous peak is what the run really needs. The imports the verdict needs
(torch, transformers, speculators, SGLang's models and runtime) are measured apart in a process that
does only them; "after imports" is the difference.

    OMP_NUM_THREADS=1 python -m pytest conformance/throughput/test_verdict_bench.py -m benchmark -s

The verdict's anonymous memory is capped at what is available when it starts, less 2 GiB (the machine
may be shared): a shape that needs more is stopped there, and that is its figure. Figures go to
pytest-benchmark's extra_info (--benchmark-json) and stdout.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conformance.checkpoints.directory import write_draft
from conformance.draft.real_size import make_real_size_mla_weights, make_real_size_weights
from fixtures.mla import PUBLISHED, write_mla_checkpoint
from fixtures.real_configs import REAL_CONFIGS
from fixtures.real_shapes import SHAPES
from fixtures.targets import TARGETS_BY_ID, write_target_config
from fixtures.tiny import make_config, make_draft_weights

ROOT = Path(__file__).resolve().parents[2]
SGLANG_ARGS = "--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4"
TARGETS = {"llama31_8b": "meta-llama--Meta-Llama-3.1-8B.json", "kimi_k25": "moonshotai--Kimi-K2.5.json",
           "kimi_k25_mla": "moonshotai--Kimi-K2.5.json"}
MLA = "kimi_k25_mla"
# The published MLA config states 4096 positions (no max_position_embeddings: DeepseekV3Config's default) and the
# Kimi-K2.5 target 262144: the server is told how long it runs, as a user serving that draft must.
EXTRA_ARGS = {MLA: " --context-length 4096"}
IMPORTS = ("import torch, transformers, speculators, sglang.srt.server_args, sglang.srt.models.registry, "
           "sglang.srt.models.llama_eagle3; "
           "from conformance.adapters.sglang.runtime import ensure_runtime; ensure_runtime()")
HEADROOM = 2 << 30   # bytes left to the rest of the machine when the verdict's memory is capped
WATCH_S = 0.2        # how often the run's resident memory is read


def measured(argv: list[str], env: dict, limit: int | None = None) -> dict:
    """Run argv in its own process: wall seconds, its peak RSS and peak anonymous memory (GiB), exit code,
    the output's tail.

    With `limit` (bytes) the run is stopped once its processes together hold more anonymous memory than
    that, before the kernel would kill processes of whoever shares the machine; `over_limit` says so.
    (A kernel limit does not fit: RLIMIT_AS and RLIMIT_DATA count the checkpoint's file mappings.)"""
    import psutil

    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
    reader.start()
    over, watched, peak_anon = False, psutil.Process(proc.pid), 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)   # reaped here: its rusage is this child's alone
        if pid:
            break
        try:   # Linux: shared = resident file-backed (and shm) pages; the rest is anonymous
            infos = [p.memory_info() for p in [watched, *watched.children(recursive=True)]]
            anon = sum(m.rss - m.shared for m in infos)
        except psutil.Error:   # it ended between the wait and the read
            anon = 0
        peak_anon = max(peak_anon, anon)
        if limit and anon > limit and not over:
            over = True
            os.killpg(proc.pid, signal.SIGKILL)   # its own session: only what this run started
        time.sleep(WATCH_S)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    wall = time.perf_counter() - start
    out = "".join(chunks)
    return {"wall_s": round(wall, 1), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
            "peak_anon_gib": round(peak_anon / 2**30, 2), "exit": proc.returncode, "over_limit": over,
            "tail": out.strip().splitlines()[-40:]}


WRITER = ("import json, sys; from pathlib import Path; "
          "from conformance.throughput.test_verdict_bench import write_user_draft as w; "
          "d, t, n = w(sys.argv[1], Path(sys.argv[2])); print(json.dumps([str(d), str(t), n]))")


def write_user_draft(shape: str, root: Path) -> tuple[Path, Path, int]:
    """(the draft in SGLang's format, its target config, the weight bytes)."""
    if shape == MLA:
        cfg = json.loads(PUBLISHED.read_text())
        weights = make_real_size_mla_weights(cfg, torch.Generator().manual_seed(0))
        size = sum(t.numel() * t.element_size() for t in weights.values())
        return write_mla_checkpoint(root / "draft", cfg, weights), REAL_CONFIGS / "target" / TARGETS[shape], size
    cfg = make_config(**SHAPES[shape])
    if shape == "tiny":
        weights = make_draft_weights(cfg, torch.Generator().manual_seed(0))
        target = write_target_config(TARGETS_BY_ID["llama"], root / "target") / "config.json"
    else:
        weights = make_real_size_weights(cfg, torch.Generator().manual_seed(0))
        target = REAL_CONFIGS / "target" / TARGETS[shape]
    size = sum(t.numel() * t.element_size() for t in weights.values())
    return write_draft(cfg, weights, root / "draft", "sglang"), target, size


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@pytest.mark.benchmark
@pytest.mark.parametrize("shape", ["tiny", "llama31_8b", "kimi_k25", MLA])
def test_verdict_wall_time_and_peak_rss(shape, benchmark, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)}
    # Written by a process of its own: a child forked from a process that held the weights would count
    # them in its peak RSS until it execs.
    written = subprocess.run([sys.executable, "-c", WRITER, shape, str(tmp_path)], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True).stdout
    draft, target, size = json.loads(written.strip().splitlines()[-1])
    limit = available_bytes() - HEADROOM
    imports = measured([sys.executable, "-c", IMPORTS], env)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--draft-checkpoint={draft}",
            f"--target-config={target}", f"--sglang-args={SGLANG_ARGS}{EXTRA_ARGS.get(shape, '')}",
            f"--report={tmp_path / 'report'}"]
    verdict = benchmark.pedantic(measured, args=(argv, env, limit), rounds=1, iterations=1)
    headline = next((line for line in verdict["tail"] if line.startswith("VERDICT:")), "(no verdict line)")
    figures = {"shape": shape, "weights_gib": round(size / 2**30, 2), "imports_s": imports["wall_s"],
               "imports_peak_rss_gib": imports["peak_rss_gib"], "verdict_s": verdict["wall_s"],
               "after_imports_s": round(verdict["wall_s"] - imports["wall_s"], 1),
               "verdict_peak_rss_gib": verdict["peak_rss_gib"], "verdict_peak_anon_gib": verdict["peak_anon_gib"],
               "memory_cap_gib": round(limit / 2**30, 1),
               "stopped_at_cap": verdict["over_limit"], "exit": verdict["exit"], "verdict": headline}
    benchmark.extra_info.update(figures)
    print("\n" + json.dumps(figures))
    if verdict["over_limit"] or verdict["exit"] not in (0, 1):   # no verdict was measured
        why = f"needs more than the {figures['memory_cap_gib']} GiB cap" if verdict["over_limit"] else \
            f"exit {verdict['exit']}"
        pytest.fail(f"{shape}: the verdict did not complete ({why}):\n" + "\n".join(verdict["tail"]))
