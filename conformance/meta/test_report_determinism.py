"""Same inputs, same report, byte for byte: the conformance lane run twice gives identical report.json and
report.md.

Two pytest processes run a representative, fast part of the lane (step-0 cases that pass, diverge and are
refused at load, in every dtype and implementation; multi-step cases; weight accounting with a refusal and a silent
drop) with `--report`. They differ in everything that must not matter: the hash seed (set and dict order
of strings), the temp directory the checkpoints are written to, the time, and the processes: the second
spreads the files over two pytest-xdist workers, as the Makefile runs the lanes. Run to run differences this
caught: which of two checks named speculators' refusal of a tied draft (a NaN scan of memory nothing wrote).
"""
from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
ROOT = Path(__file__).resolve().parents[2]
SELECTION = ("conformance/draft/test_step0.py", "conformance/draft/test_multistep.py",
             "conformance/loading/test_accounting.py",
             "-k", "(test_step0 and (gqa or fc_skip or norm_before_residual or mha_full_vocab)) or ms_gqa "
                   "or ms_two_layers or tied_embeddings or attention_bias")
FILES = ("report.json", "report.md")


def run_lane(out: Path, hash_seed: str, *parallel: str) -> Path:
    report = out / "report"
    out.mkdir(parents=True)   # pytest creates --basetemp itself, but not its parent
    # One torch thread in every process: the thread count decides the order of a reduction, so it is part of
    # the machine (a pytest-xdist worker of the Makefile's lanes gets cores // workers, plugin.py).
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cpu and not meta",
                           f"--basetemp={out / 'tmp'}", f"--report={report}", *parallel, *SELECTION],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, \
        f"the lane failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    return report


def test_two_runs_of_the_lane_write_identical_reports(tmp_path):
    a = run_lane(tmp_path / "a", "1")
    b = run_lane(tmp_path / "b", "2", "-n", "2", "--dist", "loadfile")
    for name in FILES:
        left, right = (a / name).read_text(), (b / name).read_text()
        diff = list(difflib.unified_diff(left.splitlines(), right.splitlines(), "run 1", "run 2", n=0, lineterm=""))
        assert not diff, f"{name} differs between two runs of the same selection:\n" + "\n".join(diff[:40])
    assert '"comparisons"' in (a / "report.json").read_text()
