"""The suite's pytest-xdist hooks, registered by conformance/plugin.py only when xdist is loaded: pytest refuses a
plugin that implements a hook nobody declared, and xdist (`make test`'s -n2) is a development tool that a
serving environment need not have (the Makefile's DEV_TOOLS)."""
from __future__ import annotations

import json

from conformance.plugin import _REPORT, REPORT_PARTS


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile keeps the engine lane's files together (conformance/core/parallel.py)."""
    if config.getoption("dist") == "loadfile":
        from conformance.core.parallel import FileGroupScheduling

        return FileGroupScheduling(config, log)
    return None


def pytest_testnodedown(node, error):
    """The controller receives each worker's findings, to write the one report."""
    parts = getattr(node, "workeroutput", {}).get(REPORT_PARTS)
    if parts:
        _REPORT.absorb(json.loads(parts))
