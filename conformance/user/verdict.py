"""One verdict on the user's draft: served as trained, or not and why, as data.

Every user check that finds something adds a Problem (what, where, evidence, cause, fix) to the
session's Verdict; the same cause seen by several checks (dtypes, step counts, the load and the
forward) is one problem. A failed user check that added none still counts, as its own problem, so the
verdict is never "served as trained" while a check failed. Checks of other areas (wiring, server
flags) add theirs the same way, through the `verdict` fixture.

VerdictPlugin holds the pytest side: the focused run (with --draft-checkpoint, unless --with-matrix, only
the checks marked `user` in conformance/user/ are collected and run), the exit code (1 whenever there is
a problem), the verdict block in the terminal summary, and the "verdict" object of report.json / report.md.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.core.findings import FORWARD, LOADING, OTHER, Problem

SERVED, NOT_SERVED = "served as trained", "NOT served as trained"
USER_MARK = "user"
USER_DIR = Path(__file__).resolve().parent   # the focused run collects only test files here


class Verdict:
    def __init__(self):
        self.problems: dict[str, Problem] = {}
        self.failed: dict[str, str] = {}      # failed user check -> its first line
        self.outcomes: dict[str, str] = {}    # user check -> passed | failed | skipped
        self.context: dict[str, str] = {}     # what was judged: draft, format, trainer, served as

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
        """An unregistered divergence of an implementation that did not load the checkpoint as written
        is folded into that loading problem (the tensor it did not load is the first suspect); a failed
        check that named no problem becomes one, with its own first line as evidence."""
        for key, p in list(self.problems.items()):
            loading = next((q for q in self.problems.values() if q.rank == LOADING and q.impl == p.impl), None)
            if p.rank == FORWARD and not p.known and p.impl and loading is not None:
                loading.evidence += f"; then the forward departs at {p.where}: {p.evidence}"
                loading.checks += [c for c in p.checks if c not in loading.checks]
                del self.problems[key]
        for nodeid, line in self.failed.items():
            if not self.covered(nodeid):
                self.add(Problem(f"check failed: {nodeid.rsplit('::', 1)[-1]}", nodeid, line,
                                 "not classified: see the failure above", "none known", rank=OTHER,
                                 key=f"failed:{nodeid}"), nodeid)

    def ordered(self) -> list[Problem]:
        return sorted(self.problems.values(), key=lambda p: p.rank)   # stable: insertion order within a rank

    @property
    def served(self) -> bool:
        return not self.problems and not self.failed

    def headline(self) -> str:
        n = len(self.problems)
        return SERVED if self.served else f"{NOT_SERVED}: {n} problem{'s' if n != 1 else ''}"

    def to_json(self, versions: dict[str, str]) -> dict:
        checks = {o: sum(v == o for v in self.outcomes.values()) for o in ("passed", "failed", "skipped")}
        return {"served_as_trained": self.served, "headline": self.headline(), **self.context,
                "checks": checks, "versions": versions,
                "problems": [p.to_json(n) for n, p in enumerate(self.ordered(), 1)]}


# ---------------------------------------------------------------- pytest side

VERDICT_KEY = pytest.StashKey[Verdict]()


def focused(config) -> bool:
    return bool(config.getoption("--draft-checkpoint")) and not config.getoption("--with-matrix")


class VerdictPlugin:
    """Registered by conformance/plugin.py's pytest_configure; `report` is the session's Report."""

    def __init__(self, config, report):
        self.config, self.report = config, report
        self.verdict = config.stash.setdefault(VERDICT_KEY, Verdict())

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
        keep = [item for item in items if item.get_closest_marker(USER_MARK)]
        dropped = [item for item in items if not item.get_closest_marker(USER_MARK)]
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

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if not self.config.getoption("--draft-checkpoint") or not self.verdict.outcomes:
            return   # no verdict when no user check ran (--collect-only, a -k that selects none)
        from conformance.adapters import versions

        self.verdict.finish()
        self.report.verdict = self.verdict.to_json(versions())
        if not self.verdict.served and session.exitstatus == 0:
            session.exitstatus = 1   # a problem no check raised as a failure still fails the run

    @pytest.hookimpl(trylast=True)   # after the stage tables: the last thing before pytest's own summary
    def pytest_terminal_summary(self, terminalreporter):
        from conformance.session.report_render import verdict_lines

        data = getattr(self.report, "verdict", None)
        if not data:
            return
        terminalreporter.section("eagle3 conformance: your draft", bold=True,
                                 red=not data["served_as_trained"], green=data["served_as_trained"])
        for line in verdict_lines(data):
            terminalreporter.write_line(line)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("E "):
            return line[2:].strip()
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
