"""`eagle3-conformance`: the suite installed into your own serving environment.

    eagle3-conformance check DRAFT [--data FILE] [--hidden DIR] [--target-config FILE] [--sglang-args "..."]
                                   [--trainer NAME] [--trained-aux-layers LAYERS] [--report DIR] [-- PYTEST_ARGS]

runs exactly the checks of `make check DRAFT=...` (the root Makefile), against the implementations installed
next to it, and exits as it does: 0 served as trained, 1 not, 4 bad input, 6 not checked (no problem in
what ran, but a check needs an input not given: the verdict names it and its option; pytest uses 0-5).
The verdict names the versions that ran. First, the suite's own needs (requirements-suite.txt) and every
implementation the verdict drives must be installed, each implementation at a release inside the range its
adapter is tested against (`releases`): otherwise one line and exit 4, before any of them is imported. So is
a server --serve-with names that lives in an environment of its own which is not built (vLLM: make venv-vllm).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion

from conformance.user.commands import DEFAULT_REPORT, OPTIONS, PROG

BAD_INPUT = 4   # pytest's usage-error code, what `make check` documents for bad input
NOT_CHECKED = 6   # the verdict's "not checked" (conformance/user/verdict.py): a code pytest never uses
PACKAGE = Path(__file__).resolve().parent
# The repository's pytest.ini, shipped inside the package (a link in the repository, a copy in the wheel):
# markers, strict xfails, addopts. Not named pytest.ini, or pytest would take it as the configuration of
# every run under conformance/ in the repository.
INI = PACKAGE / "suite-pytest.ini"

# The implementations checked for here: those of the default lane, imported in this environment. An adapter
# with a lane of its own (its own environment, e.g. the vLLM lane's) is not looked for.
DEFAULT_LANE = "cpu"
# What the run imports of the suite's own needs (requirements-suite.txt), looked for before it starts.
SUITE_MODULES = ("pytest", "pytest_benchmark", "hypothesis", "matplotlib")
SUITE_NEEDS = ("pip install --no-deps -r requirements-suite.txt, "
               "docs/your-draft.md \"Install into your serving environment\"")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # A usage error is bad input: exit 4, as `make check` without DRAFT (argparse's own code is 2).
        self.print_usage(sys.stderr)
        self.exit(BAD_INPUT, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog=PROG, description="The suite installed into your own serving environment.")
    commands = top.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="one verdict on your draft: will your SGLang serve it as trained?",
                                description="The checks of `make check` on your draft, against the implementations "
                                            "installed here. Exit 0 served as trained, 1 not, 4 bad input, 6 not "
                                            "checked (a check needs an input not given; the verdict names "
                                            "the option).",
                                epilog="Arguments after `--` go to pytest as they are. An implementation that is "
                                       "missing, or outside the releases the suite is tested against, is one line "
                                       "and exit 4.")
    check.add_argument("draft", metavar="DRAFT", help="the draft's directory (config.json and weights)")
    for flag, _, metavar, help_text in OPTIONS:
        check.add_argument(flag, metavar=metavar, default=None, help=help_text)
    check.add_argument("--report", metavar="DIR", default=DEFAULT_REPORT,
                       help=f"where report.md / report.json go (default: ./{DEFAULT_REPORT})")
    return top


def joined(argv: list[str]) -> list[str]:
    """`--flag VALUE` as `--flag=VALUE` for check's options: every one takes one value, and one that starts with
    dashes (`--sglang-args "--speculative-eagle-topk 1"`) would otherwise be taken for an option by argparse."""
    flags = {flag for flag, *_ in OPTIONS} | {"--report"}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def pytest_args(args: argparse.Namespace, extra: list[str] = ()) -> list[str]:
    """The arguments of `make check`'s pytest command for these options, then `extra` (what followed `--`)."""
    out = ["-q", f"--draft-checkpoint={args.draft}"]
    for flag, option, _, _ in OPTIONS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value:
            out.append(f"{option}={value}")
    out.append(f"--report={args.report}")
    return out + list(extra)


def suite_args() -> list[str]:
    """Where the checks are: the package's own test files, configuration and plugin, wherever it is installed.
    The root is the directory holding the package, so test ids read as in the repository; pytest.ini's
    `pythonpath = .` is emptied (it would put the package directory itself on sys.path); conftest files
    are looked for inside the package only."""
    return ["-c", str(INI), f"--rootdir={PACKAGE.parent}", f"--confcutdir={PACKAGE}", "-o", "pythonpath=",
            "-p", "conformance.plugin", str(PACKAGE)]


def refusal(serve_with: str | None = None) -> str | None:
    """One line when a need of the suite is missing, an implementation of the default lane is missing or
    outside its adapter's releases, or a server `serve_with` names cannot run here; else None."""
    missing = [name for name in SUITE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        return f"{PROG}: the suite's own needs are not installed: {', '.join(missing)} ({SUITE_NEEDS})"
    from conformance.adapters import ADAPTERS
    from conformance.adapters.base import supported_range

    for adapter in ADAPTERS.values():
        if adapter.package is None or adapter.lane != DEFAULT_LANE:
            continue
        version = adapter.version()
        tested = ", ".join(adapter.releases)
        if version is None:
            return (f"{PROG}: {adapter.package} is not installed in this environment ({sys.executable}); "
                    f"the suite checks the {adapter.package} installed next to it (tested releases: {tested})")
        spec = supported_range(adapter)
        try:
            inside = not spec or SpecifierSet(spec).contains(version, prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            return (f"{PROG}: {adapter.package} {version} is outside the supported releases {spec} "
                    f"(tested: {tested}; the version matrix, docs/releases.md)")
    if serve_with:
        from conformance.user.serving import unavailable

        why = unavailable(serve_with)
        return f"{PROG}: {why}" if why else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # After `--`: further pytest arguments, passed as they are.
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser().parse_args(joined(argv[:cut])), argv[cut + 1:]
    refused = refusal(args.serve_with)
    if refused:
        print(refused, file=sys.stderr)
        return BAD_INPUT
    import pytest

    return int(pytest.main(pytest_args(args, extra) + suite_args()))


if __name__ == "__main__":
    sys.exit(main())
