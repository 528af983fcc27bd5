"""The engine lanes report in one format: SGLang's engine lane (conformance/engine/test_engine.py) and the engine
lane of a server in an environment of its own (vLLM's, conformance/engine/test_vllm_engine.py) write the same columns
in the same order (conformance/engine/reporting.py), so that report.md shows their rows side by side in one table.
Default lane: each lane's row writer is given a stand-in run and finding (no engine runs); a planted column is
refused.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from conformance.adapters import ADAPTERS
from conformance.core.sections import Section
from conformance.engine import lane, served_lane
from conformance.engine.findings import RequestFinding
from conformance.engine.reporting import (
    REQUEST_COLUMNS, SERVER_COLUMNS, record_group, record_served_group, record_served_request, record_request,
    server_row,
)
from conformance.engine.scenarios import GROUPS
from conformance.session.report import Report

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

SERVED_ENGINE = ADAPTERS["vllm"].engine   # the served lane the suite has


def stand_in_request(meta: dict) -> SimpleNamespace:
    return SimpleNamespace(served=SimpleNamespace(meta=meta, output_ids=[5, 6]), rounds=[], label="request seq 0")


def both_lanes_rows() -> Report:
    report = Report()
    record_group(report, lane.GroupRun(GROUPS[0], resolved={"speculative_num_steps": 1}), set())
    served = SimpleNamespace(engine=SERVED_ENGINE, recorded=set())
    record_served_group(report, served_lane.GroupRun(served_lane.GROUPS[0], resolved={"num_speculative_tokens": 1}),
                        served)
    reference = [SimpleNamespace(accepted=1), SimpleNamespace(accepted=0)]
    sglang_meta = {"spec_verify_ct": 2, "spec_correct_drafts_histogram": [1, 1], "spec_accept_length": 1.5}
    record_request(report, "chain", RequestFinding(stand_in_request(sglang_meta), [5, 6], reference, 2, None), 2)
    vllm_meta = {"spec_decode": {"num_spec_steps": 2, "acceptance_histogram": [1, 1], "mean_acceptance_length": 1.5}}
    record_served_request(report, served, "chain",
                          served_lane.Finding(stand_in_request(vllm_meta), [5, 6], reference, 2, None, 1))
    return report


def test_both_engine_lanes_write_the_same_columns():
    report = both_lanes_rows()
    servers, requests = report.sections[Section.ENGINE_SERVERS], report.sections[Section.ENGINE]
    assert [list(r) for r in servers] == [list(SERVER_COLUMNS)] * 2, servers
    assert [list(r) for r in requests] == [list(REQUEST_COLUMNS)] * 2, requests
    assert [r["server"] for r in requests] == [f"{lane.ENGINE.NAME} engine", f"{SERVED_ENGINE.NAME} engine"]
    assert all(r["versions"] for r in servers), servers   # each names what served


def test_a_column_of_one_lane_only_is_refused():
    """Planted: a row with a column the shared table lacks (what made the two lanes' tables differ) is a one-line
    error naming it, not a column that only one server fills."""
    with pytest.raises(ValueError, match=r"unknown columns \['versions of one lane'\]"):
        server_row({"engine": "x", "versions of one lane": "y"})
