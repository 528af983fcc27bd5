"""The conformance report: report.json (everything) and report.md (first divergences at the top).

Tests add their Comparisons to one session-wide Report (conftest.py); it is written atomically at
session end, also when tests fail. No timestamps: identical inputs give identical reports.
"""
from __future__ import annotations

import json
import os
import platform
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from conformance.core.compare import ABSENT, Comparison
from conformance.core.stages import stage_kind, stage_names
from conformance.core.tolerances import dtype_name

PACKAGES = ("torch", "sglang", "speculators", "transformers", "safetensors", "hypothesis", "pytest")
CHART_FILE = "stage_error.png"
CHART_FLOOR = 1e-12   # exact stages are drawn here on the log scale


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _num(x):
    return None if x is None else float(f"{x:.6g}")


@dataclass
class Entry:
    comparison: Comparison | None
    nodeid: str
    outcome: str                      # "pass" | "known divergence" | "FAIL"
    case_id: str
    impl: str
    dtype: str
    note: str = ""                    # known-divergence reason, or a load error


@dataclass
class Report:
    entries: list[Entry] = field(default_factory=list)
    sections: dict[str, list[dict]] = field(default_factory=dict)   # extra report sections: title -> rows

    def add_row(self, section: str, row: dict) -> None:
        """One row of a named section (e.g. "wiring"): JSON-able values; shown as a table in report.md."""
        self.sections.setdefault(section, []).append(row)

    def add(self, comparison: Comparison, nodeid: str, outcome: str, note: str = "") -> None:
        self.entries.append(Entry(comparison, nodeid, outcome, comparison.case_id, comparison.impl,
                                  dtype_name(comparison.dtype), note))

    def add_load_failure(self, impl: str, case_id: str, dtype: str, nodeid: str, outcome: str, error: str) -> None:
        self.entries.append(Entry(None, nodeid, outcome, case_id, impl, dtype, error))

    def sorted_entries(self) -> list[Entry]:
        return sorted(self.entries, key=lambda e: (e.case_id, e.impl, e.dtype, e.nodeid))

    # ------------------------------------------------------------ json
    def to_json(self) -> dict:
        comparisons = []
        for e in self.sorted_entries():
            item = {"case": e.case_id, "impl": e.impl, "against": "reference", "dtype": e.dtype,
                    "nodeid": e.nodeid, "outcome": e.outcome, "note": e.note, "first_divergence": None, "stages": []}
            if e.comparison is None:
                item["first_divergence"] = {"step": 0, "stage": "load", "verdict": "load failed"}
            else:
                first = e.comparison.first_divergence
                if first is not None:
                    item["first_divergence"] = {"step": first.step, "stage": first.stage, "verdict": first.verdict,
                                                "max_abs": _num(first.max_abs), "max_rel": _num(first.max_rel)}
                item["stages"] = [
                    {"step": r.step, "stage": r.stage, "verdict": r.verdict, "max_abs": _num(r.max_abs),
                     "max_rel": _num(r.max_rel), "abs_index": r.abs_index, "rel_index": r.rel_index,
                     "mismatched": r.mismatched, "numel": r.numel,
                     "atol": None if r.tol is None else r.tol.atol, "rtol": None if r.tol is None else r.tol.rtol,
                     "detail": r.detail}
                    for r in e.comparison.results]
            comparisons.append(item)
        sections = {name: sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))
                    for name, rows in sorted(self.sections.items())}
        return {"tool": "eagle3-conformance", "versions": versions(), "comparisons": comparisons, "sections": sections}

    # ------------------------------------------------------------ markdown
    def stage_summary(self) -> dict[tuple[str, str], dict[tuple[int, str], tuple[float, float, int]]]:
        """(pair, dtype) -> (step, stage) -> (max abs, max rel, failures) over all cases that are not known
        divergences, in forward order."""
        out: dict = {}
        for e in self.sorted_entries():
            if e.comparison is None or e.outcome == "known divergence":   # those are listed on their own
                continue
            table = out.setdefault((f"{e.impl} vs reference", e.dtype), {})
            for r in e.comparison.results:
                if r.verdict == ABSENT or r.max_abs is None:
                    table.setdefault((r.step, r.stage), (None, None, 0))
                    if r.failed:
                        a, m, n = table[(r.step, r.stage)]
                        table[(r.step, r.stage)] = (a, m, n + 1)
                    continue
                a, m, n = table.get((r.step, r.stage), (None, None, 0))
                table[(r.step, r.stage)] = (max(a or 0.0, r.max_abs), max(m or 0.0, r.max_rel), n + int(r.failed))
        layers = 1 + max((int(stage.split(".")[1]) for t in out.values() for _, stage in t if stage.startswith("layers.")),
                         default=0)
        order = {name: i for i, name in enumerate(stage_names(layers))}
        return {key: dict(sorted(t.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))) for key, t in out.items()}

    def stage_table_text(self) -> str:
        lines = []
        for (pair, dtype), table in self.stage_summary().items():
            lines.append(f"{pair} [{dtype}]: max over cases")
            lines.append(f"  {'step':>4}  {'stage':<28} {'max_abs':>10} {'max_rel':>10}  diverged")
            for (step, stage), (a, m, n) in table.items():
                fa = "-" if a is None else f"{a:.3e}"
                fm = "-" if m is None else f"{m:.3e}"
                lines.append(f"  {step:>4}  {stage:<28} {fa:>10} {fm:>10}  {n or ''}")
        return "\n".join(lines)

    def first_divergence_lines(self) -> list[str]:
        lines = []
        for e in self.sorted_entries():
            if e.outcome == "pass":
                continue
            if e.comparison is None:
                where = "load"
                err = ""
            else:
                f = e.comparison.first_divergence
                where = "none (no stage diverged)" if f is None else f"step {f.step} `{f.stage}`"
                err = "" if f is None or f.max_abs is None else f" (max abs {f.max_abs:.3e}, max rel {f.max_rel:.3e})"
            lines.append(f"| {e.outcome} | {e.impl} vs reference | {e.case_id} | {e.dtype} | {where}{err} | {e.note} |")
        return lines

    def support_matrix(self) -> list[dict]:
        """Per case, per implementation: what the tests found (all dtypes and modes together)."""
        cells: dict[str, dict[str, str]] = {}
        for e in self.sorted_entries():
            row = cells.setdefault(e.case_id, {})
            if e.outcome == "FAIL":
                verdict = "UNEXPECTED FAILURE"
            elif e.outcome == "known divergence":
                f = None if e.comparison is None else e.comparison.first_divergence
                verdict = "diverges: load" if f is None else f"diverges: step {f.step} `{f.stage}`"
            else:
                verdict = "safe"
            if _severity(verdict) > _severity(row.get(e.impl)):   # the worst outcome over dtypes and modes
                row[e.impl] = verdict
        impls = sorted({e.impl for e in self.entries})
        columns = {impl: f"{impl} {versions().get(impl, '?')}" for impl in impls}
        return [{"case": case, **{columns[i]: row.get(i, "not run") for i in impls}} for case, row in cells.items()]

    def to_markdown(self) -> str:
        v = versions()
        n = len(self.entries)
        fails = sum(e.outcome == "FAIL" for e in self.entries)
        known = sum(e.outcome == "known divergence" for e in self.entries)
        md = ["# EAGLE-3 conformance report", "",
              f"{n} comparisons: {n - fails - known} conform, {known} known divergences, {fails} unexpected failures.", "",
              "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()), "",
              "## First divergences", ""]
        first = self.first_divergence_lines()
        if first:
            md += ["| outcome | pair | case | dtype | first divergent stage | reason |", "|---|---|---|---|---|---|", *first]
        else:
            md.append("None: every implementation matched the reference at every compared stage.")
        md += ["", "## Per step and stage, max error over all cases (known divergences excluded)", "",
               f"![per-stage error per implementation]({CHART_FILE})", ""]
        for (pair, dtype), table in self.stage_summary().items():
            md += [f"### {pair}, {dtype}", "", "| step | stage | max abs | max rel | cases diverged |", "|---|---|---|---|---|"]
            for (step, stage), (a, m, cnt) in table.items():
                fa = "absent" if a is None else f"{a:.3e}"
                fm = "" if m is None else f"{m:.3e}"
                md.append(f"| {step} | {stage} | {fa} | {fm} | {cnt or ''} |")
            md.append("")
        for name, rows in self.to_json()["sections"].items():
            columns = list(dict.fromkeys(k for r in rows for k in r))
            md += [f"## {name}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            md += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
            md.append("")
        return "\n".join(md) + "\n"

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        _atomic_write(directory / "report.json", json.dumps(self.to_json(), indent=1) + "\n")
        _atomic_write(directory / "report.md", self.to_markdown())
        self.write_chart(directory / CHART_FILE)

    def write_chart(self, path: Path) -> None:
        """A PNG of max abs error per stage (log scale), one line per implementation pair and dtype,
        one panel per draft step; a red cross where a stage diverged. Deterministic: no metadata."""
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure

        # Id stages count mismatches, not errors: they stay in the tables, not on this axis.
        summary = {pair: {k: v for k, v in table.items() if stage_kind(k[1]) != "ids"}
                   for pair, table in self.stage_summary().items()}
        keys = {key for table in summary.values() for key in table}               # (step, stage)
        layers = 1 + max((int(stage.split(".")[1]) for _, stage in keys if stage.startswith("layers.")), default=0)
        rank = {name: i for i, name in enumerate(stage_names(layers))}
        steps = sorted({step for step, _ in keys}) or [0]
        width = max(8.0, 0.22 * max((sum(1 for k in keys if k[0] == s) for s in steps), default=0))
        fig = Figure(figsize=(width, 1.0 + 2.6 * len(steps)), dpi=100)
        axes = fig.subplots(len(steps), 1, squeeze=False)[:, 0]
        for ax, step in zip(axes, steps):
            stages = sorted((st for s, st in keys if s == step), key=rank.__getitem__)
            x = {st: i for i, st in enumerate(stages)}
            for (pair, dtype), table in summary.items():
                rows = [(x[st], max(a, CHART_FLOOR), n) for (s, st), (a, _, n) in table.items() if s == step and a is not None]
                if rows:
                    ax.plot([r[0] for r in rows], [r[1] for r in rows], marker=".", linewidth=1, label=f"{pair}, {dtype}")
                bad = [(x[st], max(a or CHART_FLOOR, CHART_FLOOR)) for (s, st), (a, _, n) in table.items() if s == step and n]
                if bad:
                    ax.scatter(*zip(*bad), marker="x", color="red", zorder=3)
            ax.set_yscale("log")
            ax.set_ylabel(f"step {step}: max abs error", fontsize=8)
            ax.set_xticks(range(len(stages)), stages, rotation=90, fontsize=6)
        axes[0].set_title(f"max abs error vs the reference per stage (floor {CHART_FLOOR:g}; red x: diverged)", fontsize=9)
        if summary:
            axes[0].legend(fontsize=7)
        fig.tight_layout()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", metadata={"Software": None})
        os.replace(tmp, path)


def _severity(verdict: str | None) -> int:
    if verdict is None:
        return -1
    return 0 if verdict == "safe" else 2 if verdict.startswith("UNEXPECTED") else 1


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
