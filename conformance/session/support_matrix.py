"""The support matrix: per check area and case, is it safe to deploy with each implementation release?
Generated from the registry (registry.toml) for docs/registry.md, one column per release an adapter is tested
against (its `releases`), each evaluated from the registry at that release, whatever is installed;
report.md carries the draft matrix from the tests that actually ran.
`python -m conformance.session.support_matrix --write` refreshes the block between the two markers in docs/registry.md.
"""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from unittest import mock

from conformance.core import registry
from conformance.core.areas import AREAS, ASSERTED, deciding
from conformance.core.registry import case_names, for_accounting, for_case
from fixtures.cases import ALL_CASES, DraftCase

DOC = Path(__file__).resolve().parents[2] / "docs" / "registry.md"   # the page that holds the generated block
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"


def impls() -> tuple[str, ...]:
    """Every implementation under test, in whichever lane its tests run."""
    from conformance.adapters import ALL_IMPLEMENTATIONS

    return ALL_IMPLEMENTATIONS


def releases(impl: str) -> tuple[str, ...]:
    from conformance.adapters import ADAPTERS

    return ADAPTERS[impl].releases


def columns(only: str | None = None) -> list[tuple[str, str]]:
    """(implementation, release) of every column: each adapter's releases under test (`only`: one adapter's)."""
    return [(impl, r) for impl in impls() if only in (None, impl) for r in releases(impl)]


def column(impl: str, release: str) -> str:
    return f"{impl} {release}"


@contextlib.contextmanager
def at_release(impl: str, release: str):
    """The registry evaluated as if `release` of `impl` were installed (the other implementations as they are)."""
    installed = registry.installed_version

    def version(name: str, engine: bool = False) -> str | None:   # an engine's own build is as it is
        return release if name == impl and not engine else installed(name, engine)

    with mock.patch.object(registry, "installed_version", version):
        yield


def per_release(cell, only: str | None = None, *args) -> dict[str, str]:
    """{column: cell(impl, *args) at that release} over the columns."""
    out = {}
    for impl, release in columns(only):
        with at_release(impl, release):
            out[column(impl, release)] = cell(impl, *args)
    return out


def knob_setting(case: DraftCase) -> str:
    parts = [f"{k}={v}" for k, v in case.overrides if k not in ("hidden_size", "target_hidden_size")]
    widths = dict(case.overrides)
    if "hidden_size" in widths:
        parts.insert(0, f"H={widths['hidden_size']}, Ht={widths.get('target_hidden_size')}")
    parts += [f"--{k.replace('_', '-')} {v}" for k, v in case.sglang_args]
    return "; ".join(parts) or "defaults"


def draft_cell(impl: str, case: DraftCase) -> str:
    """What the implementation cannot express (`cannot_express`: the tests skip; a draft it reads and loads but does
    not run says so, with its accounting entries), else the deciding forward entry (a load refusal first), then the
    accounting entries."""
    from conformance.adapters import ADAPTERS, cannot_express

    if why := cannot_express(impl, case.config):
        adapter = ADAPTERS[impl]()
        if not adapter.forward_not_run(case.config):
            return f"not expressible: {why}"
        # read and loaded, not run (its `unsupported` says "config + weights checked; forward not run: ..."): what
        # its reading and loading of the file in its format show (conformance/draft/test_mla_vllm.py)
        names = {**case_names(case), "format": adapter.format_for(case.config), "absent": (), "overruled": ()}
        known = (*for_accounting(impl, case), *registry.applicable("reading", impl, names))
        return "; ".join([why, *(AREAS[e.area].cell(e) for e in known)])
    entry = deciding(for_case(impl, case), case.config.num_hidden_layers)
    more = [e for e in for_accounting(impl, case) if e.area not in {k.area for k in for_case(impl, case)}]
    return "; ".join(AREAS[e.area].cell(e) for e in ([entry] if entry else []) + more) or "safe"


def draft_rows(cases=ALL_CASES) -> list[dict]:
    return [{"case": c.id, "what": c.summary, "knobs": knob_setting(c), **per_release(draft_cell, None, c)}
            for c in cases]


def tree_rows() -> list[dict]:
    from conformance.adapters import DEFAULT_SERVER
    from conformance.draft.tree_cases import TREE_CASES, known_tree

    def cell(_impl, case) -> str:
        entry = deciding(known_tree(case), 1)
        return "safe" if entry is None else AREAS[entry.area].cell(entry)

    return [{"tree case": c.id, "draft": c.draft, "topk": c.topk, "steps": c.steps,
             "draft tokens": c.num_draft_tokens, **per_release(cell, DEFAULT_SERVER, c)} for c in TREE_CASES]


def wiring_rows() -> list[dict]:
    """Per target class and draft config format, for each server (SGLang, and every other serving adapter):
    the training conventions it serves as trained, and the registered mismatch of each other one."""
    from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS
    from conformance.wiring.cases import runners, wiring_matrix, wiring_names
    from fixtures.targets import CAPTURE_ONLY_TARGETS, TARGETS

    def cells(impl, runner) -> dict[tuple[str, str], str]:
        rows: dict[tuple[str, str], dict[str, list[str]]] = {}
        for target, case, fmt in wiring_matrix(TARGETS + CAPTURE_ONLY_TARGETS):
            known = registry.applicable("wiring", impl, wiring_names(target, case, fmt, runner))
            key = "safe" if not known else AREAS[known[0].area].cell(known[0])
            rows.setdefault((target.id, fmt), {}).setdefault(key, []).append(case.id)
        return {where: "; ".join(f"{key}: {', '.join(cases)}"
                                 for key, cases in sorted(by_key.items(), key=lambda kv: kv[0] != "safe"))
                for where, by_key in rows.items()}

    per_column = {}
    for impl in (i for i in ALL_IMPLEMENTATIONS if ADAPTERS[i].is_server):
        for runner in runners(impl):   # a column per model runner where it has more than one (vLLM V2, V1)
            suffix = "" if runner is None else f" ({runner.upper()} runner)"
            per_column.update({col + suffix: cell for col, cell in per_release(cells, impl, runner).items()})
    return [{"target": t, "config format": f, **{col: by_place[(t, f)] for col, by_place in per_column.items()}}
            for (t, f) in next(iter(per_column.values()))]


def settings_rows() -> list[dict]:
    def holds(impl, entry) -> str:
        return "yes" if entry.version_holds() else "no"

    def known_by(e) -> str:   # how the suite knows it (conformance/meta/test_registry.py keeps the label honest)
        return ASSERTED if e.asserted else f"shown by {e.shown_by}" if e.shown_by else "observed: SGLang's resolution"

    return [{"setting": e.setting, "when": f"`{e.when}`", "entry": e.id, "versions": f"{e.impl} {e.versions}",
             "known by": known_by(e), **per_release(holds, e.impl, e)}
            for e in registry.REGISTRY if e.area == "settings"]


def reading_rows() -> list[dict]:
    """Per registered reading: the key of the file as written, when, what the implementation takes it to mean
    (observed on its loaded model, or read from its code where it does not run with the suite)."""
    def holds(impl, entry) -> str:
        return "-" if impl != entry.impl else "yes" if entry.version_holds() else "no"

    return [{"key": e.key, "when": f"`{e.when}`", "reading": AREAS[e.area].cell(e), "fix": e.fix or "-",
             "versions": f"{e.impl} {e.versions}", **per_release(holds, None, e)}
            for e in registry.REGISTRY if e.area == "reading"]


def markdown(rows: list[dict]) -> str:
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def doc_block() -> str:
    parts = [("Draft forward, loading and weight accounting", draft_rows()), ("Tree drafting", tree_rows()),
             ("Target wiring: what each server feeds the draft, per training case", wiring_rows()),
             ("Server settings SGLang serves differently (flagged by the settings check)", settings_rows()),
             ("One file, read differently: each implementation's reading of a key (the verdict's reading check)",
              reading_rows())]
    body = "\n\n".join(f"**{title}**\n\n{markdown(rows)}" for title, rows in parts)
    return f"{START}\n{body}\n{END}"


def write_doc(path: Path = DOC) -> None:
    text = path.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    path.write_text(head + doc_block() + tail)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="refresh the support matrix in docs/registry.md")
    args = parser.parse_args()
    if args.write:
        write_doc()
    else:
        print(doc_block())
