"""The acceptance run, as a user types it: `pytest --draft-checkpoint DIR --report OUT` on a draft that
diverges fails (exit code 1, not the usage error 4), and the report it still writes names the first
divergent stage and the accounting error; the user's files stay byte-identical.
"""
from __future__ import annotations

import json

import pytest

from conformance.meta.test_bad_input import run_pytest
from conformance.user.user_draft import input_files
from conformance.checkpoints import sha256
from conformance.user.example_draft import write_example

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


def test_a_broken_draft_fails_and_the_report_names_why(tmp_path):
    draft, data, dump = write_example(tmp_path / "in", "sglang", broken=True)   # an fc.bias its config lacks
    before = {p: sha256(p) for p in input_files(draft, data, dump)}
    out = tmp_path / "out"
    result = run_pytest("-m", "cpu", "--draft-checkpoint", str(draft), "--training-data", str(data),
                        "--hidden-states", str(dump), "--report", str(out), "conformance/user/test_user_draft.py",
                        "-k", "step0 and fp32 or accounting or untouched")
    assert result.returncode == 1, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "stage_error.png"}
    md = (out / "report.md").read_text()
    first = md.split("## First divergences", 1)[1].split("\n## ", 1)[0]
    assert "| FAIL | sglang vs reference | user_draft | fp32 | step 0 `fc_out`" in first, first
    assert "speculators could not load" in first and "fc.bias" in first, first
    assert "dropped silently: fc.bias" in md
    rows = json.loads((out / "report.json").read_text())["sections"]["weight accounting"]
    assert any(r["impl"] == "sglang" and r["problems"] == "dropped silently: fc.bias" for r in rows), rows
    assert before == {p: sha256(p) for p in input_files(draft, data, dump)}
