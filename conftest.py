"""pytest wiring: options, the GPU gate, session fixtures, the repro line and the report."""
from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from conformance.report import Report, versions


def pytest_addoption(parser):
    group = parser.getgroup("eagle3-conformance")
    group.addoption("--report", metavar="DIR", default=None,
                    help="write report.json and report.md to DIR (also when tests fail)")
    group.addoption("--stage-table", action="store_true",
                    help="print the per-stage max abs/rel error table at the end (implied by --report)")
    group.addoption("--require-gpu", action="store_true",
                    help="fail, instead of skipping, gpu tests when CUDA is not available")


def pytest_report_header(config):
    return "versions under test: " + ", ".join(f"{k} {v}" for k, v in versions().items())


def pytest_collection_modifyitems(config, items):
    """The one place that decides skips: gpu tests need CUDA."""
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    if config.getoption("--require-gpu"):
        raise pytest.UsageError(f"--require-gpu: {len(gpu_items)} gpu tests selected but torch.cuda.is_available() is False")
    skip = pytest.mark.skip(reason="gpu: torch.cuda.is_available() is False")
    for item in gpu_items:
        item.add_marker(skip)


# ---------------------------------------------------------------- session state

_REPORT = Report()


@pytest.fixture(scope="session")
def report() -> Report:
    return _REPORT


@pytest.fixture(scope="session")
def drafts(tmp_path_factory):
    from conformance.harness import DraftStore

    return DraftStore(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture
def repro(request) -> str:
    """The one-line command that reruns exactly this test (inputs are seeded, so the node id suffices)."""
    return f"python -m pytest {shlex.quote(request.node.nodeid)}"


def pytest_sessionfinish(session, exitstatus):
    directory = session.config.getoption("--report")
    if directory and (_REPORT.entries or _REPORT.sections):
        _REPORT.write(Path(directory))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not (_REPORT.entries or _REPORT.sections) or not (config.getoption("--stage-table") or config.getoption("--report")):
        return
    tr = terminalreporter
    tr.section("eagle3 conformance: per implementation pair and stage")
    first = _REPORT.first_divergence_lines()
    if first:
        tr.write_line("first divergences (outcome | pair | case | dtype | stage | reason):")
        for line in first:
            tr.write_line("  " + line.strip("| ").replace(" | ", " | "))
    tr.write_line(_REPORT.stage_table_text())
    if config.getoption("--report"):
        tr.write_line(f"report written to {Path(config.getoption('--report')) / 'report.md'} (and report.json)")
