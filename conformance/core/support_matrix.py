"""The support matrix: per knob setting (a conformance case), is it safe to deploy with each
implementation version? Generated from the registry for the README, and from test outcomes for the
report. `python -m conformance.core.support_matrix --write-readme` refreshes the README's copy.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from conformance.core.registry import installed_version, known_divergence
from fixtures.cases import ALL_CASES, DraftCase

IMPLS = ("sglang", "speculators")
README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def column(impl: str) -> str:
    return f"{impl} {installed_version(impl)}"


def knob_setting(case: DraftCase) -> str:
    parts = [f"{k}={v}" for k, v in case.overrides if k not in ("hidden_size", "target_hidden_size")]
    widths = dict(case.overrides)
    if "hidden_size" in widths:
        parts.insert(0, f"H={widths['hidden_size']}, Ht={widths.get('target_hidden_size')}")
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in case.sglang_args]
    return "; ".join(parts) or "defaults"


def registry_cell(impl: str, case: DraftCase) -> str:
    entry = known_divergence(impl, case)
    return "safe" if entry is None else f"diverges: step {entry.step} `{entry.stage}` ({entry.id})"


def registry_rows(cases=ALL_CASES) -> list[dict]:
    return [{"case": c.id, "what": c.summary, "knobs": knob_setting(c), **{column(i): registry_cell(i, c) for i in IMPLS}}
            for c in cases]


def markdown(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def readme_block() -> str:
    return f"{START}\n{markdown(registry_rows())}\n{END}"


def write_readme(path: Path = README) -> None:
    text = path.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    path.write_text(head + readme_block() + tail)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-readme", action="store_true", help="refresh the README's support matrix")
    args = parser.parse_args()
    if args.write_readme:
        write_readme()
    else:
        print(readme_block())
