"""The report's three files: identical bytes for identical inputs (no timestamps, no temp paths, a PNG
without metadata), each written atomically (no temp file left behind)."""
from __future__ import annotations

import pytest
import torch

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS
from conformance.core.compare import compare_traces
from conformance.core.report import CHART_FILE, Report
from fixtures.cases import CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


def make_report(drafts) -> Report:
    report = Report()
    case = CASES_BY_ID["norm_before_fc"]
    expected = drafts.trace("reference", case, torch.float32)
    for impl in IMPLEMENTATIONS:
        comparison = compare_traces(drafts.trace(impl, case, torch.float32), expected, ADAPTERS[impl].claimed_stages,
                                    case.config.num_hidden_layers, case.id)
        report.add(comparison, f"t.py::x[{impl}]", "pass" if comparison.first_divergence is None else "FAIL")
    report.add_row("weight accounting", {"draft": case.id, "impl": "sglang", "problems": "none"})
    return report


def test_report_files_are_identical_run_to_run(drafts, tmp_path):
    make_report(drafts).write(tmp_path / "a")
    make_report(drafts).write(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(["report.json", "report.md", CHART_FILE]), names   # nothing half-written left over
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), f"{name} differs"
    assert (tmp_path / "a" / CHART_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"]({CHART_FILE})" in (tmp_path / "a" / "report.md").read_text()
