"""The engine lane's report rows (conformance/core/sections.py Section.ENGINE*)."""
from __future__ import annotations

from conformance.core.sections import Recorder, Section
from conformance.engine.findings import RequestFinding
from conformance.engine.lane import ENGINE, GroupRun


def record_group(report: Recorder, run: GroupRun, recorded: set) -> None:
    """Once per engine: the server arguments requested and as SGLang resolved them, the timings (apart: they
    vary run to run, so they are not part of the report), and (once
    per session) the shims with what each changes and what the scheduler process reported doing."""
    if run.group.id in recorded:
        return
    recorded.add(run.group.id)
    resolved = run.resolved
    report.add_row(Section.ENGINE_SERVERS, {
        "engine": run.group.id,
        "requested (steps/topk/draft tokens)": f"{run.group.steps}/{run.group.topk}/{run.group.draft_tokens}",
        "resolved (steps/topk/draft tokens)": "/".join(str(resolved.get(k)) for k in (
            "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")),
        "chunked prefill": resolved.get("chunked_prefill_size"), "overlap schedule off": resolved.get(
            "disable_overlap_schedule"), "radix cache off": resolved.get("disable_radix_cache"),
        "attention": resolved.get("attention_backend"), "page size": resolved.get("page_size"),
        "planted": ", ".join(f"{k}={v}" for k, v in run.group.env.items()) or (
            "source_patcher config" if run.group.fault_yaml else ""),
        "error": run.error or ""})
    report.add_timing({"engine": run.group.id, "engine start s": round(run.start_seconds, 1),
                       "serving s": {s.scenario.id: round(s.seconds, 1) for s in run.scenarios.values()}})
    if "shims" not in recorded and run.shims:
        recorded.add("shims")
        for name, what in ENGINE.SHIMS.items():
            report.add_row(Section.ENGINE_SHIMS, {"shim": name, "what it changes": what,
                                                  "in the scheduler": run.shims.get(name, "server argument")})


def record_request(report: Recorder, scenario_id: str, finding: RequestFinding, new_tokens: int) -> None:
    served, ref = finding.served_stats, finding.reference_stats(new_tokens)
    first = None if finding.divergence is None else finding.divergence.first_divergence
    meta = finding.request.served.meta
    report.add_row(Section.ENGINE, {
        "server": f"{ENGINE.NAME} engine", "scenario": scenario_id, "request": finding.request.label,
        "cached tokens": meta.get("cached_tokens"),
        "verify ct served/ref": f"{served['verify_ct']}/{ref['verify_ct']}",
        "histogram served": str(served["histogram"]), "histogram ref": str(ref["histogram"]),
        "accept length served": served["accept_length"], "accept length ref": ref["accept_length"],
        "lossless": finding.lossless_failure() is None,
        "rounds conforming": f"{finding.conforming_rounds}/{len(finding.request.rounds)}",
        "first divergence": "none" if first is None else
        f"round {finding.conforming_rounds}, step {first.step} `{first.stage}`"})


def record_accept_rows(report: Recorder, rows: dict, recorded: set, trainer: str | None = None) -> None:
    """Once per session (per lane): the accept-length bridge, one row per chain K (conformance/engine/bridge.py);
    `trainer`: whose draft and training metrics, named in each row when given."""
    if "accept rows" in recorded:
        return
    recorded.add("accept rows")
    for row in rows.values():
        report.add_row(Section.ENGINE_ACCEPT, ({"trainer": trainer} if trainer else {}) | row.report_row())
