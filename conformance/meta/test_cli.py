"""The installed entry point (conformance/cli.py): `eagle3-conformance check DRAFT ...` runs what `make check DRAFT=...`
runs, refuses an implementation outside its adapter's releases or missing in one line (exit 4), and finds its
configuration and plugin from any directory.

The oracle for the argument mapping is the root Makefile's own `check` recipe, printed by `make -n`: the
pytest options of both commands must be equal for the same inputs, and every option of the recipe must
have a flag on the entry point. A planted wrong mapping (two options swapped) is caught by name.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conformance import cli
from conformance.adapters import ADAPTERS
from conformance.adapters.base import supported_range

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

ROOT = Path(__file__).resolve().parents[2]
# The entry point's flag for each of `make check`'s variables (the Makefile's usage line).
MAKE_VARS = {"--data": "DATA", "--hidden": "HIDDEN", "--target-config": "TARGET", "--sglang-args": "SGLANG_ARGS",
             "--trainer": "TRAINER", "--trained-aux-layers": "TRAINED_AUX", "--serve-with": "SERVE_WITH",
             "--report": "REPORT"}
# A distinct value per option, so that two swapped options cannot match; one with spaces and dashes.
VALUES = {"--data": "in/train.jsonl", "--hidden": "in/hidden", "--target-config": "in/target.json",
          "--sglang-args": "--speculative-eagle-topk 1 --speculative-num-steps 3", "--trainer": "speculators",
          "--trained-aux-layers": "embed,3,31", "--serve-with": "both", "--report": "out/report"}
DRAFT = "in/draft"


def options(args: list[str]) -> dict[str, object]:
    """pytest's reading of an argument list: --name=value, --name value, or a bare flag (True)."""
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg.split("=", 1)
        elif arg.startswith("-") and i + 1 < len(args) and not args[i + 1].startswith("-"):
            name, value = arg, args[i + 1]
            i += 1
        else:
            name, value = arg, True
        out[name] = value
        i += 1
    return out


def make_check(**make_vars: str) -> list[str]:
    """The pytest arguments of `make check` for these variables, as make would run it."""
    argv = ["make", "-n", "-s", "-C", str(ROOT), "check", f"DRAFT={DRAFT}", *(f"{k}={v}" for k, v in make_vars.items())]
    printed = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    line = next(line for line in printed.splitlines() if " -m pytest " in line)   # the shell joins `\` lines
    words = shlex.split(line)
    return words[words.index("pytest") + 1:]


def mismatches(flags: list[str], spaced: bool = False) -> list[str]:
    """Each pytest option where `eagle3-conformance check DRAFT <flags>` and `make check` part (`--flag=VALUE`,
    or `--flag VALUE` when `spaced`)."""
    given = [[flag, VALUES[flag]] if spaced else [f"{flag}={VALUES[flag]}"] for flag in flags]
    argv = ["check", DRAFT, *(word for words in given for word in words)]
    ours = options(cli.pytest_args(cli.parser().parse_args(cli.joined(argv))))
    theirs = options(make_check(**{MAKE_VARS[flag]: VALUES[flag] for flag in flags}))
    return [f"{name}: entry point {ours.get(name)!r}, make check {theirs.get(name)!r}"
            for name in sorted(set(ours) | set(theirs)) if ours.get(name) != theirs.get(name)]


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


@needs_make
@pytest.mark.parametrize("flags, spaced", [([], False), (list(MAKE_VARS), False), (list(MAKE_VARS), True)],
                         ids=["draft-only", "every-option", "every-option-spaced"])
def test_check_passes_pytest_what_make_check_passes(flags, spaced):
    assert mismatches(flags, spaced) == []


@needs_make
def test_a_swapped_option_is_caught(monkeypatch):
    swapped = {"--data": "--hidden-states", "--hidden": "--training-data"}
    monkeypatch.setattr(cli, "OPTIONS", tuple((flag, swapped.get(flag, option), *rest)
                                              for flag, option, *rest in cli.OPTIONS))
    found = mismatches(list(MAKE_VARS))
    assert any(m.startswith("--training-data:") for m in found) and any(m.startswith("--hidden-states:")
                                                                        for m in found), found


def test_every_make_check_variable_has_a_flag():
    recipe = (ROOT / "Makefile").read_text().split("\nCHECK_OPTIONS =", 1)[1].split("\ncheck:", 1)[0]
    in_recipe = set(re.findall(r"\$\(if \$\((\w+)\),", recipe)) - {"DRAFT"} | {"REPORT"}   # DRAFT: the positional
    assert in_recipe == set(MAKE_VARS.values()), f"make check: {sorted(in_recipe)}; entry point: {MAKE_VARS}"
    assert {flag for flag, *_ in cli.OPTIONS} | {"--report"} == set(MAKE_VARS)


def test_pytest_knows_every_option_the_entry_point_passes(pytestconfig):
    for _, option, *_ in cli.OPTIONS:
        pytestconfig.getoption(option)   # ValueError: no option named ...


# ---------------------------------------------------------------- refusals

TESTED = [a for a in ADAPTERS.values() if a.package and a.releases and a.lane == cli.DEFAULT_LANE]
OWN_LANE = [a for a in ADAPTERS.values() if a.package and a.lane != cli.DEFAULT_LANE]


def pretend(monkeypatch, adapter, version: str | None) -> None:
    """The installed version of `adapter`'s package reads as `version`; every other stays as installed."""
    monkeypatch.setattr(adapter, "version", classmethod(lambda cls: version))


@pytest.mark.parametrize("adapter", TESTED, ids=lambda a: a.name)
def test_a_release_outside_the_range_is_one_line_and_exit_4(adapter, monkeypatch, capsys):
    oldest, newest = min(adapter.releases, key=Version), max(adapter.releases, key=Version)
    below = f"{Version(oldest).major}.{Version(oldest).minor}.{Version(oldest).micro}.dev0"   # before the oldest
    above = f"{newest}.post1"                                                                    # after the newest
    for version in (below, above):
        pretend(monkeypatch, adapter, version)
        assert cli.main(["check", "no-such-draft"]) == cli.BAD_INPUT
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(f"eagle3-conformance: {adapter.package} {version} is outside the supported releases "
                              f"{supported_range(adapter)} ("), err
    for version in (oldest, newest):   # the range holds every release under test
        pretend(monkeypatch, adapter, version)
        assert cli.refusal() is None, version


@pytest.mark.parametrize("adapter", TESTED, ids=lambda a: a.name)
def test_a_missing_implementation_is_one_line_and_exit_4(adapter, monkeypatch, capsys):
    pretend(monkeypatch, adapter, None)
    assert cli.main(["check", "no-such-draft"]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"eagle3-conformance: {adapter.package} is not installed"), err


@pytest.mark.parametrize("adapter", OWN_LANE, ids=lambda a: a.name)
def test_an_implementation_of_another_lane_is_not_looked_for(adapter, monkeypatch):
    pretend(monkeypatch, adapter, None)   # its own environment is not the user's
    assert cli.refusal() is None


def test_a_missing_need_of_the_suite_is_one_line_and_exit_4(monkeypatch, capsys):
    monkeypatch.setattr(cli, "SUITE_MODULES", (*cli.SUITE_MODULES, "no_such_module_of_the_suite"))
    assert cli.main(["check", "no-such-draft"]) == cli.BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not installed: no_such_module_of_the_suite (pip install --no-deps -r" in err, err


def test_a_usage_error_is_exit_4(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check"])
    assert exit_.value.code == cli.BAD_INPUT and "DRAFT" in capsys.readouterr().err


# ---------------------------------------------------------------- the run itself

def test_from_another_directory_bad_input_is_exit_4_naming_the_file(tmp_path):
    """The configuration, markers and plugin come from the package, not from the current directory: run from
    an empty directory, a draft directory without config.json is the one-line bad input of `make check`."""
    draft = tmp_path / "draft"
    draft.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "conformance.cli", "check", "draft", "--report", "out"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert result.returncode == cli.BAD_INPUT, "\n".join(lines[-30:])
    assert any("config.json" in line and "ERROR" in line for line in lines), "\n".join(lines[-30:])
    assert list(draft.iterdir()) == []   # nothing written into the user's directory


# ---------------------------------------------------------------- what gets installed, and CI

def pins(path: Path) -> dict[str, str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return {canonicalize_name(n): v for n, _, v in (line.partition("==") for line in lines if line and line[0] != "#")}


def test_the_suite_needs_are_pinned_as_in_the_lock():
    suite, lock = pins(ROOT / "requirements-suite.txt"), pins(ROOT / "requirements.lock")
    assert {n: (v, lock.get(n)) for n, v in suite.items() if lock.get(n) != v} == {}
    # A serving environment holds these already: the checks are about the ones it has.
    assert not {"torch", "sglang", "speculators"} & set(suite)


def test_the_suite_needs_are_what_a_serving_environment_lacks():
    """requirements-suite.txt is the lock less what torch, sglang and speculators bring (their declared
    dependencies, walked in this environment's metadata) and less the Makefile's DEV_TOOLS (ruff, ...)."""
    lock, suite = pins(ROOT / "requirements.lock"), pins(ROOT / "requirements-suite.txt")
    seen, todo = set(), [(name, frozenset()) for name in ("torch", "sglang", "speculators")]
    while todo:   # (distribution, the extras asked of it: torch asks cuda-toolkit for its NVIDIA libraries)
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) in lock and (requirement.marker is None or any(
                    requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras))):
                todo.append((requirement.name, frozenset(requirement.extras)))
    brought = {name for name, _ in seen}
    tools = re.search(r"^DEV_TOOLS = (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split("|")
    assert set(suite) == set(lock) - brought - {canonicalize_name(t) for t in tools}


def test_every_data_file_of_the_packages_is_in_the_wheel():
    """pyproject.toml's package-data globs cover every file besides the modules that the packages hold (the
    registry, the pytest configuration, the real configs): a new data file no glob takes fails here."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]
    roots = [ROOT / p.rstrip("*") for p in config["packages"]["find"]["include"]]
    packages = [d for r in roots for d in [r, *r.rglob("*")] if (d / "__init__.py").is_file()]
    shipped = {f for d in packages for key in ("*", d.relative_to(ROOT).as_posix().replace("/", "."))
               for pattern in patterns.get(key, ()) for f in d.glob(pattern)}
    data = {f for r in roots for f in r.rglob("*") if f.is_file() and f.suffix not in (".py", ".pyc")
            and "__pycache__" not in f.parts}
    missing = sorted(str(f.relative_to(ROOT)) for f in data - shipped)
    assert data and not missing, f"no package-data glob in pyproject.toml takes {missing}"
    assert cli.INI in shipped and cli.INI.read_text() == (ROOT / "pytest.ini").read_text()


def test_the_modules_looked_for_are_the_suite_needs():
    from importlib.metadata import packages_distributions

    listed = set(pins(ROOT / "requirements-suite.txt"))
    for module in cli.SUITE_MODULES:
        assert {canonicalize_name(d) for d in packages_distributions()[module]} & listed, module


def test_ci_runs_every_release_under_test_and_the_user_environment():
    jobs = yaml.safe_load((ROOT / ".github" / "workflows" / "conformance.yml").read_text())["jobs"]
    pinned = pins(ROOT / "requirements.lock")
    expected = {f"{a.package}=={v}" for a in TESTED for v in a.releases
                if v != pinned.get(canonicalize_name(a.package))}   # the cpu job gates the pinned ones
    assert set(jobs["releases"]["strategy"]["matrix"]["release"]) == expected
    runs = {job: " ".join(step.get("run", "") for step in spec["steps"]) for job, spec in jobs.items()}
    assert "make version-lane RELEASE=${{ matrix.release }}" in runs["releases"]
    assert "make user-env-check" in runs["user-env"] and "make vllm" in runs["vllm"]


@needs_make
def test_make_check_names_the_code_on_its_last_line(tmp_path):
    """Bad input: make's status is 2, its recipe's last line names the verdict's code; the command it echoes is
    one line, with only the options given."""
    argv = ["make", "-C", str(ROOT), "-o", f"{sys.prefix}/.installed", "check", f"DRAFT={tmp_path / 'none'}",
            f"VENV={sys.prefix}", f"REPORT={tmp_path / 'report'}", "TRAINED_AUX=embed,3,31"]
    ran = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    lines = [line for line in ran.stdout.splitlines() if not line.startswith("make")]
    assert ran.returncode == 2 and lines[-1] == f"verdict: exit {cli.BAD_INPUT} (bad input)", ran.stdout + ran.stderr
    assert lines[0].endswith(f'-m pytest -q --draft-checkpoint="{tmp_path / "none"}" '
                             f'--trained-aux-layers=embed,3,31 --report="{tmp_path / "report"}"'), lines
