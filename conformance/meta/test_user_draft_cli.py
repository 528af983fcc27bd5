"""The acceptance run, as a user types it: `pytest --draft-checkpoint=DIR --training-data=F --hidden-states=D
--report OUT` on a draft that diverges fails (exit code 1, not the usage error 4); the report it still
writes opens with the verdict (report.md) and carries it as data (report.json), names the first divergent
stage and the accounting error; the user's files stay byte-identical. The focused run selects only the
user checks; --with-matrix adds the built-in matrix back.
"""
from __future__ import annotations

import json

import pytest

from conformance.checkpoints.weights import sha256
from conformance.meta.test_verdict import run_pytest
from conformance.user.example_draft import write_example
from conformance.user.user_draft import input_files

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


def test_a_broken_draft_fails_and_the_report_opens_with_the_verdict(tmp_path):
    draft, data, dump = write_example(tmp_path / "in", "sglang", broken=True)   # an fc.bias its config lacks
    before = {p: sha256(p) for p in input_files(draft, data, dump)}
    out = tmp_path / "out"
    # The trainer stated: speculators' refusal of the bias is a problem only for the draft's own trainer.
    result = run_pytest(f"--draft-checkpoint={draft}", f"--training-data={data}", f"--hidden-states={dump}",
                        "--trainer=speculators", "--report", str(out))
    assert result.returncode == 1, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "stage_error.png"}
    md = (out / "report.md").read_text()
    top = md.split("\n## ", 2)[1]
    assert top.startswith("Verdict") and "VERDICT: NOT served as trained: 2 problems" in top, md[:3000]
    assert "dropped silently: fc.bias" in top and "llama_eagle3.py:363, 373" in top, top
    first = md.split("## First divergences", 1)[1].split("\n## ", 1)[0]
    assert "| FAIL | speculators vs reference | user_draft | fp32 | load |" in first, first
    assert "speculators could not load" in first and "fc.bias" in first, first
    assert "| FAIL | sglang vs reference | user_draft | fp32 | step 0 `fc_out`" in first, first
    report = json.loads((out / "report.json").read_text())
    verdict = report["verdict"]
    assert verdict["served_as_trained"] is False and verdict["versions"]["sglang"] == "0.5.23", verdict
    assert [p["number"] for p in verdict["problems"]] == [1, 2], verdict["problems"]
    assert any(p["where"] == "dropped silently: fc.bias" for p in verdict["problems"]), verdict["problems"]
    assert verdict["checks"]["failed"] >= 1 and "hidden-state dump" in verdict["inputs"], verdict
    rows = report["sections"]["weight accounting"]
    assert any(r["impl"] == "sglang" and r["problems"] == "dropped silently: fc.bias" for r in rows), rows
    assert before == {p: sha256(p) for p in input_files(draft, data, dump)}


def test_the_focused_run_collects_only_the_user_checks(tmp_path):
    """Collection only (nothing runs): without --with-matrix every selected test is a user check."""
    draft, _, _ = write_example(tmp_path, "sglang")
    focused = run_pytest(f"--draft-checkpoint={draft}", "-m", "cpu", "--collect-only", "-q")
    matrix = run_pytest(f"--draft-checkpoint={draft}", "--with-matrix", "--collect-only", "-q",
                        "conformance/user", "conformance/draft/test_step0.py")
    ids = [line for line in focused.stdout.splitlines() if "::" in line]
    assert focused.returncode == 0 and ids, focused.stdout[-3000:] + focused.stderr[-3000:]
    assert all(i.startswith("conformance/user/") for i in ids), ids
    assert any(i.startswith("conformance/user/test_user_draft.py::") for i in ids), ids
    assert any(i.startswith("conformance/draft/test_step0.py::") for i in matrix.stdout.splitlines()), \
        matrix.stdout[-3000:] + matrix.stderr[-3000:]
