"""Real `python -m pytest ...` and `python -m conformance.cli ...` processes, forked from one interpreter.

    python -m conformance.meta.forked_runs < jobs.json > results.json

Each job ({"module", "argv", "cwd", "env", "output"}) runs in a process of its own, forked from this one after
it has imported the libraries every run imports first (torch, safetensors, hypothesis, pytest, this suite's
library modules, never its pytest plugins, whose asserts pytest rewrites on import): the module runs as
`python -m MODULE ARGV` would run it (runpy, `__main__`, the current directory first on sys.path), writes
stdout and stderr to `output`, and its exit status is the process's. The fuzz campaign's sample
(conformance/meta/test_fuzz_inputs.py) runs this way: an interpreter start with torch is seconds of CPU,
a fork a fraction of one. Two jobs run at a time; the results are [{"returncode", "seconds"}] in the jobs'
order.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time

# What a run imports before its plugin loads: the libraries, and the library modules of this suite that are
# not pytest plugins (conformance.plugin and the modules it names in pytest_plugins are imported by pytest)
# nor the module a job runs (runpy warns when it finds it imported).
WARM = ("torch", "safetensors.torch", "hypothesis", "pytest", "conformance.checkpoints", "conformance.adapters",
        "conformance.session.report", "conformance.user.user_draft")
AT_ONCE = 2


def child(job: dict) -> None:
    """Become `python -m MODULE ARGV` in job["cwd"]; never returns."""
    code = 1
    try:
        os.chdir(job["cwd"])
        os.environ.update(job.get("env", {}))
        out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.path[0] = os.getcwd()   # python -m puts the current directory first
        sys.argv = [job["module"], *job["argv"]]
        try:
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:   # what `python -m` prints for an uncaught exception, then its exit status 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(jobs: list[dict]) -> list[dict]:
    for module in WARM:
        importlib.import_module(module)
    results: list[dict | None] = [None] * len(jobs)
    running: dict[int, tuple[int, float]] = {}
    todo = list(enumerate(jobs))
    while todo or running:
        while todo and len(running) < AT_ONCE:
            i, job = todo.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child(job)
            running[pid] = i, time.perf_counter()
        pid, status = os.wait()
        i, start = running.pop(pid)
        results[i] = {"returncode": os.waitstatus_to_exitcode(status), "seconds": time.perf_counter() - start}
    return results


if __name__ == "__main__":
    json.dump(run(json.load(sys.stdin)), sys.stdout)
