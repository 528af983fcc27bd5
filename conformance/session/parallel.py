"""Parallel runs (pytest-xdist, `-n 2 --dist loadfile`, as the Makefile runs the lanes): tests are spread over
worker processes a file at a time, so that each file's session models are built in one process only, and the
files of one group (SHARED) go to one worker together: the engine lane's files share SGLang Engine servers,
which are costly to start and must not run twice at once. Each worker's report findings go to the
controller, which writes the one report (conformance/plugin.py, Report.absorb)."""
from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

SHARED = {"conformance/engine/": "engine lane"}   # path prefix -> the one scope of its files


def scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((group for prefix, group in SHARED.items() if path.startswith(prefix)), path)


class FileGroupScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return scope(nodeid)
