"""A run forked from the preloaded process (conformance/meta/preloaded.py) is the run a user's process makes: the
same exit code and the same output, line for line, as a real `python -m pytest --draft-checkpoint=...` on the same
draft (pytest's summary line aside: its count of warnings includes its notes that it could not rewrite the
third-party pytest packages the parent imported, anyio and hypothesis). Planted: a parent that had imported this
suite's own plugin before forking (the child's pytest says it cannot rewrite it), and a preloaded module that
starts a thread (refused: a fork copies no thread, and a lock one held stays held)."""
from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
import textwrap
from concurrent.futures import Future

import pytest

from conformance.meta.preloaded import Preloaded, importable, rewritten
from conformance.meta.test_verdict import ROOT, run_pytest
from conformance.user.example_draft import write_example

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
SUMMARY = re.compile(r"^\d+ (passed|failed|skipped|deselected).* in [\d.]+s( \(.*\))?$")
# Fail a run whose pytest could not rewrite this suite's modules (pytest's warning, as an error).
OWN_REWRITTEN = "-Werror:Module already imported so cannot be rewritten; conformance:pytest.PytestAssertRewriteWarning"


def forked(tmp_path, draft, report, *args: str, preload: tuple[str, ...] = ()) -> list[subprocess.CompletedProcess]:
    preloaded = Preloaded(tmp_path / "preloaded", preload=preload)
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--draft-checkpoint={draft}",
            f"--report={report}", "--trainer=speculators", *args]
    try:
        return [preloaded.run(argv), preloaded.run(argv)]   # the second after the parent preloaded the first's
    finally:
        preloaded.close()


def without_summary(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if not SUMMARY.match(line)]


def test_a_preloaded_run_is_a_real_process_run(tmp_path):
    draft, _, _ = write_example(tmp_path / "inputs", "sglang", plant="fc_skip")
    report = tmp_path / "report"
    real = run_pytest(f"--draft-checkpoint={draft}", f"--report={report}", "--trainer=speculators")
    assert real.returncode == 1 and "VERDICT: NOT served" in real.stdout, real.stdout[-3000:] + real.stderr[-3000:]
    for run in forked(tmp_path, draft, report, OWN_REWRITTEN):
        diff = list(difflib.unified_diff(without_summary(real.stdout), without_summary(run.stdout), "real", "forked",
                                         lineterm=""))
        assert run.returncode == real.returncode and not diff, \
            f"exit {run.returncode} (real {real.returncode}):\n" + "\n".join(diff[:80]) + run.stderr[-3000:]


def test_a_parent_that_imported_the_plugin_is_caught(tmp_path):
    draft, _, _ = write_example(tmp_path / "inputs", "sglang", plant="fc_skip")
    first, _ = forked(tmp_path, draft, tmp_path / "report", OWN_REWRITTEN, preload=("conformance.plugin",))
    out = first.stdout + first.stderr
    assert first.returncode != 1 and "cannot be rewritten; conformance" in out, out[-3000:]


def test_a_preloaded_module_that_starts_a_thread_is_refused(tmp_path):
    (tmp_path / "threaded.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(30,),"
                                          " daemon=True).start()\n")
    (tmp_path / "listing").write_text("json\nthreaded\n")
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from pathlib import Path
        from conformance.meta.preloaded import _preload
        _preload(Path({str(tmp_path / 'listing')!r}), set())
    """)
    ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert ran.returncode != 0 and "a preloaded module started a thread" in ran.stderr, ran.stderr[-3000:]


def test_only_modules_pytest_leaves_alone_are_preloaded():
    import conformance.plugin
    import torch

    # pytest's own rule: this suite is among them where its sources are listed (a source tree's egg-info), but
    # never preloaded either way (OWN)
    assert "hypothesis" in rewritten()
    assert importable("torch", torch) and not importable("conformance.plugin", conformance.plugin)
    assert not importable("fixtures.tiny", None) and not importable("sglang.test_utils", None)
    assert not importable("hypothesis.strategies", None)


def test_only_printed_commands_run(tmp_path):
    preloaded = Preloaded(tmp_path / "preloaded")
    try:
        ran = preloaded.run(["/bin/echo", "hello"], cwd=ROOT)
    finally:
        preloaded.close()
    assert ran.returncode == 127 and "not a command this suite prints" in ran.stderr, ran


def test_requests_written_together_all_run(tmp_path):
    """Several threads' requests can reach the parent in one read (make check's runs start at once); each must
    start a child, the last one too, not wait for a request that never comes."""
    preloaded = Preloaded(tmp_path / "preloaded")
    try:
        futures = []
        lines = ""
        for rid in ("together-1", "together-2", "together-3"):
            futures.append(preloaded.pending.setdefault(rid, Future()))
            lines += json.dumps({"id": rid, "argv": ["/bin/echo", rid], "cwd": str(ROOT), "env": {},
                                 "stdout": str(tmp_path / f"{rid}.out"), "stderr": str(tmp_path / f"{rid}.err")})
            lines += "\n"
        with preloaded.lock:
            preloaded.process.stdin.write(lines)
            preloaded.process.stdin.flush()
        codes = [future.result(timeout=60) for future in futures]
    finally:
        preloaded.close()
    assert codes == [127, 127, 127], codes
