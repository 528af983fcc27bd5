"""Self-test of the benchmark gate: `make bench-compare` fails on a planted 2x slowdown in one adapter.

Runs the real make targets on a few tiny figures into a temporary baselines folder: record a
baseline, compare unchanged (passes), compare with EAGLE3_BENCH_SLOWDOWN=sglang=2 (every timed
SGLang pass runs twice; fails naming SGLang's figures), compare with no baseline (a one-line error).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.throughput.throughput import SLOWDOWN_ENV, host_device, machine_class

pytestmark = [pytest.mark.benchmark, pytest.mark.meta]

ROOT = Path(__file__).resolve().parents[2]
SELECT = "cpu-mid-fp32-b1-l128"   # 6 figures: 3 adapters x (extend, decode), compute-bound, ~0.1 s each
THREADS = 1                       # the make targets' default BENCH_THREADS: part of the machine class


def run_make(target: str, baselines: Path, **env) -> subprocess.CompletedProcess:
    venv = Path(sys.prefix)
    # -o: never (re)install the environment from inside a test; this interpreter's venv is the one.
    cmd = ["make", "-s", "-o", f"{venv}/.installed", target, f"VENV={venv}", f"BENCH_BASELINES={baselines}",
           f"BENCH_SELECT={SELECT}", "BENCH_MARK=benchmark and not gpu"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, SLOWDOWN_ENV: "", **env})


def regressed(output: str) -> list[str]:
    """The figures pytest-benchmark lists under 'Performance has regressed'."""
    return re.findall(r"^\s*(test_\w+\[[^\]]+\])[^\n]* - Field '\w+' has failed", output, re.M)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("baselines")
    done = run_make("bench-baseline", root)
    assert done.returncode == 0, f"make bench-baseline failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return root


def test_baseline_is_stored_per_machine_class_without_host_name(baselines):
    saved = sorted(baselines.glob("*/*/0001_baseline.json"))
    assert [p.parents[1].name for p in saved] == [machine_class(host_device(), THREADS)], f"stored: {saved}"
    data = json.loads(saved[0].read_text())
    assert "node" not in data["machine_info"], "the host name must not be stored in a baseline"
    names = sorted(b["name"] for b in data["benchmarks"])
    assert len(names) == 6 and all(SELECT in n for n in names), names
    assert all(b["extra_info"]["unit"] == "callable time / roofline time" for b in data["benchmarks"])


def test_compare_passes_unchanged(baselines):
    done = run_make("bench-compare", baselines)
    assert done.returncode == 0, (f"unchanged code regressed against its own baseline (machine too noisy?): "
                                  f"{regressed(done.stdout + done.stderr)}\n{done.stdout[-3000:]}")


def test_compare_fails_on_planted_2x_slowdown(baselines):
    done = run_make("bench-compare", baselines, **{SLOWDOWN_ENV: "sglang=2"})
    output = done.stdout + done.stderr
    assert done.returncode != 0, f"a planted 2x SGLang slowdown passed the gate:\n{done.stdout[-3000:]}"
    flagged = regressed(output)
    sglang = [n for n in flagged if n.endswith("-sglang]")]
    assert len(sglang) == 2, f"expected both SGLang figures (extend, decode) flagged, got {flagged}\n{output[-3000:]}"


def test_compare_without_baseline_is_a_one_line_error(tmp_path):
    done = run_make("bench-compare", tmp_path)
    assert done.returncode != 0
    assert f"no baseline for machine class '{machine_class(host_device(), THREADS)}'" in done.stdout + done.stderr
