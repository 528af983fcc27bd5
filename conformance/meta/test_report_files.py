"""The report's three files: identical bytes for identical inputs (no timestamps, no temp paths, a PNG
without metadata), each written atomically (no temp file left behind); report.md, the terminal summary
and report.json say the same things (one path: the data), including the support matrix of the tests that
ran and how each implementation ran (Trace.notes); section titles come from one place."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS
from conformance.core.compare import compare_traces
from conformance.session.report import CHART_FILE, Report
from conformance.core.sections import Section
from conformance.session.report_render import terminal_lines
from fixtures.cases import CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
CASE = CASES_BY_ID["norm_before_fc"]
PLANTED = "layers.0.attn_out"   # the stage a planted fault moves in the last implementation's trace
RUNS = tuple(i for i in IMPLEMENTATIONS if ADAPTERS[i]().unsupported(CASE.config) is None)   # those that express CASE


def make_report(drafts, planted: bool = False) -> Report:
    report = Report()
    expected = drafts.trace("reference", CASE, torch.float32)
    for impl in RUNS:
        actual = drafts.trace(impl, CASE, torch.float32)
        if planted and impl == RUNS[-1]:
            actual = dataclasses.replace(actual, steps=[{**s, PLANTED: s[PLANTED] + 1.0} for s in actual.steps])
        comparison = compare_traces(actual, expected, CASE.id)
        report.add(comparison, f"t.py::x[{impl}]", "pass" if comparison.first_divergence is None else "FAIL")
    if planted:
        report.add_load_failure(RUNS[0], "another_case", "bf16", "t.py::y", "known divergence",
                                "could not load: planted")
    report.add_row(Section.WEIGHT_ACCOUNTING, {"draft": CASE.id, "impl": "sglang", "problems": "none"})
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


def test_wall_clock_figures_stay_out_of_the_report(tmp_path):
    """The engine lane's timings (engine start, serving per scenario) go to timings.json; report.json and
    report.md are the same bytes however long the engine took."""
    from conformance.engine.lane import GroupRun, ScenarioRun
    from conformance.engine.reporting import record_group
    from conformance.engine.scenarios import EngineGroup, Scenario
    from conformance.session.report import TIMINGS_FILE

    scenario = Scenario("one", "a scenario", ())
    for name, seconds in (("a", 1.25), ("b", 7.5)):
        report = Report()
        run = GroupRun(EngineGroup("chain", 3, 1, 4, (scenario,)), {"speculative_num_steps": 3}, {}, seconds,
                       {"one": ScenarioRun(scenario, [], 2 * seconds)})
        record_group(report, run, set())
        report.write(tmp_path / name)
    for file in ("report.json", "report.md"):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), f"{file} differs"
    timings = [(tmp_path / n / TIMINGS_FILE).read_text() for n in ("a", "b")]
    assert '"engine start s": 1.2' in timings[0] and '"one": 15.0' in timings[1], timings


def part(md: str, heading: str) -> str:
    assert f"\n## {heading}" in md, f"report.md has no section {heading!r}"
    return md.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]


def test_markdown_and_terminal_render_the_data(drafts):
    report = make_report(drafts, planted=True)
    data, md = report.to_json(), report.to_markdown()
    failed = RUNS[-1]
    first = part(md, "First divergences")
    row = f"| FAIL | {failed} vs reference | {CASE.id} | fp32 | step 0 `{PLANTED}` (max abs "
    assert row in first, first
    assert f"| known divergence | {RUNS[0]} vs reference | another_case | bf16 | load |" in first, first
    terminal = "\n".join(terminal_lines(data))
    assert row.strip("| ").replace(" | ", " | ") in terminal and "another_case" in terminal, terminal

    matrix = part(md, "Support matrix")
    assert f"| {CASE.id} |" in matrix and "UNEXPECTED FAILURE" in matrix, matrix
    another = [line for line in matrix.splitlines() if line.startswith("| another_case |")]
    assert another and "diverges: load" in another[0] and "not run" in another[0], matrix
    assert data["support_matrix"] and {r["case"] for r in data["support_matrix"]} == {CASE.id, "another_case"}

    ran = part(md, "How each implementation ran")
    for impl in RUNS:
        notes = drafts.trace(impl, CASE, torch.float32).notes
        assert notes, f"{impl}'s adapter left Trace.notes empty"
        assert [c["notes"] for c in data["comparisons"] if c["impl"] == impl and c["case"] == CASE.id] == [notes]
        for note in notes:
            assert f"| {impl} | {note.replace('|', chr(92) + '|')} |" in ran, (impl, note, ran)
    assert "| draft | impl | problems |" in part(md, Section.WEIGHT_ACCOUNTING.value)


def test_section_titles_come_from_the_enum():
    report = Report()
    with pytest.raises(TypeError, match="Section"):
        report.add_row("weight accounting", {"draft": "x"})
    report.add_row(Section.WIRING, {"case": "x"})
    assert list(report.to_json()["sections"]) == [Section.WIRING.value]
