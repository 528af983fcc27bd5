"""One verdict on the user's draft: served as trained, not served and why, or not fully checked, as data.

Three outcomes, each with its exit code (the README's, `make check`'s and `eagle3-conformance check`'s):
    0  served as trained: every check the inputs allow ran and passed, and nothing asked for was skipped
    1  NOT served as trained: the problems, numbered (a problem found always wins over an incomplete run)
    4  bad input: one line naming the file and the field (pytest's usage error; also a --serve-with server
       that cannot run here)
    6  not checked: no problem in what ran, but a check could not run for lack of an input; the headline
       names each one and the option that enables it (`not checked: target wiring (give --target-config)`).
       pytest itself uses 0-5, so 6 never means anything of pytest's.

Every user check that finds something adds a Problem (what, where, evidence, cause, fix) to the
session's Verdict; the same cause seen by several checks (dtypes, step counts, the load and the
forward) is one problem. A failed user check that added none still counts, as its own problem, so the
verdict is never "served as trained" while a check failed. Checks of other areas (wiring, server
flags) add theirs the same way, through the `verdict` fixture.

VerdictPlugin holds the pytest side: the focused run (with --draft-checkpoint, unless --with-matrix, only
the checks marked `user` in conformance/user/ are collected and run, and of the servers only those
--serve-with names), the exit code (the outcome's, above, unless pytest's own is already not 0), the
verdict block in the terminal summary, and the "verdict" object of report.json / report.md.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conformance.core.findings import FORWARD, LOADING, OTHER, READING, Problem, cited
from conformance.core.registry import REGISTRY

SERVED, NOT_SERVED, NOT_CHECKED = "served as trained", "NOT served as trained", "not checked"
EXIT_SERVED, EXIT_NOT_SERVED, EXIT_BAD_INPUT, EXIT_NOT_CHECKED = 0, 1, 4, 6
# A user check skipped for lack of an input says so in these words (not_checked); one skipped because there is
# nothing to check says NOT_APPLICABLE (not_applicable). Any other skip of a user check leaves the run
# incomplete too: the verdict never counts a check that did not run as passed.
_NOT_CHECKED = re.compile(r"^not checked: (?P<area>.+) \(give (?P<option>--[\w-]+)\)$")
NOT_APPLICABLE = "not applicable: "
USER_MARK = "user"
REGISTRY_IDS = frozenset(entry.id for entry in REGISTRY)   # never shown to the user (Problem.to_json)
USER_DIR = Path(__file__).resolve().parent   # the focused run collects only test files here


class Verdict:
    def __init__(self):
        self.problems: dict[str, Problem] = {}
        self.failed: dict[str, str] = {}      # failed user check -> its first line
        self.outcomes: dict[str, str] = {}    # user check -> passed | failed | skipped
        self.context: dict[str, str] = {}     # what was judged: draft, format, trainer, served as
        self.unchecked: dict[str, str] = {}   # what did not run -> how to make it run (or why it did not)
        self.not_run: dict[str, str] = {}     # a check with nothing to check on these inputs -> why
        self.printed = False                  # the verdict block ends the terminal: a failure need not repeat it

    def add(self, problem: Problem, nodeid: str = "") -> Problem:
        """Record a problem (merged into an earlier one with the same key); returns the one kept."""
        key = problem.key or f"{problem.rank}:{problem.what}"
        kept = self.problems.setdefault(key, problem)
        if kept is not problem and problem.seen and problem.seen not in (kept.seen, *kept.also):
            kept.also.append(problem.seen)
        if nodeid and nodeid not in kept.checks:
            kept.checks.append(nodeid)
        return kept

    def covered(self, nodeid: str) -> bool:
        return any(nodeid in p.checks for p in self.problems.values())

    def finish(self) -> None:
        """An unregistered finding of an implementation that reads the file otherwise than training is folded
        into that reading problem (its reading is the first suspect), and an unregistered divergence of one that
        did not load the checkpoint as written into that loading problem (the tensor it did not load); a failed
        check that named no problem becomes one, with its own first line as evidence."""
        for key, p in list(self.problems.items()):
            if p.known or not p.impl or p.rank not in (LOADING, FORWARD):
                continue
            into = next((q for q in self.ordered() if q.impl == p.impl and q is not p
                         and (q.rank == READING or (q.rank == LOADING and p.rank == FORWARD))), None)
            if into is not None:
                then = "the forward departs at" if p.rank == FORWARD else "its loading:"
                into.evidence += f"; then {then} {p.where}: {p.evidence}"
                into.checks += [c for c in p.checks if c not in into.checks]
                del self.problems[key]
        for nodeid, line in self.failed.items():
            if not self.covered(nodeid):
                self.add(Problem(f"check failed: {nodeid.rsplit('::', 1)[-1]}", nodeid, line,
                                 "not classified: see the failure above", "none known", rank=OTHER,
                                 key=f"failed:{nodeid}"), nodeid)

    def ordered(self) -> list[Problem]:
        return sorted(self.problems.values(), key=lambda p: p.rank)   # stable: insertion order within a rank

    def skipped(self, nodeid: str, reason: str) -> None:
        """A user check that did not run: fine when there was nothing to check; else what was not checked."""
        if reason.startswith(NOT_APPLICABLE):
            self.not_run.setdefault(check_name(nodeid), reason.removeprefix(NOT_APPLICABLE))
            return
        m = _NOT_CHECKED.match(reason)
        if m:
            self.unchecked.setdefault(m["area"], f"give {m['option']}")
        else:   # a skip no check explained: that check, in its own words
            self.unchecked.setdefault(check_name(nodeid), reason)

    @property
    def found_problems(self) -> bool:
        return bool(self.problems or self.failed)

    @property
    def served(self) -> bool:
        return not self.found_problems and not self.unchecked

    @property
    def outcome(self) -> str:
        return NOT_SERVED if self.found_problems else NOT_CHECKED if self.unchecked else SERVED

    @property
    def exit_code(self) -> int:
        return {SERVED: EXIT_SERVED, NOT_SERVED: EXIT_NOT_SERVED, NOT_CHECKED: EXIT_NOT_CHECKED}[self.outcome]

    def not_checked_line(self) -> str:
        return ", ".join(f"{area} ({how})" for area, how in self.unchecked.items())

    def headline(self) -> str:
        if self.outcome == NOT_SERVED:
            n = len(self.problems) or len(self.failed)
            return f"{NOT_SERVED}: {n} problem{'s' if n != 1 else ''}"
        if self.outcome == NOT_CHECKED:
            return f"{NOT_CHECKED}: {self.not_checked_line()}; what ran is {SERVED}"
        return SERVED

    def to_json(self, versions: dict[str, str]) -> dict:
        checks = {o: sum(v == o for v in self.outcomes.values()) for o in ("passed", "failed", "skipped")}
        return {"served_as_trained": self.served, "outcome": self.outcome, "exit_code": self.exit_code,
                "headline": self.headline(), **{k: cited(v) for k, v in self.context.items()}, "checks": checks,
                "not_checked": [{"what": area, "how": how} for area, how in self.unchecked.items()],
                "not_run": [{"what": check, "why": why} for check, why in self.not_run.items()],
                "versions": versions, "problems": [p.to_json(n, REGISTRY_IDS) for n, p in enumerate(self.ordered(), 1)]}


def check_name(nodeid: str) -> str:
    """A user check in words: `test_user_draft_hidden_states_fit_the_target` is "hidden states fit the target"."""
    name = nodeid.rsplit("::", 1)[-1]
    function, _, params = name.partition("[")
    words = function.removeprefix("test_user_draft_").removeprefix("test_").replace("_", " ")
    return f"{words} [{params}" if params else words


def not_checked(area: str, option: str):
    """Skip a user check that needs an input the user did not give: the verdict names it and the option."""
    __tracebackhide__ = True
    pytest.skip(f"not checked: {area} (give {option})")


def not_applicable(why: str):
    """Skip a user check that has nothing to check on these inputs (no conversion, no dump): not a gap."""
    __tracebackhide__ = True
    pytest.skip(NOT_APPLICABLE + why)


# ---------------------------------------------------------------- pytest side

VERDICT_KEY = pytest.StashKey[Verdict]()


def focused(config) -> bool:
    return bool(config.getoption("--draft-checkpoint")) and not config.getoption("--with-matrix")


class VerdictPlugin:
    """Registered by conformance/plugin.py's pytest_configure; `report` is the session's Report."""

    def __init__(self, config, report):
        self.config, self.report = config, report
        self.verdict = config.stash.setdefault(VERDICT_KEY, Verdict())
        self.verdict.printed = bool(config.getoption("--draft-checkpoint"))
        if self.verdict.printed:
            quiet(config)

    @pytest.hookimpl(tryfirst=True)
    def pytest_ignore_collect(self, collection_path: Path, config):
        # The focused run does not even import the built-in matrix's test modules.
        if focused(config) and collection_path.suffix == ".py" and collection_path.name.startswith("test_") \
                and USER_DIR not in collection_path.resolve().parents:
            return True
        return None

    def pytest_collection_modifyitems(self, config, items):
        if not focused(config):
            return
        from conformance.user.serving import served_with, servers

        # A server --serve-with does not name is not asked for: not run, and not a gap in the verdict either.
        unasked = set(servers()) - set(served_with(config))

        def wanted(item) -> bool:
            params = item.callspec.params if hasattr(item, "callspec") else {}
            return bool(item.get_closest_marker(USER_MARK)) and params.get("impl") not in unasked

        keep = [item for item in items if wanted(item)]
        dropped = [item for item in items if not wanted(item)]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep

    def pytest_runtest_logreport(self, report):
        if USER_MARK not in report.keywords:
            return
        if report.failed:
            self.verdict.failed.setdefault(report.nodeid, _first_line(report.longreprtext))
        if report.when == "call" or not report.passed:   # a check's outcome: its call, or what stopped it
            self.verdict.outcomes[report.nodeid] = "failed" if report.failed else report.outcome
        if report.skipped:
            self.verdict.skipped(report.nodeid, _skip_reason(report))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if not self.config.getoption("--draft-checkpoint") or not self.verdict.outcomes:
            return   # no verdict when no user check ran (--collect-only, a -k that selects none)
        from conformance.adapters import versions
        from conformance.user.commands import fix_commands, user_options

        self.verdict.finish()
        self.report.verdict = self.verdict.to_json(versions())
        fixed, commands = fix_commands(user_options(self.config), self.verdict.ordered())
        if commands:
            self.report.verdict["fixes"] = {"problems": fixed, "commands": commands}
        if session.exitstatus == 0:
            # A problem no check raised as a failure still fails the run; a check that did not run keeps it
            # from passing (an interrupted or broken run keeps pytest's own code).
            session.exitstatus = self.verdict.exit_code

    # pytest registers only methods named pytest_*: this one is a second pytest_sessionfinish by its specname.
    @pytest.hookimpl(wrapper=True, tryfirst=True, specname="pytest_sessionfinish")
    def pytest_sessionfinish_printed(self):
        """Around the terminal reporter's own: the verdict after pytest's last line, the last thing printed."""
        from conformance.session.report_render import verdict_lines

        result = yield
        data = getattr(self.report, "verdict", None)
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if data and terminal is not None:
            terminal.section("eagle3 conformance: your draft", bold=True, red=data["outcome"] == NOT_SERVED,
                             yellow=data["outcome"] == NOT_CHECKED, green=data["served_as_trained"])
            for line in verdict_lines(data):
                terminal.write_line(line)
        return result


def quiet(config) -> None:
    """A user run's terminal: the verdict is the answer, and pytest's extras around it are noise to the user, or
    the suite's own file paths: no captured output or logs under a failure (the libraries' DEBUG lines), no
    warnings summary, no short test summary (the verdict says what did not run, and why), no header or test file
    names unless -v asks for them (pytest's -q)."""
    if config.option.verbose == 0:
        config.option.verbose = -1
    config.option.showcapture = "no"
    config.option.disable_warnings = True
    config.option.reportchars = "N"
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    if terminal is not None:   # already built from the options above
        terminal.reportchars = ""


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def _first_line(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("E "):
            return line[2:].strip()
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
