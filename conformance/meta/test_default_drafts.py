"""report.md's "each trainer's default draft" section against the run: per default draft (fixtures/cases.py
DEFAULT_CASES) and server, "as trained" exactly when every forward check of it conformed, else where the earliest of
them first departs and the registry entry that matched it, as the built-in tests record them (assert_conforms).

The expected rows are taken from the forward checks themselves (check_forward's comparisons and registry hits), not
from the report's data; a planted wrong row, and a planted divergence no entry explains, are caught."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS
from conformance.core.compare import compare_traces
from conformance.session.harness import ForwardCheck, KnownDivergenceHit, assert_conforms, check_forward
from conformance.session.report import Report
from conformance.session.report_render import DEFAULT_DRAFTS_TITLE, terminal_lines
from fixtures.cases import DEFAULT_CASES, DEFAULT_STEPS

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
SERVERS = [impl for impl in IMPLEMENTATIONS if ADAPTERS[impl].is_server]   # the servers of this lane
RUNS = ((1, True), (DEFAULT_STEPS, False))   # (steps, teacher forced): step 0, and serving's K = DEFAULT_STEPS


def record(report: Report, drafts, impl: str, case, steps: int, teacher_forced: bool) -> None:
    nodeid = f"t.py::x[{impl}-{case.id}-{steps}-{teacher_forced}]"
    try:
        assert_conforms(drafts, report, impl, case, "fp32", nodeid, "repro", steps, teacher_forced)
    except (KnownDivergenceHit, AssertionError):   # what the row must then say: checked against `observed`
        pass


@pytest.fixture(scope="module")
def run(drafts) -> tuple[Report, dict[tuple[str, str], list[ForwardCheck]]]:
    """The default drafts through every server of this lane, recorded as the built-in tests record them, and the
    forward checks themselves."""
    report, observed = Report(), {}
    for case in DEFAULT_CASES:
        for impl in SERVERS:
            for steps, teacher_forced in RUNS:
                record(report, drafts, impl, case, steps, teacher_forced)
                observed.setdefault((case.id, impl), []).append(
                    check_forward(drafts, impl, case, "fp32", "repro", steps, teacher_forced))
    return report, observed


def place(check: ForwardCheck) -> tuple[int, int, str]:
    """Where one check first departs: (step, position among that step's compared stages, stage); a refusal first."""
    if check.failure is not None:
        return (-1, -1, "load")
    first = check.comparison.first_divergence
    same_step = [r for r in check.comparison.results if r.step == first.step]
    return (first.step, same_step.index(first), first.stage)


def expected(checks: list[ForwardCheck]) -> dict[str, str]:
    departed = [c for c in checks if not c.conforms]
    if not departed:
        return {"served": "as trained", "first divergent stage": "", "registry entry": ""}
    unexplained = [c for c in departed if not c.match.hits]
    step, _, stage = min(place(c) for c in (unexplained or departed))
    return {"served": "UNEXPECTED FAILURE" if unexplained else "differently",
            "first divergent stage": "load" if stage == "load" else f"step {step} `{stage}`",
            "registry entry": ", ".join(sorted({c.match.hits[0].id for c in departed if c.match.hits})) or "none"}


def disagreements(rows: list[dict], observed: dict[tuple[str, str], list[ForwardCheck]]) -> list[str]:
    """Each row that says other than the checks observed, and each default draft and server without its row."""
    out, seen = [], set()
    for row in rows:
        impl = row["server"].split()[0]
        key = (row["default draft"], impl)
        seen.add(key)
        if key not in observed:   # a server of another lane: not run here, and the row must say so
            if not row["served"].startswith("not run"):
                out.append(f"{key}: says {row['served']!r}, but it did not run here")
            continue
        said = {k: row[k] for k in ("served", "first divergent stage", "registry entry")}
        if said != expected(observed[key]):
            out.append(f"{key}: says {said}, the run observed {expected(observed[key])}")
    out += [f"{key}: no row" for key in observed if key not in seen]
    return out


def test_default_drafts_section_says_what_the_run_observed(run):
    report, observed = run
    data = report.to_json()
    rows = data["default_drafts"]
    assert rows and not disagreements(rows, observed), "\n".join(disagreements(rows, observed))
    servers = [i for i, a in ADAPTERS.items() if a.is_server]
    assert len(rows) == len(DEFAULT_CASES) * len(servers), rows   # every server, also one not run here
    md = report.to_markdown()
    assert f"\n## {DEFAULT_DRAFTS_TITLE}\n" in md, md
    section = md.split(f"\n## {DEFAULT_DRAFTS_TITLE}\n", 1)[1].split("\n## ", 1)[0]
    terminal = "\n".join(terminal_lines(data))
    for row in rows:
        assert "| " + " | ".join(v.replace("|", "\\|") for v in row.values()) + " |" in section, (row, section)
        assert " | ".join(row.values()).rstrip(" |") in terminal, (row, terminal)


@pytest.mark.parametrize("field", ["served", "first divergent stage", "registry entry"])
def test_a_planted_wrong_row_is_caught(run, field):
    report, observed = run
    rows = report.to_json()["default_drafts"]
    ran = [r for r in rows if (r["default draft"], r["server"].split()[0]) in observed]
    for n, row in enumerate(ran):
        other = next((r[field] for r in ran if r[field] != row[field]), "planted")
        planted = [dict(r, **{field: other}) if r is row else r for r in rows]
        assert [d for d in disagreements(planted, observed) if row["default draft"] in d], (n, field, planted)
    assert disagreements(rows[1:], observed), "a missing row went unnoticed"


def test_a_planted_unexplained_divergence_is_an_unexpected_failure_at_its_step(run, drafts):
    """One server's multi-step trace of a draft it served as trained, moved at step 1 only: its step-0 checks still
    conform, and the row names the step-1 stage and no entry."""
    report, observed = run
    rows = {(r["default draft"], r["server"].split()[0]): r for r in report.to_json()["default_drafts"]}
    key = next(k for k, checks in observed.items() if all(c.conforms for c in checks))
    case = next(c for c in DEFAULT_CASES if c.id == key[0])
    actual = drafts.trace(key[1], case, torch.float32, DEFAULT_STEPS)
    stage = next(s for s in actual.steps[1] if s.endswith("attn_out"))
    moved = dataclasses.replace(actual, steps=[actual.steps[0], {**actual.steps[1], stage: actual.steps[1][stage] + 1},
                                               *actual.steps[2:]])
    planted = Report(entries=list(report.entries))
    planted.add(compare_traces(moved, drafts.trace("reference", case, torch.float32, DEFAULT_STEPS), case.id),
                "t.py::planted", "FAIL")
    row = next(r for r in planted.to_json()["default_drafts"] if (r["default draft"], r["server"].split()[0]) == key)
    assert rows[key]["served"] == "as trained", rows[key]
    assert (row["served"], row["first divergent stage"], row["registry entry"]) == \
        ("UNEXPECTED FAILURE", f"step 1 `{stage}`", "none"), row
