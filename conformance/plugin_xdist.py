"""The suite's pytest-xdist hooks, registered by conformance/plugin.py only when xdist is loaded: pytest refuses a
plugin that implements a hook nobody declared, and xdist (`make test`'s -n2) is a development tool that a
serving environment need not have (the Makefile's DEV_TOOLS). The plugin hands it the session's report, so this
module imports nothing of the plugin's."""
from __future__ import annotations

import json


class XdistHooks:
    def __init__(self, report, parts_key: str):
        self.report, self.parts_key = report, parts_key   # the session's Report, the workeroutput key of its parts

    def pytest_xdist_make_scheduler(self, config, log):
        """--dist loadfile keeps the engine lane's files together (conformance/session/parallel.py)."""
        if config.getoption("dist") == "loadfile":
            from conformance.session.parallel import FileGroupScheduling

            return FileGroupScheduling(config, log)
        return None

    def pytest_testnodedown(self, node, error):
        """The controller receives each worker's findings, to write the one report."""
        parts = getattr(node, "workeroutput", {}).get(self.parts_key)
        if parts:
            self.report.absorb(json.loads(parts))
