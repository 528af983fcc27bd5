"""The engine lanes' report rows (conformance/core/sections.py Section.ENGINE*): SGLang's engine lane and an engine
lane of a server in an environment of its own (vLLM's, conformance/engine/test_vllm_engine.py) write the same
columns in the same order (server_row, request_row), so that their rows sit side by side in one table."""
from __future__ import annotations

import pytest
import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER
from conformance.core.sections import Recorder, Section
from conformance.engine.findings import RequestFinding, scenario_findings
from conformance.engine.lane import ENGINE, GroupRun

# Section.ENGINE_SERVERS: one row per engine started. "overlap schedule off": SGLang's overlap scheduler, vLLM's
# async scheduling (each off here, so that the rounds are observed in order).
SERVER_COLUMNS = ("engine", "requested (steps/topk/draft tokens)", "resolved (steps/topk/draft tokens)",
                  "chunked prefill", "overlap schedule off", "radix cache off", "attention", "page size", "drafter",
                  "versions",
                  "planted", "error")
# Section.ENGINE: one row per served request; each server's accept length as it defines it (the accept-length
# table says how: bridge.AcceptRow.measured_as), the reference's the same quotient of its rounds.
REQUEST_COLUMNS = ("server", "scenario", "request", "cached tokens", "verify ct served/ref", "histogram served",
                   "histogram ref", "accept length served", "accept length ref", "lossless", "rounds conforming",
                   "first divergence")


# Section.ENGINE_FAULTS: one row per planted serving fault (conformance/engine/faults.py, engine_capture.FAULTS).
FAULT_COLUMNS = ("server", "fault", "how", "lane failures", "first divergence", "expected", "lossless",
                 "accept length served/ref")


def _row(columns: tuple[str, ...], values: dict) -> dict:
    if unknown := set(values) - set(columns):
        raise ValueError(f"engine report row: unknown columns {sorted(unknown)} (reporting.py {columns})")
    return {c: values.get(c) for c in columns}


def server_row(values: dict) -> dict:
    """A Section.ENGINE_SERVERS row: every column of SERVER_COLUMNS, in its order."""
    return _row(SERVER_COLUMNS, values)


def request_row(values: dict) -> dict:
    """A Section.ENGINE row: every column of REQUEST_COLUMNS, in its order."""
    return _row(REQUEST_COLUMNS, values)


def fault_row(values: dict) -> dict:
    """A Section.ENGINE_FAULTS row: every column of FAULT_COLUMNS, in its order."""
    return _row(FAULT_COLUMNS, values)


def engine_name(run: GroupRun) -> str:
    """The engine's name in the report: its group, and whose draft it served when not the default trainer's (the
    acceptance bridge serves each trainer's draft in the same groups)."""
    return f"{ENGINE.NAME} {run.group.id}" + (f" ({run.trainer}-trained draft)" if run.trainer else "")


def record_group(report: Recorder, run: GroupRun, recorded: set) -> None:
    """Once per engine: the server arguments requested and as SGLang resolved them (server_row), the timings
    (apart: they vary run to run, so they are not part of the report), and (once per session) the shims with
    what each changes and what the scheduler process reported doing."""
    if run.group.id in recorded:
        return
    recorded.add(run.group.id)
    resolved = run.resolved
    report.add_row(Section.ENGINE_SERVERS, server_row({
        "engine": engine_name(run),
        "requested (steps/topk/draft tokens)": f"{run.group.steps}/{run.group.topk}/{run.group.draft_tokens}",
        "resolved (steps/topk/draft tokens)": "/".join(str(resolved.get(k)) for k in (
            "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")),
        "chunked prefill": resolved.get("chunked_prefill_size"), "overlap schedule off": resolved.get(
            "disable_overlap_schedule"), "radix cache off": resolved.get("disable_radix_cache"),
        "attention": resolved.get("attention_backend"), "page size": resolved.get("page_size"),
        "drafter": run.drafter,
        "planted": ", ".join(f"{k}={v}" for k, v in run.group.env.items()) or (
            "source_patcher config" if run.group.fault_yaml else ""),
        "versions": f"{ENGINE.NAME} {ADAPTERS[DEFAULT_SERVER].version()}, torch {torch.__version__}",
        "error": run.error or ""}))
    report.add_timing({"engine": engine_name(run), "engine start s": round(run.start_seconds, 1),
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
    report.add_row(Section.ENGINE, request_row({
        "server": f"{ENGINE.NAME} engine", "scenario": scenario_id, "request": finding.request.label,
        "cached tokens": meta.get("cached_tokens"),
        "verify ct served/ref": f"{served['verify_ct']}/{ref['verify_ct']}",
        "histogram served": str(served["histogram"]), "histogram ref": str(ref["histogram"]),
        "accept length served": served["accept_length"], "accept length ref": ref["accept_length"],
        "lossless": finding.lossless_failure() is None,
        "rounds conforming": f"{finding.conforming_rounds}/{len(finding.request.rounds)}",
        "first divergence": "none" if first is None else
        f"round {finding.conforming_rounds}, step {first.step} `{first.stage}`"}))


def record_accept_rows(report: Recorder, rows: dict, recorded: set, trainer: str | None = None) -> None:
    """Once per session (per lane): the accept-length bridge, one row per chain K (conformance/engine/bridge.py);
    `trainer`: whose draft and training metrics, named in each row when given."""
    if "accept rows" in recorded:
        return
    recorded.add("accept rows")
    for row in rows.values():
        report.add_row(Section.ENGINE_ACCEPT, ({"trainer": trainer} if trainer else {}) | row.report_row())


def record_served_group(report: Recorder, run, lane) -> None:
    """Once per engine of a served lane (served_lane.ServedLane: vLLM's), in SGLang's columns (server_row): the
    server arguments as the engine resolved them, what served (versions), and its timings apart."""
    if run.group.id in lane.recorded:
        return
    lane.recorded.add(run.group.id)
    r = run.resolved
    report.add_row(Section.ENGINE_SERVERS, server_row({
        "engine": f"{lane.engine.NAME} {run.group.id}",
        "requested (steps/topk/draft tokens)": f"{run.group.K}/1/{run.group.K + 1}",
        "resolved (steps/topk/draft tokens)": f"{r.get('num_speculative_tokens')}/1/"
                                              f"{(r.get('num_speculative_tokens') or 0) + 1}",
        "chunked prefill": r.get("long_prefill_token_threshold") or r.get("chunked prefill"),
        "overlap schedule off": None if "async scheduling" not in r else not r["async scheduling"],
        "radix cache off": not r.get("prefix caching", True), "attention": r.get("attention backend"),
        "page size": r.get("block size"), "drafter": r.get("drafter"), "planted": run.planted or "",
        "versions": f"{lane.engine.PACKAGE} {r.get(lane.engine.NAME)}, torch {r.get('torch')}, {r.get('model runner')}",
        "error": run.error or ""}))
    report.add_timing({"engine": f"{lane.engine.NAME} {run.group.id}", "engine start s": round(run.start_seconds, 1),
                       "serving s": {s.scenario.id: round(s.seconds, 1) for s in run.scenarios.values()}})


def record_served_request(report: Recorder, lane, scenario_id: str, f) -> None:
    """Once per request of a served lane, in SGLang's columns (request_row): the server's own counts (its
    per-request spec-decode metrics) next to the reference's, and where its rounds first leave it."""
    if ("request", scenario_id, f.request.label) in lane.recorded:
        return
    lane.recorded.add(("request", scenario_id, f.request.label))
    m = f.request.served.meta.get("spec_decode") or {}
    first = None if f.divergence is None else f.divergence.first_divergence
    accepted = f.reference_accepted
    report.add_row(Section.ENGINE, request_row({
        "server": f"{lane.engine.NAME} engine", "scenario": scenario_id, "request": f.request.label,
        "cached tokens": f.request.served.meta.get("num_cached_tokens"),
        "verify ct served/ref": f"{m.get('num_spec_steps')}/{len(accepted)}",
        "histogram served": str(m.get("acceptance_histogram")),
        "histogram ref": str([accepted.count(a) for a in range(f.K + 1)]),
        "accept length served": m.get("mean_acceptance_length"),
        "accept length ref": 1 + sum(accepted) / len(accepted) if accepted else None,
        "lossless": f.lossless_failure() is None,
        "rounds conforming": f"{f.conforming_rounds}/{len(f.request.rounds)}",
        "first divergence": "none" if first is None else
        f"round {f.conforming_rounds}, step {first.step} `{first.stage}`"}))


def served_scenario(lane, group, scenario, report, findings=None):
    """(group run, scenario run, findings) with the group's report rows; the engine's error fails the test.
    `findings(lane, run, scenario_run)`: the scenario's checks (default scenario_findings, the fp32 oracle)."""
    run = lane.run(group)
    record_group(report, run, lane.recorded)
    if run.error:
        pytest.fail(run.error, pytrace=False)
    scenario_run = run.scenarios[scenario.id]
    return run, scenario_run, (findings or scenario_findings)(lane, run, scenario_run)


def assert_planted_fault_named(lane, fault, clean: RequestFinding, report, repro: str) -> None:
    """A planted serving fault (faults.PlantedFault) served by `lane`: its row in the report, then the lane must fail
    with the first divergence at the fault's round, draft step and stage, while `clean` (the same request served
    without the fault) conforms."""
    from conformance.engine.findings import lane_failures

    __tracebackhide__ = True
    assert clean.divergence is None, f"without the fault the request already diverges:\n{clean.rounds_failure(repro)}"
    run = lane.run(fault.group)
    record_group(report, run, lane.recorded)
    assert not run.error, run.error
    failures = lane_failures(lane, run, repro)
    (finding,) = scenario_findings(lane, run, next(iter(run.scenarios.values())))
    report.add_row(Section.ENGINE_FAULTS, planted_fault_row(
        f"{ENGINE.NAME} engine", fault, fault.summary, finding, failures, finding.served_stats["accept_length"],
        finding.reference_stats(fault.group.scenarios[0].new_tokens)["accept_length"]))
    assert_fault_at_its_place(fault, finding, failures, repro, f"the {ENGINE.NAME} engine lane")


def planted_fault_row(server: str, fault, how: str, finding, failures: list[str], served_accept: float,
                      reference_accept: float) -> dict:
    """The report's row for a planted serving fault: where the lane first diverged against where it was planted."""
    first = None if finding.divergence is None else finding.divergence.first_divergence
    return fault_row({
        "server": server, "fault": fault.id, "how": how, "lane failures": len(failures),
        "first divergence": "none" if first is None else
        f"round {finding.conforming_rounds}, step {first.step} `{first.stage}`",
        "expected": f"round {fault.round}, step {fault.step} `{fault.stage}`",
        "lossless": finding.lossless_failure() is None,
        "accept length served/ref": f"{served_accept:.4g}/{reference_accept:.4g}"})


def assert_fault_at_its_place(fault, finding, failures: list[str], repro: str, lane: str) -> None:
    """`finding` (the faulted request's) and `failures` (its lane's) must show the planted fault: the lane fails, and
    its first divergence is the fault's round, draft step and stage, named so in the message."""
    __tracebackhide__ = True
    first = None if finding.divergence is None else finding.divergence.first_divergence
    assert failures, f"{fault.id}: {lane} passed with the fault planted ({fault.summary})"
    assert first is not None, f"{fault.id}: no round diverged; the lane failed only on: {failures}"
    got = (finding.conforming_rounds, first.step, first.stage)
    assert got == (fault.round, fault.step, fault.stage), (
        f"{fault.id}: first divergence at round {got[0]}, step {got[1]} '{got[2]}', expected round {fault.round}, "
        f"step {fault.step} '{fault.stage}'\n{finding.divergence.message(repro)}")
    message = finding.rounds_failure(repro)
    assert f"round {fault.round}" in message and f"stage '{fault.stage}'" in message, message
