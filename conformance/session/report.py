"""The conformance report: one session-wide Report (conformance/plugin.py) that tests add to, as data.

`Report.to_json()` is the one path: report.json is that data, and report.md, the chart and the
terminal summary are rendered from it (conformance/session/report_render.py). Files are written
atomically at session end, also when tests fail. No timestamps and no wall-clock figures: identical inputs
give identical reports; what a check timed goes to timings.json beside them (add_timing).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from conformance.adapters import ADAPTERS, versions
from conformance.session import report_render
from conformance.core.compare import Comparison
from conformance.core.sections import ACCEPT_CHART_FILE, FAIL, KNOWN, Section
from conformance.core.stages import stage_names
from conformance.core.tolerances import dtype_name
from fixtures.cases import DEFAULT_CASES

CHART_FILE = report_render.CHART_FILE
TIMINGS_FILE = "timings.json"


def _num(x):
    return None if x is None else float(f"{x:.6g}")


@dataclass
class Entry:
    comparison: Comparison | None
    nodeid: str
    outcome: str                      # PASS | KNOWN | FAIL
    case_id: str
    impl: str
    dtype: str
    note: str = ""                    # known-divergence reason, or a load error
    known: str = ""                   # the id of the registry entry that explains it ("": none)


@dataclass
class Report:
    entries: list[Entry] = field(default_factory=list)
    sections: dict[Section, list[dict]] = field(default_factory=dict)
    verdict: dict | None = None   # the verdict on a user's draft (conformance/user/verdict.py), as data
    # What other processes of the same run found (pytest-xdist workers, merged by the controller): parts()
    absorbed: list[dict] = field(default_factory=list)
    timings: list[dict] = field(default_factory=list)   # wall-clock figures: TIMINGS_FILE, not the report

    @property
    def empty(self) -> bool:
        return not (self.entries or self.sections or self.verdict or self.absorbed or self.timings)

    def add_row(self, section: Section, row: dict) -> None:
        """One row of a section: JSON-able values; a table in report.md."""
        if not isinstance(section, Section):
            raise TypeError(f"report section {section!r}: name it with conformance.core.sections.Section")
        self.sections.setdefault(section, []).append(dict(row))

    def add_timing(self, row: dict) -> None:
        self.timings.append(dict(row))

    def add(self, comparison: Comparison, nodeid: str, outcome: str, note: str = "", known: str = "") -> None:
        self.entries.append(Entry(comparison, nodeid, outcome, comparison.case_id, comparison.impl,
                                  dtype_name(comparison.dtype), note, known))

    def add_load_failure(self, impl: str, case_id: str, dtype: str, nodeid: str, outcome: str, error: str,
                         known: str = "") -> None:
        self.entries.append(Entry(None, nodeid, outcome, case_id, impl, dtype, error, known))

    def parts(self) -> dict:
        """This process's findings as JSON data, for the process that writes the report (absorb)."""
        return _plain({"comparisons": [_comparison(e) for e in self.entries],
                       "sections": {s.value: rows for s, rows in self.sections.items()}, "verdict": self.verdict,
                       "timings": self.timings})

    def absorb(self, parts: dict) -> None:
        self.absorbed.append(parts)

    def to_json(self) -> dict:
        """Everything the report says, as data; every rendering starts here. Rows are sorted and taken as
        JSON data, so the report is the same however the tests were spread over processes."""
        v = versions()
        every = [self.parts(), *self.absorbed]
        comparisons = sorted((c for p in every for c in p["comparisons"]),
                             key=lambda c: (c["case"], c["impl"], c["dtype"], c["nodeid"]))
        sections = {s.value: sorted((r for p in every for r in p["sections"].get(s.value, ())),
                                    key=lambda r: json.dumps(r, sort_keys=True))
                    for s in Section if any(s.value in p["sections"] for p in every)}
        verdict = next((p["verdict"] for p in every if p["verdict"]), None)
        comparisons = [_as_explained(c, verdict) for c in comparisons]
        return {"tool": "eagle3-conformance", "versions": v, **({"verdict": verdict} if verdict else {}),
                "comparisons": comparisons, "support_matrix": support_matrix(comparisons, v, verdict),
                "default_drafts": default_drafts(comparisons, v), "sections": sections}

    def to_markdown(self) -> str:
        return report_render.markdown(self.to_json())

    def write(self, directory: Path) -> None:
        data = self.to_json()
        directory.mkdir(parents=True, exist_ok=True)
        _atomic_write(directory / "report.json", json.dumps(data, indent=1) + "\n")
        _atomic_write(directory / "report.md", report_render.markdown(data))
        report_render.write_chart(data, directory / CHART_FILE)
        report_render.write_accept_chart(data, directory / ACCEPT_CHART_FILE)
        timings = sorted((t for p in [self.parts(), *self.absorbed] for t in p.get("timings", ())),
                         key=lambda t: json.dumps(t, sort_keys=True))
        if timings:
            _atomic_write(directory / TIMINGS_FILE, json.dumps(timings, indent=1) + "\n")


def _plain(data):
    """The data as it reads back from JSON (tuples become lists, other objects their str)."""
    return json.loads(json.dumps(data, default=str))


def _comparison(e: Entry) -> dict:
    item = {"case": e.case_id, "impl": e.impl, "against": "reference", "dtype": e.dtype, "nodeid": e.nodeid,
            "outcome": e.outcome, "note": e.note, "known": e.known, "first_divergence": None, "stages": [],
            "notes": []}
    if e.comparison is None:
        item["first_divergence"] = {"step": 0, "stage": "load", "verdict": "load failed"}
        return item
    first = e.comparison.first_divergence
    if first is not None:
        # How the allowed error was made there (the tolerance formula): report.md's details, not the headline.
        item["first_divergence"] = {"step": first.step, "stage": first.stage, "verdict": first.verdict,
                                    "max_abs": _num(first.max_abs), "max_rel": _num(first.max_rel),
                                    "allowed": _num(first.allowed), "bound": first.bound}
    item["stages"] = [
        {"step": r.step, "stage": r.stage, "verdict": r.verdict, "max_abs": _num(r.max_abs),
         "max_rel": _num(r.max_rel), "excess": _num(r.excess), "abs_index": r.abs_index, "rel_index": r.rel_index,
         "mismatched": r.mismatched, "numel": r.numel,
         "atol": None if r.tol is None else r.tol.atol, "rtol": None if r.tol is None else r.tol.rtol,
         "detail": r.detail}
        for r in e.comparison.results]
    item["notes"] = list(e.comparison.notes)
    return item



def _as_explained(comparison: dict, verdict: dict | None) -> dict:
    """A failed comparison the verdict explains by a registered cause is a known divergence in the report too. The
    verdict decides that only at the end of the run: a forward divergence of an implementation that reads the file
    otherwise is folded into that reading problem (user/verdict.py finish), after the comparison was recorded."""
    problems = (verdict or {}).get("problems", ())
    explained = any(p["registry_id"] and comparison["nodeid"] in p["checks"] for p in problems)
    return {**comparison, "outcome": KNOWN} if explained and comparison["outcome"] == FAIL else comparison


def support_matrix(comparisons: list[dict], v: dict[str, str], verdict: dict | None = None) -> list[dict]:
    """Per case, per implementation: the worst outcome the tests found over dtypes and modes; on a user's
    draft, each cell also names the verdict's problems that concern it (problem_cells)."""
    cells: dict[str, dict[str, str]] = {}
    for c in comparisons:
        row = cells.setdefault(c["case"], {})
        first = c["first_divergence"]
        if c["outcome"] == FAIL:
            cell = "UNEXPECTED FAILURE"
        elif c["outcome"] == KNOWN:
            cell = ("diverges: load" if first is None or first["stage"] == "load"
                    else f"diverges: step {first['step']} `{first['stage']}`")
        else:
            cell = "safe"
        if _severity(cell) > _severity(row.get(c["impl"])):
            row[c["impl"]] = cell
    impls = sorted({c["impl"] for c in comparisons})
    for (case, impl), problems in problem_cells(comparisons, verdict, impls).items():
        found = cells[case].get(impl, "not run")
        cells[case][impl] = ", ".join(problems) + ("" if found in ("safe", "not run") else f": {found}")
    columns = {impl: f"{impl} {v.get(ADAPTERS[impl].package if impl in ADAPTERS else None, '?')}" for impl in impls}
    return [{"case": case, **{columns[i]: row.get(i, "not run") for i in impls}} for case, row in cells.items()]


def default_drafts(comparisons: list[dict], v: dict[str, str]) -> list[dict]:
    """Each trainer's default draft (fixtures/cases.py DEFAULT_CASES), per server: served as trained when every
    comparison of it passed (step 0 and K = DEFAULT_STEPS, every dtype and mode), else the earliest first divergence
    over them and the registry entry that explains it (none: an unexpected failure); no rows when none of them ran."""
    if not {c["case"] for c in comparisons} & {case.id for case in DEFAULT_CASES}:
        return []
    rows = []
    for case in DEFAULT_CASES:
        for impl, adapter in ADAPTERS.items():
            if adapter.is_server:
                served = [c for c in comparisons if c["case"] == case.id and c["impl"] == impl]
                version = v.get(adapter.package, "not installed")
                server = impl if version == "not installed" else f"{impl} {version}"
                rows.append({"default draft": case.id, "trained by": case.default_of, "server": server,
                             **_served(served, adapter)})
    return rows


def _served(comparisons: list[dict], adapter) -> dict:
    """One server's verdict on one draft from its comparisons with the reference."""
    if not comparisons:
        why = adapter.missing()
        return {"served": f"not run ({why})" if why else "not run", "first divergent stage": "", "registry entry": ""}
    failed = [c for c in comparisons if c["outcome"] == FAIL]
    parted = failed or [c for c in comparisons if c["outcome"] == KNOWN]
    if not parted:
        return {"served": "as trained", "first divergent stage": "", "registry entry": ""}
    firsts = [c["first_divergence"] for c in parted if c["first_divergence"]]
    first = min(firsts, key=_forward_order(firsts)) if firsts else None
    where = ("none (no stage diverged)" if first is None else "load" if first["stage"] == "load"
             else f"step {first['step']} `{first['stage']}`")
    explained = sorted({c["known"] for c in parted if c["known"]})
    return {"served": "UNEXPECTED FAILURE" if failed else "differently", "first divergent stage": where,
            "registry entry": ", ".join(explained) or "none"}


def _forward_order(firsts: list[dict]):
    """A key ordering first divergences by where they depart: a refusal at load, then by step, then by stage in
    forward order (the draft's stage names, from its deepest layer among them)."""
    stages = [f["stage"] for f in firsts]
    names = stage_names(1 + max((int(s.split(".")[1]) for s in stages if s.startswith("layers.")), default=0))
    return lambda first: (-1, -1) if first["stage"] == "load" else (first["step"], names.index(first["stage"]))


def problem_cells(comparisons: list[dict], verdict: dict | None, impls: list[str]) -> dict[tuple[str, str], list]:
    """(case, implementation) -> "problem N (area)" for each of the verdict's problems that concerns it: the
    cases whose comparisons found it (every case when none did: wiring, settings, reading), in its
    implementation's column, else in the servers' columns (a problem of serving names no implementation),
    else in every column."""
    out: dict[tuple[str, str], list] = {}
    cases = list(dict.fromkeys(c["case"] for c in comparisons))
    servers = [i for i in impls if getattr(ADAPTERS.get(i), "serving_decode", False)]
    for p in (verdict or {}).get("problems", ()):
        found_by = [c["case"] for c in comparisons if c["nodeid"] in p["checks"]]
        columns = [p["impl"]] if p.get("impl") in impls else servers or impls
        label = f"problem {p['number']} ({p['area']}{', known' if p['registry_id'] else ''})"
        for case in dict.fromkeys(found_by or cases):
            for impl in columns:
                out.setdefault((case, impl), []).append(label)
    return out


def _severity(verdict: str | None) -> int:
    if verdict is None:
        return -1
    return 0 if verdict == "safe" else 2 if verdict.startswith("UNEXPECTED") else 1


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
