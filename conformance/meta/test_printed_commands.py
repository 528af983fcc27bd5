"""The parts of the commands a user run prints, in process: a problem's shown form, the fix commands built from the
run's options, an existing report directory that is no test path. The commands themselves, printed by real runs
and run from another directory, are conformance/meta/test_verdict.py's (every planted case that exits 1); the
seed's wiring fix, exit 1 to exit 0, is the README's own example (conformance/meta/test_readme_commands.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conformance.core.findings import CONVERT, SETTINGS, WIRING, Problem
from conformance.meta.test_verdict import ROOT
from conformance.user.commands import fix_commands as fix_commands_of
from conformance.user.example_draft import write_example

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


# ---------------------------------------------------------------- the parts, in process



def test_a_problem_is_shown_without_its_registry_id_and_with_package_paths():
    p = Problem("sglang 0.5.23 departs at `x` (sglang-residual-never-normed)", "where", "evidence",
                "SGLang adds it (llama_eagle3.py:97-99); the registry's sglang-residual-never-normed: speculators "
                "norms it (speculators models/eagle3/model_definitions.py:80-81); no_such_file.py:3", "fix",
                known="sglang-residual-never-normed", impl="sglang")
    shown = p.to_json(1)
    assert shown["what"] == "sglang 0.5.23 departs at `x`" and shown["registry_id"] == "sglang-residual-never-normed"
    assert shown["cause"] == ("SGLang adds it (sglang/srt/models/llama_eagle3.py:97-99); speculators norms it "
                              "(speculators/models/eagle3/model_definitions.py:80-81); no_such_file.py:3"), shown
    # a reading problem cites each implementation's entry: none of their ids is shown either
    other = Problem("w", "x", "e", "speculators (speculators-never-ties-reads-stored-head): its head", "f",
                    known="sglang-ties-lm-head-to-embedding")
    assert other.to_json(1)["cause"] == "speculators: its head", other.to_json(1)


def test_the_fix_commands_convert_then_check_with_the_fixed_flags():
    options = {"DRAFT": "/d/draft", "--target-config": "/d/t.json", "--sglang-args": "--a 1 --speculative-num-steps=1",
               "--trained-aux-layers": "embed,3,31", "--report": "/d/report"}
    problems = [Problem("wiring", "", "", "", "set ids", WIRING, remedy=CONVERT),
                Problem("flags", "", "", "", "--speculative-num-steps 15 --b 2 (a chain)", SETTINGS),
                Problem("retrain", "", "", "", "retrain without it", SETTINGS)]
    fixed, (convert, check) = fix_commands_of(options, problems)
    assert fixed == [1, 2], fixed
    assert convert.endswith("-m conformance.user.convert /d/draft /d/draft-sglang --target-config=/d/t.json "
                            "--trained-aux-layers=embed,3,31"), convert
    assert " check /d/draft-sglang --target-config=/d/t.json " in check, check
    assert "--sglang-args='--a 1 --speculative-num-steps 15 --b 2'" in check and check.endswith("--report=/d/report")
    assert fix_commands_of(options, problems[2:]) == ([], [])


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_an_existing_report_directory_is_no_test_path(where, tmp_path):
    """docs/your-draft.md's `--report out/report` (spaced) once the directory exists, as on a second run: pytest
    must not take it for a path to collect (collection only: the run's configuration is what is checked)."""
    draft, _, _ = write_example(tmp_path / "inputs", "sglang")
    report = tmp_path / "out" / "report"
    report.mkdir(parents=True)
    cwd = ROOT if where == "root" else tmp_path
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--draft-checkpoint={draft}",
                          "--report", str(report.relative_to(tmp_path)) if where == "elsewhere" else str(report),
                          "--collect-only", "-q"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    ids = [line for line in ran.stdout.splitlines() if "::" in line]
    assert ran.returncode == 0 and ids and all("conformance/user/" in i for i in ids), ran.stdout + ran.stderr
