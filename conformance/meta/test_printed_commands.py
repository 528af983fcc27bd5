"""Every command a user run prints does what it says, pasted from another working directory.

Planted verdict cases of conformance/meta/test_verdict.py whose fix is a command: a speculators-format directory
(SGLang cannot read it: this suite's converter) and the seed's server flags (16 draft tokens served as 2: a
chain of 15). Each runs as a user runs it (`pytest --draft-checkpoint=...` from the repository root); then, from
a directory of its own, the commands under the verdict's "fix ... and check again" run as printed: the fixes
exit 0 and the check of the fixed draft no longer names the problems they fix; the `repro:` line of the failed
check fails again with the same problem. The seed's wiring (the converter writing the ids Kimi-K2.5 needs, exit 1
to exit 0) is the README's own example: conformance/meta/test_readme_commands.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.core import registry
from conformance.core.findings import CONVERT, SETTINGS, WIRING, Problem
from conformance.meta.test_verdict import CASES, ROOT, run_pytest, write_eagle_ids
from conformance.user.commands import fix_commands as fix_commands_of
from conformance.user.example_draft import write_example
from conformance.user.verdict import EXIT_NOT_CHECKED, EXIT_NOT_SERVED, EXIT_SERVED

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
FIXABLE = ("speculators_format", "seed_flags")
FIXES = re.compile(r"^fix (?P<numbers>[\d, ]+) and check again \(paste from any directory\):$", re.M)
PROBLEM = re.compile(r"^(\d+)\. (.+)$", re.M)
REPRO = re.compile(r"^  repro: (.+)$", re.M)
FAILED = re.compile(r"^(.+) \(in the verdict below\)$", re.M)


def verdict(stdout: str) -> str:
    return stdout[stdout.index("VERDICT: "):] if "VERDICT: " in stdout else ""


def fix_commands(stdout: str) -> tuple[list[int], list[str]]:
    """(the problems the printed commands fix, the commands) of a verdict."""
    block = verdict(stdout)
    m = FIXES.search(block)
    assert m, f"no fix commands in the verdict:\n{block}"
    commands = []
    for line in block[m.end():].splitlines()[1:]:
        if not line.startswith("  "):
            break
        commands.append(line.strip())
    return [int(n) for n in m["numbers"].split(", ")], commands


def problems(stdout: str) -> dict[int, str]:
    return {int(n): what for n, what in PROBLEM.findall(verdict(stdout))}


def pasted(command: str, where: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """A printed command, run by the shell from `where` (this checkout's package first on the path, as the
    installed package is)."""
    where.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, shell=True, cwd=where, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", params=FIXABLE)
def user_run(request, tmp_path_factory):
    """(the case, its run from the repository root, a directory of its own to paste into)."""
    case = next(c for c in CASES if c.id == request.param)
    root = tmp_path_factory.mktemp(case.id)
    draft, _, _ = write_example(root / "inputs", case.fmt, plant=case.plant, knobs=dict(case.knobs))
    if case.eagle_ids is not None:
        write_eagle_ids(draft, case.eagle_ids)
    result = run_pytest(f"--draft-checkpoint={draft}", *case.args, f"--report={root / 'report'}")
    assert result.returncode == EXIT_NOT_SERVED, f"exit {result.returncode}:\n{(result.stdout + result.stderr)[-6000:]}"
    return case, result, root / "elsewhere"


def test_the_printed_fixes_fix_what_they_name(user_run):
    case, result, elsewhere = user_run
    fixed, commands = fix_commands(result.stdout)
    named = problems(result.stdout)
    assert fixed and set(fixed) <= set(named), (fixed, named)
    *fixes, check = commands
    assert check.split()[1:2] == ["check"] or " -m conformance.cli check " in check, check
    for command in fixes:
        done = pasted(command, elsewhere)
        assert done.returncode == 0, f"{command}\nexit {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    again = pasted(check, elsewhere)
    out = again.stdout + again.stderr
    assert again.returncode in (EXIT_SERVED, EXIT_NOT_CHECKED), f"{check}\nexit {again.returncode}:\n{out[-6000:]}"
    left = problems(again.stdout).values()
    assert not {named[n] for n in fixed} & set(left), f"{check}: still {left}"


def test_the_repro_line_fails_again_with_the_same_problem(user_run):
    case, result, elsewhere = user_run
    repro = REPRO.findall(result.stdout)
    failed = FAILED.findall(result.stdout)
    assert repro and len(repro) == len(failed), result.stdout[-6000:]
    # the user's own check, not a test id that would check a built-in draft
    assert all(value.split("=", 1)[1] in repro[0] for value in case.args) and " check /" in repro[0], repro[0]
    again = pasted(repro[0], elsewhere)
    assert again.returncode == EXIT_NOT_SERVED, f"{repro[0]}\nexit {again.returncode}:\n{again.stdout[-6000:]}"
    assert failed[0] in problems(again.stdout).values(), (failed[0], verdict(again.stdout))


def test_the_terminal_is_the_verdict_without_noise(user_run):
    """No captured output or library logs, no warnings summary, none of the suite's own file paths or registry
    ids, no tolerance formula: the verdict is the last thing printed."""
    case, result, _ = user_run
    out = result.stdout
    for noise in ("Captured", "DEBUG", "warnings summary", "short test summary", "conformance/user/test_",
                  "allowed: atol", "per implementation pair and stage"):
        assert noise not in out, f"{noise!r} in the terminal:\n{out}"
    for known in REGISTRY_IDS:
        assert known not in out, f"registry id {known!r} in the terminal:\n{out}"
    assert out.rstrip().splitlines()[-1].startswith("  ") and verdict(out).count("\n") > 8, out[-3000:]
    assert len(out.splitlines()) < 100, f"{len(out.splitlines())} lines:\n{out}"


# ---------------------------------------------------------------- the parts, in process

REGISTRY_IDS = [entry.id for entry in registry.REGISTRY]


def test_a_problem_is_shown_without_its_registry_id_and_with_package_paths():
    p = Problem("sglang 0.5.23 departs at `x` (sglang-residual-never-normed)", "where", "evidence",
                "SGLang adds it (llama_eagle3.py:97-99); the registry's sglang-residual-never-normed: speculators "
                "norms it (speculators models/eagle3/model_definitions.py:80-81); no_such_file.py:3", "fix",
                known="sglang-residual-never-normed", impl="sglang")
    shown = p.to_json(1)
    assert shown["what"] == "sglang 0.5.23 departs at `x`" and shown["registry_id"] == "sglang-residual-never-normed"
    assert shown["cause"] == ("SGLang adds it (sglang/srt/models/llama_eagle3.py:97-99); speculators norms it "
                              "(speculators/models/eagle3/model_definitions.py:80-81); no_such_file.py:3"), shown


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
