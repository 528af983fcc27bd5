"""Real draft sizes on CPU: the Llama-3.1-8B and Kimi-K2.5 EAGLE-3 draft shapes (fixtures/real_shapes.py)
run step 0 in bf16 through every implementation against the reference, within 16 GB of RAM.

A benchmark, not part of `pytest -m cpu`: `pytest -m benchmark -k real_size` (minutes; several GB of
disk for the seeded weights). Each shape runs in its own process (conformance/draft/real_size.py) so its
peak RSS is its own; time and peak memory go to the benchmark's extra_info and the report. The test
fails only when an implementation diverges, never on time or memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.core.sections import Section

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ("llama31_8b", "kimi_k25")
RAM_BUDGET_GIB = 16   # reported against, not asserted: the figure is what matters


def run_shape(shape: str, workdir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "conformance.draft.real_size", shape, str(workdir)]
    result = subprocess.run(command, cwd=ROOT, env=env,
                            capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0 and lines, f"{shape} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.benchmark
@pytest.mark.parametrize("shape", SHAPES)
def test_real_size_step0_on_cpu(shape, benchmark, report, tmp_path):
    out = benchmark.pedantic(run_shape, args=(shape, tmp_path), rounds=1, iterations=1)
    benchmark.extra_info.update({k: out[k] for k in ("parameters", "peak_rss_gib", "total_seconds", "seconds")})
    report.add_row(Section.REAL_SIZE, {
        "shape": shape, "parameters": out["parameters"], "tokens": out["tokens"],
        "seconds": out["total_seconds"], "peak RSS GiB": out["peak_rss_gib"], "budget GiB": RAM_BUDGET_GIB,
        "phases (s)": ", ".join(f"{k} {v}" for k, v in out["seconds"].items()),
        "result": "; ".join(f"{c['impl']}: " + _first(c)
                            for c in out["comparisons"])})
    failures = [c["message"] for c in out["comparisons"] if c["first_divergence"] is not None]
    assert not failures, "\n".join(failures)


def _first(comparison: dict) -> str:
    first = comparison["first_divergence"]
    return "conforms" if first is None else f"step {first['step']} {first['stage']}"
