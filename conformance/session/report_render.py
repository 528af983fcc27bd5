"""report.md, the per-stage chart and the terminal summary, rendered from the report's data
(`Report.to_json()`, conformance/session/report.py) and from nothing else."""
from __future__ import annotations

import os
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from conformance.core.compare import ABSENT, DIVERGED, MISSING
from conformance.core.sections import ACCEPT_CHART_FILE, ACCEPT_COLUMNS, ACCEPT_SECTION, FAIL, KNOWN, PASS
from conformance.core.stages import stage_kind, stage_names

CHART_FILE = "stage_error.png"
DEFAULT_DRAFTS_TITLE = "Each trainer's default draft: served as trained?"
Summary = dict[tuple[str, str], dict[tuple[int, str], "StageRow"]]


class StageRow(NamedTuple):
    """One stage of one pair and dtype, over the cases: the largest errors, and in how many cases it diverged."""

    max_abs: float | None
    max_rel: float | None
    excess: float | None     # the largest error / allowed error (1: the tolerance; None for id stages)
    diverged: int


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


def charted(data: dict) -> list[dict]:
    """The comparisons the per-stage tables and the chart show: on a user's draft every one (a known divergence
    is a problem of its verdict); in the built-in matrix not the known divergences (listed on their own), so
    that one case's registered divergence does not hide how the other cases conform."""
    return [c for c in data["comparisons"] if c["stages"] and (data.get("verdict") or c["outcome"] != KNOWN)]


def stage_summary(data: dict) -> Summary:
    """(pair, dtype) -> (step, stage) -> StageRow over the charted comparisons, in forward order."""
    out: Summary = {}
    for c in charted(data):
        table = out.setdefault((f"{c['impl']} vs {c['against']}", c["dtype"]), {})
        for r in c["stages"]:
            key, failed = (r["step"], r["stage"]), int(r["verdict"] in (DIVERGED, MISSING))
            a, m, x, n = table.get(key, StageRow(None, None, None, 0))
            if r["verdict"] == ABSENT or r["max_abs"] is None:
                table[key] = StageRow(a, m, x, n + failed)
            else:
                table[key] = StageRow(max(a or 0.0, r["max_abs"]), max(m or 0.0, r["max_rel"]),
                                      _max(x, r.get("excess")), n + failed)
    layers = 1 + max((int(stage.split(".")[1]) for t in out.values() for _, stage in t if stage.startswith("layers.")),
                     default=0)
    order = {name: i for i, name in enumerate(stage_names(layers))}
    return {key: dict(sorted(t.items(), key=lambda kv: (kv[0][0], order[kv[0][1]]))) for key, t in out.items()}


def _max(a: float | None, b: float | None) -> float | None:
    return a if b is None else b if a is None else max(a, b)


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
    """The verdict first (on a user's draft), then what agrees with it area by area, then the tables."""
    md = ["# EAGLE-3 conformance report", ""]
    if data.get("verdict"):   # a user's draft: the answer first, exactly as the terminal shows it
        md += ["## Verdict", "", "```", *verdict_lines(data["verdict"]), "```", ""]
    md += ["## Summary", "", *summary_lines(data), "",
           "Versions: " + ", ".join(f"{k} {val}" for k, val in data["versions"].items()), "",
           "## First divergences", "", *first_divergence_lines(data)]
    if data["support_matrix"]:
        md += ["", "## Support matrix (from the tests that ran; worst outcome over dtypes and modes)", ""]
        md += _rows_table(data["support_matrix"])
    if data.get("default_drafts"):
        md += ["", f"## {DEFAULT_DRAFTS_TITLE}", "",
               "The draft each trainer writes when no knob is set (fixtures/cases.py DEFAULT_CASES), per server: every "
               "comparison of it with the reference (step 0 and multi-step, each dtype and mode) passed, or where it "
               "first departs and the registry entry that explains it (docs/registry.md).", ""]
        md += _rows_table(data["default_drafts"])
    if details := detail_lines(data):
        md += ["", "## Details", "", *details]
    md.append("")
    for name, rows in data["sections"].items():
        md += [f"## {name}", "", *_rows_table(rows), ""]
        if name == ACCEPT_SECTION:
            md += [f"![accept length per K: predicted, measured, simulated]({ACCEPT_CHART_FILE})", ""]
    notes = run_notes(data)
    if notes:
        md += ["## How each implementation ran", "", *_rows_table(notes), ""]
    which = "every comparison" if data.get("verdict") else "known divergences excluded"
    md += [f"## Per step and stage, max error over all cases ({which})", "",
           f"![per-stage error / allowed error per implementation pair]({CHART_FILE})", ""]
    for (pair, dtype), stages in stage_summary(data).items():
        md += [f"### {pair}, {dtype}", ""]
        md += table(["step", "stage", "max abs", "max rel", "err/allowed", "cases diverged"],
                    [(step, stage, "absent" if r.max_abs is None else f"{r.max_abs:.3e}",
                      "" if r.max_rel is None else f"{r.max_rel:.3e}", "" if r.excess is None else f"{r.excess:.3g}",
                      r.diverged or "") for (step, stage), r in stages.items()])
        md.append("")
    return "\n".join(md) + "\n"


def summary_lines(data: dict) -> list[str]:
    """The counts: on a user's draft the verdict's problems of every area first (a registered cause is a known
    divergence), what was not checked, then the forward comparisons, named as the forward's alone."""
    comparisons = data["comparisons"]
    n = len(comparisons)
    fails = sum(c["outcome"] == FAIL for c in comparisons)
    known = sum(c["outcome"] == KNOWN for c in comparisons)
    forward = f"{n} comparisons: {n - fails - known} conform, {known} known divergences, {fails} unexpected failures."
    v = data.get("verdict")
    if not v:
        return [forward]
    lines = [f"**{v['outcome']}**: {problem_tally(v['problems'])}."]
    if v["not_checked"]:
        lines.append("Not checked: " + ", ".join(f"{x['what']} ({x['how']})" for x in v["not_checked"]) + ".")
    return [*lines, f"The forward, stage by stage against the reference: {forward}"]


def problem_tally(problems: list[dict]) -> str:
    """"2 problems, by area: wiring 1 (problem 1); settings 1 (problem 2); 1 known (...), 1 not registered"."""
    if not problems:
        return "no problem in any area that was checked"
    by_area: dict[str, list[int]] = {}
    for p in problems:
        by_area.setdefault(p["area"], []).append(p["number"])
    areas = "; ".join(f"{area} {len(ns)} (problem{'' if len(ns) == 1 else 's'} {', '.join(map(str, ns))})"
                      for area, ns in by_area.items())
    known = sum(bool(p["registry_id"]) for p in problems)
    return f"{_plural(len(problems), 'problem')}, by area: {areas}; {known} known (a registered cause), " \
           f"{len(problems) - known} not registered"


def _known(problem: dict) -> str:
    return "known" if problem["registry_id"] else "not registered"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def first_divergence_lines(data: dict) -> list[str]:
    """Where each problem of the verdict first departs (every area), then the comparisons that did not pass."""
    v, first = data.get("verdict"), first_divergences(data)
    lines = []
    if v and v["problems"]:
        lines += table(["problem", "area", "cause", "implementation", "where it first departs"],
                       [(p["number"], p["area"], _known(p), p.get("impl") or "",
                         p["where"]) for p in v["problems"]])
        if first:
            lines += ["", "The forward comparisons behind them:", ""]
    if first:
        lines += table(["outcome", "pair", "case", "dtype", "first divergent stage", "reason"], first)
    if not lines:
        lines.append("None: no check that ran found a problem." if v else
                     "None: every implementation matched the reference at every compared stage.")
    return lines


def detail_lines(data: dict) -> list[str]:
    """What the headline leaves out: each problem's registry entry and the checks that found it, and how the
    allowed error was made at each first divergence (the tolerance formula)."""
    lines = []
    problems = (data.get("verdict") or {}).get("problems", ())
    if problems:
        lines += table(["problem", "area", "registry entry (docs/registry.md)", "found by"],
                       [(p["number"], p["area"], p["registry_id"] or "none: not a registered divergence",
                         ", ".join(p["checks"])) for p in problems])
    bounds = [(f"{c['impl']} vs {c['against']}", c["case"], c["dtype"], f"step {f['step']} `{f['stage']}`",
               f"{f['max_abs']:.3e}", "" if f["allowed"] is None else f"{f['allowed']:.3e}", f["bound"])
              for c in data["comparisons"] if (f := c["first_divergence"]) and f.get("bound")]
    if bounds:
        lines += [*([""] if lines else []), "The allowed error at each first divergence (the error model of "
                  "conformance/core/tolerances.py):", "",
                  *table(["pair", "case", "dtype", "first divergent stage", "max abs", "allowed there",
                          "allowed error"], bounds)]
    return lines


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
    """The end-of-session summary: each server's verdict on each trainer's default draft, the first divergences,
    then per pair and dtype the per-stage max errors."""
    lines = []
    if data.get("default_drafts"):
        lines.append("each trainer's default draft (draft | trained by | server | served | first divergent stage | "
                     "registry entry):")
        lines += ["  " + " | ".join(str(x) for x in row.values()).rstrip(" |") for row in data["default_drafts"]]
    first = first_divergences(data)
    if first:
        lines.append("first divergences (outcome | pair | case | dtype | stage | reason):")
        lines += ["  " + " | ".join(str(x) for x in row).rstrip(" |") for row in first]
    for (pair, dtype), stages in stage_summary(data).items():
        lines.append(f"{pair} [{dtype}]: max over cases")
        lines.append(f"  {'step':>4}  {'stage':<28} {'max_abs':>10} {'max_rel':>10}  diverged")
        for (step, stage), (a, m, _, n) in stages.items():
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


# The per-stage chart: error / allowed error, so that the tolerance is the same line (1) at every stage and dtype.
RATIO_FLOOR, RATIO_CEILING = 1e-6, 1e4   # an exact stage is drawn at the floor, a missing one at the ceiling
DIVERGED_COLOUR, DOWNSTREAM_COLOUR = "tab:red", "tab:gray"   # reserved: a first divergence, and what comes after it
PAIR_COLOURS = ("tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:cyan", "tab:pink", "tab:olive")
DTYPE_STYLES = {"fp32": "-", "bf16": "--"}
OK_POINT, FIRST, AFTER = "ok", "first divergence", "downstream"
ROW_INCHES = 0.16   # a listed problem's line under the panels


@dataclass(frozen=True)
class Line:
    label: str                                         # "pair, dtype"
    colour: str
    style: str
    points: tuple[tuple[int, str, float, str], ...]   # (step, stage, error/allowed as drawn, OK_POINT | FIRST | AFTER)


@dataclass(frozen=True)
class Mark:
    problem: int                      # numbered as the verdict numbers it
    text: str                         # as the chart lists it
    at: tuple[int, str] | None        # a forward problem's first divergence, also marked on its panel


@dataclass(frozen=True)
class Chart:
    title: str
    panels: tuple[tuple[int, tuple[str, ...]], ...]   # per draft step, its stages in forward order
    lines: tuple[Line, ...]
    marks: tuple[Mark, ...]           # one per problem of the verdict, whatever its area
    notes: tuple[str, ...]            # what the verdict did not check


def chart_plan(data: dict) -> Chart:
    """What write_chart draws, as data: per pair and dtype its line of error / allowed error per stage (a colour
    per pair, never DIVERGED_COLOUR or DOWNSTREAM_COLOUR), the first divergence and what follows it (downstream, not a
    recovery: drawn grey), and on a user's draft a mark for each problem of the verdict."""
    summary = stage_summary(data)
    colour = {pair: PAIR_COLOURS[i % len(PAIR_COLOURS)] for i, pair in enumerate(sorted({p for p, _ in summary}))}
    lines, keys = [], {}
    for (pair, dtype), stages in summary.items():
        points, state = [], OK_POINT
        for (step, stage), r in stages.items():
            state = AFTER if state in (FIRST, AFTER) else FIRST if r.diverged else OK_POINT
            # Id stages count mismatches, not errors: they stay in the tables, not on this axis.
            if stage_kind(stage) == "ids" or (r.excess is None and not r.diverged):
                continue
            y = RATIO_CEILING if r.excess is None else min(max(r.excess, RATIO_FLOOR), RATIO_CEILING)
            points.append((step, stage, y, state))
            keys[(step, stage)] = None
        lines.append(Line(f"{pair}, {dtype}", colour[pair], DTYPE_STYLES.get(dtype, ":"), tuple(points)))
    steps = sorted({step for step, _ in keys}) or [0]
    panels = tuple((step, tuple(stage for s, stage in keys if s == step)) for step in steps)   # keys: forward order
    v = data.get("verdict")
    title = "error / allowed error vs the reference per stage (1: the tolerance)"
    if not v:
        return Chart(title, panels, tuple(lines), (), ())
    marks = []
    for p in v["problems"]:
        firsts = [c["first_divergence"] for c in charted(data) if c["nodeid"] in p["checks"] and c["first_divergence"]]
        at = next(((f["step"], f["stage"]) for f in firsts if (f["step"], f["stage"]) in keys), None)
        marks.append(Mark(p["number"], f"{p['number']}. {p['area']}, {_known(p)}: {p['what']}", at))
    notes = tuple(f"not checked: {x['what']} ({x['how']})" for x in v["not_checked"])
    return Chart(f"VERDICT: {v['headline']}\n{title}", panels, tuple(lines), tuple(marks), notes)


def write_chart(data: dict, path: Path) -> None:
    """A PNG of chart_plan: one panel per draft step, the tolerance drawn at 1, a red x at each line's first
    divergence and the line grey after it; below, the verdict's problems numbered as it numbers them (a wiring
    or settings problem has no stage, and is never a clean picture). Deterministic: no metadata."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    plan = chart_plan(data)
    header = [] if not plan.marks else [f"{_plural(len(plan.marks), 'problem')} of the verdict, numbered as it "
                                         "numbers them (a forward one also on its panel; report.md: where, evidence, "
                                         "cause, fix):"]
    listed = [(row, colour) for texts, colour in ((header, "black"), ([m.text for m in plan.marks], DIVERGED_COLOUR),
                                                  (plan.notes, "black"))
              for text in texts for row in textwrap.wrap(text, 150, subsequent_indent="   ")]
    width = max(8.0, 0.22 * max(len(stages) for _, stages in plan.panels))
    heights = [2.6] * len(plan.panels) + ([0.2 + ROW_INCHES * len(listed)] if listed else [])
    fig = Figure(figsize=(width, 1.6 + sum(heights)), dpi=100)
    axes = fig.subplots(len(heights), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for n, (ax, (step, stages)) in enumerate(zip(axes, plan.panels)):
        x = {stage: i for i, stage in enumerate(stages)}
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8, label="tolerance" if n == 0 else None)
        for line in plan.lines:
            here = [(x[st], y, state) for s, st, y, state in line.points if s == step]
            before = [(i, y) for i, y, state in here if state != AFTER]
            after = [(i, y) for i, y, state in here if state != OK_POINT]   # from the first divergence on
            if before:
                ax.plot(*zip(*before), color=line.colour, linestyle=line.style, marker=".", linewidth=1,
                        label=line.label if n == 0 else None)
            if len(after) > 1 or (after and not before):
                ax.plot(*zip(*after), color=DOWNSTREAM_COLOUR, linestyle=":", marker=".", linewidth=1)
            for i, y, state in here:
                if state == FIRST:
                    ax.scatter([i], [y], marker="x", color=DIVERGED_COLOUR, s=40, zorder=3)
        for mark in plan.marks:
            if mark.at is not None and mark.at[0] == step:
                top = max(y for line in plan.lines for s, st, y, _ in line.points if (s, st) == mark.at)
                ax.annotate(str(mark.problem), (x[mark.at[1]], top), xytext=(0, 6), textcoords="offset points",
                            ha="center", color=DIVERGED_COLOUR, fontsize=8, fontweight="bold")
        ax.set_yscale("log")
        ax.set_ylim(RATIO_FLOOR / 3, RATIO_CEILING * 30)
        ax.set_ylabel(f"step {step}: error / allowed", fontsize=8)
        ax.set_xticks(range(len(stages)), stages, rotation=90, fontsize=6)
    fig.suptitle(f"{plan.title}\nred x: first divergence; grey dotted: downstream of it; {RATIO_FLOOR:g}: exact",
                 fontsize=9)
    axes[0].legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, frameon=False)
    if listed:
        ax = axes[-1]
        ax.axis("off")
        for i, (row, colour) in enumerate(listed):
            ax.annotate(row, (0.0, 1.0), xycoords="axes fraction", xytext=(0, -72 * ROW_INCHES * i),
                        textcoords="offset points", va="top", ha="left", fontsize=7, color=colour)
    _save_png(fig, path)


def write_accept_chart(data: dict, path: Path) -> None:
    """A PNG of accept length per chain K from the accept-length section's rows (nothing written when no engine
    lane ran), per server (SGLang's engine lane, vLLM's, side by side): the prediction, the server's measurement
    and the simulation (drawn over it: equal when the engine conforms), and its per-round figure.
    Deterministic: no metadata."""
    # The default trainer's draft (its rows name no trainer); another trainer's rows are in the table only.
    rows = sorted((r for r in data["sections"].get(ACCEPT_SECTION, []) if "trainer" not in r),
                  key=lambda r: (r.get("server", ""), r["K"]))
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    predicted, measured, simulated, per_round, _ = ACCEPT_COLUMNS
    styles = ((predicted, dict(marker="o", linestyle="-")), (measured, dict(marker="s", linestyle="-", markersize=9)),
              (simulated, dict(marker="x", linestyle="none", markersize=9, color="black", zorder=3)),
              (per_round, dict(marker="^", linestyle="--")))
    servers = list(dict.fromkeys(r.get("server", "") for r in rows))
    fig = Figure(figsize=(1.0 + 6.0 * len(servers), 4.2), dpi=100)
    axes = fig.subplots(1, len(servers), sharey=True, squeeze=False)[0]   # one panel per server, side by side
    for ax, server in zip(axes, servers):
        mine = [r for r in rows if r.get("server", "") == server]
        ks = [r["K"] for r in mine]
        for column, style in styles:
            ax.plot(ks, [r[column] for r in mine], label=column, **style)
        ax.set_xticks(ks)
        ax.set_xlabel("chain draft steps K")
        ax.set_title(f"trained tiny draft: predicted vs {server} engine vs reference simulation", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("accept length (tokens per verify round)")
    _save_png(fig, path)


def _save_png(fig, path: Path) -> None:
    """Written atomically, without metadata (no software version, no date): identical inputs, identical bytes."""
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        fig.savefig(f, format="png", metadata={"Software": None})
    os.replace(tmp, path)
