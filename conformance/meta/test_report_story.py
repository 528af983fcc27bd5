"""One story in every output: report.md and the chart say what the verdict says, for problems of every area.

`contradictions` reads a user run's report (its data, report.md and the chart's own plan, chart_plan: what
write_chart draws, not its pixels) and names every place that says otherwise than the verdict's headline:
the problem count, each problem's area in the summary, registered causes shown as known, the verdict and what
it did not check before any table, a first-divergences section that is not "None" while a problem exists, no
support-matrix row "safe" then, and a chart mark for every problem, in a colour per pair that is not the
diverged red, never drawing what follows a divergence as a recovery. conformance/meta/test_verdict.py runs it
on the report of each of its real runs; here it runs in process on a verdict of each problem area over real
comparisons (the reference's trace against itself, a fault planted at a stage), and each contradiction it
guards against is planted once to show it is caught.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conformance.adapters import versions
from conformance.core.compare import compare_traces
from conformance.core.findings import CONVERSION, DIRECTORY, FORWARD, LOADING, OTHER, SETTINGS, WIRING, Problem
from conformance.core.sections import FAIL, KNOWN
from conformance.meta.test_report_files import part
from conformance.session.report import CHART_FILE, Report
from conformance.session.report_render import (AFTER, DIVERGED_COLOUR, DOWNSTREAM_COLOUR, FIRST, Chart, chart_plan,
                                               markdown)
from conformance.user.problems import report_outcome
from conformance.user.verdict import Verdict
from fixtures.cases import CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
CASE = CASES_BY_ID["norm_before_fc"]
IMPLS = ("sglang", "speculators")   # a server and a trainer: the support matrix's columns
HEADLINE_COUNT = re.compile(r"(\d+) problems?\b")


def contradictions(data: dict, md: str, plan: Chart | None = None) -> list[str]:
    """Every place report.md or the chart says otherwise than the verdict (empty: one story)."""
    v = data["verdict"]
    problems, plan = v["problems"], plan or chart_plan(data)
    found = []
    said = HEADLINE_COUNT.search(v["headline"])
    if (int(said[1]) if said else 0) != len(problems):
        found.append(f"headline {v['headline']!r} does not count the {len(problems)} problems")
    summary = part(md, "Summary")
    counted = HEADLINE_COUNT.search(summary)
    if (int(counted[1]) if counted else 0) != len(problems):
        found.append(f"summary counts {counted[0] if counted else 'no problem'}, the verdict {len(problems)}")
    found += [f"summary does not name problem {p['number']}'s area {p['area']}" for p in problems
              if not re.search(rf"\b{re.escape(p['area'])} \d+ \(problems? [\d, ]*\b{p['number']}\b", summary)]
    known = sum(bool(p["registry_id"]) for p in problems)
    if problems and f"; {known} known" not in summary:
        found.append(f"summary does not count the {known} registered cause(s) as known")
    found += [f"summary does not say {x['what']} was not checked" for x in v["not_checked"] if x["what"] not in summary]
    for p in problems:
        outcomes = {c["outcome"] for c in data["comparisons"] if c["nodeid"] in p["checks"]}
        if outcomes - {KNOWN if p["registry_id"] else FAIL}:
            found.append(f"problem {p['number']}'s comparisons are {sorted(outcomes)}")
    first_table = md.find("\n|")
    if first_table != -1 and first_table < md.find("\n## First divergences"):
        found.append("a table comes before the verdict and its summary")
    first = part(md, "First divergences")
    if problems and first.strip().startswith("None"):
        found.append("first divergences say None")
    found += [f"first divergences have no row for problem {p['number']}" for p in problems
              if f"| {p['number']} | {p['area']} |" not in first]
    if "\n## Support matrix" in md:
        rows = [row.strip("| ").split(" | ") for row in part(md, "Support matrix").splitlines()[4:] if row]
        found += [f"support matrix row {row[0]} is safe" for row in rows
                  if problems and all(cell in ("safe", "not run") for cell in row[1:])]
        found += [f"support matrix never names problem {p['number']}" for p in problems
                  if f"problem {p['number']} (" not in part(md, "Support matrix")]
    return found + chart_contradictions(problems, plan)


def chart_contradictions(problems: list[dict], plan: Chart) -> list[str]:
    found = []
    marked = sorted(m.problem for m in plan.marks)
    if marked != [p["number"] for p in problems]:
        found.append(f"the chart marks problems {marked}, the verdict has {len(problems)}")
    for line in plan.lines:
        if line.colour in (DIVERGED_COLOUR, DOWNSTREAM_COLOUR):
            found.append(f"{line.label} is drawn in {line.colour}, kept for divergences")
        states = [state for *_, state in line.points]
        if FIRST in states and set(states[states.index(FIRST) + 1:]) - {AFTER}:
            found.append(f"{line.label} is drawn recovering after its first divergence")
    return found


def report_contradictions(directory: Path) -> list[str]:
    """contradictions() of a report directory a user run wrote (report.json and report.md)."""
    data = json.loads((directory / "report.json").read_text())
    return contradictions(data, (directory / "report.md").read_text())


# ---------------------------------------------------------------- a verdict of each area, in process

@dataclass(frozen=True)
class Found:
    rank: int
    known: str = ""               # its registry entry, if registered
    impl: str = ""
    stage: str | None = None      # a forward problem: where its implementation's comparison diverges
    load: bool = False            # its implementation's loader refused the draft: no comparison


@dataclass(frozen=True)
class Story:
    id: str
    found: tuple[Found, ...]
    unchecked: tuple[str, ...] = ()


# Shaped like the runs of conformance/meta/test_verdict.py (named in the comments), one area or more each.
STORIES = [
    Story("forward_known", (Found(DIRECTORY), Found(FORWARD, "sglang-residual-never-normed", "sglang",
                                                    "layers.0.residual")),   # norm_before_residual, speculators
          ("target wiring", "server flags")),
    Story("forward_unregistered", (Found(FORWARD, impl="sglang", stage="layers.0.attn_out"),)),
    Story("load_refused", (Found(LOADING, "speculators-fc-ignores-target-hidden-size", "speculators", load=True),
                           Found(LOADING, impl="sglang"))),   # dropped_fc_bias with --trainer=speculators
    Story("wiring_and_settings", (Found(WIRING), Found(SETTINGS, "sglang-chain-caps-draft-tokens"))),   # the seed
    Story("conversion", (Found(CONVERSION),)),
    Story("failed_check", (Found(OTHER),)),
    Story("served", ()),                                                      # clean_sglang_every_input
    Story("not_checked", (), ("target wiring", "server flags")),              # clean_*
]


def nodeid(impl: str) -> str:
    return f"conformance/user/test_user_draft.py::test_user_draft_step0_matches_reference[{impl}-fp32-user_draft]"


def render(story: Story, drafts) -> Report:
    """The report of a user run with the story's verdict: each implementation's comparison of the reference's
    own trace, a fault planted at a forward problem's stage; a refused load instead of a comparison."""
    verdict, report = Verdict(), Report()
    expected = drafts.trace("reference", CASE, torch.float32)
    for n, f in enumerate(story.found):
        problem = Problem(f"what {n}", f"draft step 0, stage `{f.stage}`" if f.stage else f"where {n}", "evidence",
                          "cause", "fix", f.rank, key=f"{story.id}:{n}", known=f.known, impl=f.impl)
        verdict.add(problem, nodeid(f.impl) if f.stage or f.load else f"t.py::test_{n}")
    for impl in IMPLS:
        problem = next((p for p in verdict.problems.values() if nodeid(impl) in p.checks), None)
        if any(f.load and f.impl == impl for f in story.found):
            report.add_load_failure(impl, "user_draft", "fp32", nodeid(impl), report_outcome(problem), "refused")
            continue
        stage = next((f.stage for f in story.found if f.stage and f.impl == impl), None)
        actual = dataclasses.replace(expected, impl=impl, steps=[
            {**s, stage: s[stage] + 1.0} if stage else s for s in expected.steps])
        report.add(compare_traces(actual, expected, "user_draft"), nodeid(impl), report_outcome(problem))
    verdict.unchecked = {what: "give --an-option" for what in story.unchecked}
    verdict.outcomes = {"t.py::test_ran": "passed"}
    verdict.finish()
    report.verdict = verdict.to_json(versions())
    return report


@pytest.mark.parametrize("story", STORIES, ids=lambda s: s.id)
def test_report_md_and_the_chart_tell_the_verdicts_story(story, drafts):
    data = render(story, drafts).to_json()
    assert not contradictions(data, markdown(data)), "\n".join(contradictions(data, markdown(data)))


OLD_SUMMARY = "\n\n8 comparisons: 8 conform, 0 known divergences, 0 unexpected failures.\n\n"   # before issue 24


def _plant_summary(data, md):
    return md.replace(part(md, "Summary"), OLD_SUMMARY), None


def _plant_none(data, md):
    return md.replace(part(md, "First divergences"), "\n\nNone: every implementation matched.\n\n"), None


def _plant_safe(data, md):
    return re.sub(r"\| problem \d+ \([^|]*", "| safe ", md), None


def _plant_table_first(data, md):
    return md.replace("## Verdict", "| a | table |\n\n## Verdict", 1), None


def _plant_unmarked(data, md):
    plan = chart_plan(data)
    return md, dataclasses.replace(plan, marks=plan.marks[1:])


def _plant_red_pair(data, md):
    plan = chart_plan(data)
    return md, dataclasses.replace(plan, lines=(dataclasses.replace(plan.lines[0], colour=DIVERGED_COLOUR),
                                                *plan.lines[1:]))


def _plant_recovery(data, md):
    plan = chart_plan(data)
    line = next(line for line in plan.lines if any(p[3] == FIRST for p in line.points))
    points = tuple((*p[:3], "ok" if p[3] == AFTER else p[3]) for p in line.points)
    return md, dataclasses.replace(plan, lines=tuple(dataclasses.replace(x, points=points) if x is line else x
                                                     for x in plan.lines))


# Each plant, and the words of the contradiction that must catch it.
PLANTS = {"summary without the verdict's problems": (_plant_summary, "summary counts no problem"),
          "first divergences None": (_plant_none, "first divergences say None"),
          "support matrix safe": (_plant_safe, "is safe"),
          "a table before the verdict": (_plant_table_first, "a table comes before the verdict"),
          "a problem unmarked on the chart": (_plant_unmarked, "the chart marks problems [2]"),
          "a pair drawn in the diverged red": (_plant_red_pair, "kept for divergences"),
          "a line recovering after its divergence": (_plant_recovery, "recovering after its first divergence")}


@pytest.mark.parametrize("plant", PLANTS)
def test_each_contradiction_is_caught(plant, drafts):
    """The story of a verdict with a registered forward problem and a reading problem, one contradiction planted."""
    data = render(STORIES[0], drafts).to_json()
    change, words = PLANTS[plant]
    found = contradictions(data, *change(data, markdown(data)))
    assert any(words in x for x in found), f"planted {plant!r}: {found}"


def test_known_shown_as_unexpected_is_caught(drafts):
    data = render(STORIES[0], drafts).to_json()
    for c in data["comparisons"]:
        c["outcome"] = FAIL if c["outcome"] == KNOWN else c["outcome"]
    assert any("comparisons are ['FAIL']" in x for x in contradictions(data, markdown(data)))


def test_a_user_report_is_the_same_bytes_twice(drafts, tmp_path):
    for name in ("a", "b"):
        render(STORIES[3], drafts).write(tmp_path / name)
    for file in ("report.json", "report.md", CHART_FILE):
        assert (tmp_path / "a" / file).read_bytes() == (tmp_path / "b" / file).read_bytes(), f"{file} differs"
