"""Parallel runs (pytest-xdist, `-n 2 --dist loadfile`, as the Makefile runs the lanes): tests are spread over
worker processes a file at a time, so that each file's session models are built in one process only, and the
files of one group (SHARED) go to one worker together: the engine lane's files share SGLang Engine servers,
which are costly to start and must not run twice at once. Each worker's report findings go to the
controller, which writes the one report (conformance/plugin.py, Report.absorb).

The order files are handed out in is the longest first (COST): xdist's own order is by number of tests, which
sent the acceptance lane (9 tests, a minute of training-data drafting) last, to run alone at the end while the
other worker idled. The order changes the time only: the report is the same whatever ran where
(meta/test_report_determinism.py)."""
from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

SHARED = {"conformance/engine/": "engine lane"}   # path prefix -> the one scope of its files

# Seconds a scope takes on the 2-core host (measured in one process, the host shared: relative figures), for the
# scopes of 15 s or more; any other file counts PER_TEST a test. Only the order matters: a stale figure costs time.
COST = {
    "conformance/meta/test_verdict.py": 370, "engine lane": 366, "conformance/meta/test_readme_commands.py": 121,
    "conformance/acceptance/test_acceptance.py": 90, "conformance/meta/test_report_determinism.py": 82,
    "conformance/meta/test_preloaded.py": 62, "conformance/meta/test_verdict_mla.py": 68,
    "conformance/meta/test_fuzz_inputs.py": 33,
    "conformance/meta/test_user_draft_cli.py": 33, "conformance/draft/test_step0.py": 31,
    "conformance/draft/test_multistep.py": 29, "conformance/wiring/test_wiring.py": 28,
    "conformance/settings/test_sglang_settings.py": 25, "conformance/meta/test_lanes.py": 22,
    "conformance/meta/test_registry.py": 21, "conformance/wiring/test_user_wiring.py": 21,
    "conformance/meta/test_vllm_worker.py": 19, "conformance/draft/test_real_configs.py": 19,
    "conformance/meta/test_printed_commands.py": 18, "conformance/loading/test_accounting.py": 16,
}
PER_TEST = 0.15


def scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((group for prefix, group in SHARED.items() if path.startswith(prefix)), path)


def longest_first(workqueue: dict[str, dict]) -> list[str]:
    """The scopes in the order they are handed out: by COST, else by their number of tests, longest first; ties
    in the collection's order."""
    return sorted(workqueue, key=lambda s: -COST.get(s, PER_TEST * len(workqueue[s])))


class FileGroupScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return scope(nodeid)

    def _assign_work_unit(self, node) -> None:
        # xdist fills self.workqueue (ordered by number of tests) in schedule(), then hands out its head here.
        if not getattr(self, "_longest_first", False):
            order = longest_first(self.workqueue)
            units = {s: self.workqueue[s] for s in order}
            self.workqueue.clear()
            self.workqueue.update(units)
            self._longest_first = True
        super()._assign_work_unit(node)
