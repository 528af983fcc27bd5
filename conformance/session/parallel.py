"""Parallel runs (pytest-xdist, `-n 2 --dist loadfile`, as the Makefile runs the lanes): tests are spread over
worker processes a file at a time, so that each file's session models are built in one process only, and the
files of one group (SHARED) go to one worker together: the engine lane's files share SGLang Engine servers,
which are costly to start and must not run twice at once. Each worker's report findings go to the
controller, which writes the one report (conformance/plugin.py, Report.absorb).

The acceptance lane is handed out first (FIRST), then xdist's own order (by number of tests, most first): by that
order alone the acceptance lane (9 tests, about a minute of drafting) came last in `make conformance` and ran alone
while the other worker idled. Only that file moves: a longest-first order of every file would also start the engine
lane and the verdict's user runs (each spawning processes of its own) together, and two clean-clone runs of `make
test` did not show it faster. The order changes the time only: the report is the same whatever ran where
(meta/test_report_determinism.py)."""
from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

SHARED = {"conformance/engine/": "engine lane"}   # path prefix -> the one scope of its files

FIRST = ("conformance/acceptance/test_acceptance.py",)


def scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((group for prefix, group in SHARED.items() if path.startswith(prefix)), path)


def handed_out(workqueue: dict[str, dict]) -> list[str]:
    """The scopes in the order they are handed out: FIRST, then the rest in `workqueue`'s (xdist's) order."""
    return [s for s in FIRST if s in workqueue] + [s for s in workqueue if s not in FIRST]


class FileGroupScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return scope(nodeid)

    def _assign_work_unit(self, node) -> None:
        # xdist fills self.workqueue (ordered by number of tests) in schedule(), then hands out its head here.
        if not getattr(self, "_reordered", False):
            units = {s: self.workqueue[s] for s in handed_out(self.workqueue)}
            self.workqueue.clear()
            self.workqueue.update(units)
            self._reordered = True
        super()._assign_work_unit(node)
