"""report.md, the per-stage chart and the terminal summary, rendered from the report's data
(`Report.to_json()`, conformance/session/report.py) and from nothing else."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from conformance.core.compare import ABSENT, DIVERGED, MISSING
from conformance.core.sections import ACCEPT_CHART_FILE, ACCEPT_COLUMNS, ACCEPT_SECTION, FAIL, KNOWN, PASS
from conformance.core.stages import stage_kind, stage_names

CHART_FILE = "stage_error.png"
CHART_FLOOR = 1e-12   # exact stages are drawn here on the log scale
Summary = dict[tuple[str, str], dict[tuple[int, str], tuple[float | None, float | None, int]]]


def first_divergences(data: dict) -> list[tuple[str, ...]]:
    """One row per comparison that did not pass: outcome, pair, case, dtype, first divergent stage, reason."""
    rows = []
    for c in data["comparisons"]:
        if c["outcome"] == PASS:
            continue
        f = c["first_divergence"]
        if f is None:
            where = "none (no stage diverged)"
        elif f["verdict"] == "load failed":
            where = "load"
        else:
            where = f"step {f['step']} `{f['stage']}`"
            if f["max_abs"] is not None:
                where += f" (max abs {f['max_abs']:.3e}, max rel {f['max_rel']:.3e})"
        rows.append((c["outcome"], f"{c['impl']} vs {c['against']}", c["case"], c["dtype"], where, c["note"]))
    return rows


def stage_summary(data: dict) -> Summary:
    """(pair, dtype) -> (step, stage) -> (max abs, max rel, cases diverged) over all comparisons that are
    not known divergences (those are listed on their own), in forward order."""
    out: Summary = {}
    for c in data["comparisons"]:
        if not c["stages"] or c["outcome"] == KNOWN:
            continue
        table = out.setdefault((f"{c['impl']} vs {c['against']}", c["dtype"]), {})
        for r in c["stages"]:
            key, failed = (r["step"], r["stage"]), int(r["verdict"] in (DIVERGED, MISSING))
            a, m, n = table.get(key, (None, None, 0))
            if r["verdict"] == ABSENT or r["max_abs"] is None:
                table[key] = (a, m, n + failed)
            else:
                table[key] = (max(a or 0.0, r["max_abs"]), max(m or 0.0, r["max_rel"]), n + failed)
    layers = 1 + max((int(stage.split(".")[1]) for t in out.values() for _, stage in t if stage.startswith("layers.")),
                     default=0)
    order = {name: i for i, name in enumerate(stage_names(layers))}
    return {key: dict(sorted(t.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))) for key, t in out.items()}


def run_notes(data: dict) -> list[dict]:
    """What each implementation said about how it ran (Trace.notes), once per note, with the cases it
    was said for, counted among the cases that implementation ran ("all", "all but ...", or a list)."""
    ran: dict[str, set[str]] = {}
    said: dict[tuple[str, str], set[str]] = {}
    for c in data["comparisons"]:
        if c["stages"]:
            ran.setdefault(c["impl"], set()).add(c["case"])
        for note in c["notes"]:
            said.setdefault((c["impl"], note), set()).add(c["case"])
    rows = []
    for (impl, note), ids in sorted(said.items()):
        rest = ran[impl] - ids
        cases = "all" if not rest else f"all but {', '.join(sorted(rest))}" if len(rest) < len(ids) \
            else ", ".join(sorted(ids))
        rows.append({"impl": impl, "note": note, "cases": cases})
    return rows


def markdown(data: dict) -> str:
    comparisons = data["comparisons"]
    n = len(comparisons)
    fails = sum(c["outcome"] == FAIL for c in comparisons)
    known = sum(c["outcome"] == KNOWN for c in comparisons)
    md = ["# EAGLE-3 conformance report", ""]
    if data.get("verdict"):   # a user's draft: the answer first, exactly as the terminal shows it
        md += ["## Verdict", "", "```", *verdict_lines(data["verdict"]), "```", ""]
    md += [f"{n} comparisons: {n - fails - known} conform, {known} known divergences, {fails} unexpected failures.", "",
          "Versions: " + ", ".join(f"{k} {val}" for k, val in data["versions"].items()), "",
          "## First divergences", ""]
    first = first_divergences(data)
    if first:
        md += table(["outcome", "pair", "case", "dtype", "first divergent stage", "reason"], first)
    else:
        md.append("None: every implementation matched the reference at every compared stage.")
    if data["support_matrix"]:
        md += ["", "## Support matrix (from the tests that ran; worst outcome over dtypes and modes)", ""]
        md += _rows_table(data["support_matrix"])
    md += ["", "## Per step and stage, max error over all cases (known divergences excluded)", "",
           f"![per-stage error per implementation]({CHART_FILE})", ""]
    for (pair, dtype), stages in stage_summary(data).items():
        md += [f"### {pair}, {dtype}", ""]
        md += table(["step", "stage", "max abs", "max rel", "cases diverged"],
                    [(step, stage, "absent" if a is None else f"{a:.3e}", "" if m is None else f"{m:.3e}", cnt or "")
                     for (step, stage), (a, m, cnt) in stages.items()])
        md.append("")
    notes = run_notes(data)
    if notes:
        md += ["## How each implementation ran", "", *_rows_table(notes), ""]
    for name, rows in data["sections"].items():
        md += [f"## {name}", "", *_rows_table(rows), ""]
        if name == ACCEPT_SECTION:
            md += [f"![accept length per K: predicted, measured, simulated]({ACCEPT_CHART_FILE})", ""]
    return "\n".join(md) + "\n"


VERDICT_FIELDS = ("where", "evidence", "cause", "fix")


def verdict_lines(v: dict) -> list[str]:
    """The verdict on a user's draft: the one line, what was judged, then each problem numbered."""
    lines = [f"VERDICT: {v['headline']}"]
    keys = ("draft", "trainer", "served_as", "inputs")
    lines += [f"  {key.replace('_', ' ')}: {v[key]}" for key in keys if v.get(key)]
    c = v["checks"]
    skipped = f", {c['skipped']} skipped" if c["skipped"] else ""
    lines.append(f"  checks: {c['passed']} passed, {c['failed']} failed{skipped}")
    if v.get("not_checked") and v.get("outcome") != "not checked":   # else the headline says it already
        lines.append("  not checked: " + ", ".join(f"{n['what']} ({n['how']})" for n in v["not_checked"]))
    if v.get("not_run"):
        lines.append("  nothing to check: " + "; ".join(f"{n['what']} ({n['why']})" for n in v["not_run"]))
    lines.append("  versions: " + ", ".join(f"{k} {val}" for k, val in v["versions"].items()))
    for p in v["problems"]:
        lines.append(f"{p['number']}. {p['what']}")
        lines += [f"   {f + ':':<9} {p[f]}" for f in VERDICT_FIELDS]
    if v.get("fixes"):   # pasteable from any directory: the fixes a command applies, then the check again
        numbers = ", ".join(map(str, v["fixes"]["problems"]))
        lines.append(f"fix {numbers} and check again (paste from any directory):")
        lines += [f"  {command}" for command in v["fixes"]["commands"]]
    return lines


def terminal_lines(data: dict) -> list[str]:
    """The end-of-session summary: first divergences, then per pair and dtype the per-stage max errors."""
    lines = []
    first = first_divergences(data)
    if first:
        lines.append("first divergences (outcome | pair | case | dtype | stage | reason):")
        lines += ["  " + " | ".join(str(x) for x in row).rstrip(" |") for row in first]
    for (pair, dtype), stages in stage_summary(data).items():
        lines.append(f"{pair} [{dtype}]: max over cases")
        lines.append(f"  {'step':>4}  {'stage':<28} {'max_abs':>10} {'max_rel':>10}  diverged")
        for (step, stage), (a, m, n) in stages.items():
            fa = "-" if a is None else f"{a:.3e}"
            fm = "-" if m is None else f"{m:.3e}"
            lines.append(f"  {step:>4}  {stage:<28} {fa:>10} {fm:>10}  {n or ''}")
    return lines


def table(columns: list[str], rows) -> list[str]:
    """A markdown table; cells on one line, pipes escaped."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(_cell(x) for x in row) + " |" for row in rows)]


def _rows_table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    return table(columns, [[r.get(c) for c in columns] for r in rows])


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_chart(data: dict, path: Path) -> None:
    """A PNG of max abs error per stage (log scale), one line per implementation pair and dtype,
    one panel per draft step; a red cross where a stage diverged. Deterministic: no metadata."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    # Id stages count mismatches, not errors: they stay in the tables, not on this axis.
    summary = {pair: {k: v for k, v in stages.items() if stage_kind(k[1]) != "ids"}
               for pair, stages in stage_summary(data).items()}
    keys = {key for stages in summary.values() for key in stages}               # (step, stage)
    layers = 1 + max((int(stage.split(".")[1]) for _, stage in keys if stage.startswith("layers.")), default=0)
    rank = {name: i for i, name in enumerate(stage_names(layers))}
    steps = sorted({step for step, _ in keys}) or [0]
    width = max(8.0, 0.22 * max((sum(1 for k in keys if k[0] == s) for s in steps), default=0))
    fig = Figure(figsize=(width, 1.0 + 2.6 * len(steps)), dpi=100)
    axes = fig.subplots(len(steps), 1, squeeze=False)[:, 0]
    for ax, step in zip(axes, steps):
        stages = sorted((st for s, st in keys if s == step), key=rank.__getitem__)
        x = {st: i for i, st in enumerate(stages)}
        for (pair, dtype), errors in summary.items():
            here = [(x[st], a, n) for (s, st), (a, _, n) in errors.items() if s == step]
            drawn = [(i, max(a, CHART_FLOOR)) for i, a, _ in here if a is not None]
            if drawn:
                ax.plot(*zip(*drawn), marker=".", linewidth=1, label=f"{pair}, {dtype}")
            bad = [(i, max(a or CHART_FLOOR, CHART_FLOOR)) for i, a, n in here if n]
            if bad:
                ax.scatter(*zip(*bad), marker="x", color="red", zorder=3)
        ax.set_yscale("log")
        ax.set_ylabel(f"step {step}: max abs error", fontsize=8)
        ax.set_xticks(range(len(stages)), stages, rotation=90, fontsize=6)
    axes[0].set_title(f"max abs error vs the reference per stage (floor {CHART_FLOOR:g}; red x: diverged)", fontsize=9)
    if summary:
        axes[0].legend(fontsize=7)
    _save_png(fig, path)


def write_accept_chart(data: dict, path: Path) -> None:
    """A PNG of accept length per chain K from the accept-length section's rows (nothing written when the
    engine lane did not run): the prediction, SGLang's measurement and the simulation (drawn over it:
    equal when the engine conforms), and SGLang's per-round figure. Deterministic: no metadata."""
    rows = sorted(data["sections"].get(ACCEPT_SECTION, []), key=lambda r: r["K"])
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    predicted, measured, simulated, per_round, _ = ACCEPT_COLUMNS
    styles = ((predicted, dict(marker="o", linestyle="-")), (measured, dict(marker="s", linestyle="-", markersize=9)),
              (simulated, dict(marker="x", linestyle="none", markersize=9, color="black", zorder=3)),
              (per_round, dict(marker="^", linestyle="--")))
    fig = Figure(figsize=(7.0, 4.2), dpi=100)
    ax = fig.subplots()
    ks = [r["K"] for r in rows]
    for column, style in styles:
        ax.plot(ks, [r[column] for r in rows], label=column, **style)
    ax.set_xticks(ks)
    ax.set_xlabel("chain draft steps K")
    ax.set_ylabel("accept length (tokens per verify round)")
    ax.set_title("trained tiny draft: predicted vs SGLang engine vs reference simulation", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save_png(fig, path)


def _save_png(fig, path: Path) -> None:
    """Written atomically, without metadata (no software version, no date): identical inputs, identical bytes."""
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, format="png", metadata={"Software": None})
    os.replace(tmp, path)
