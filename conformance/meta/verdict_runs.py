"""The planted drafts of the verdict tests (test_verdict.py, test_verdict_seed.py) and their runs: `pytest
--draft-checkpoint=DIR` in a real subprocess, as a user runs it. Two test files, so that a parallel run spreads
the subprocesses over its workers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from conformance.user.example_draft import DROPPED_TENSOR, write_example
from fixtures.real_configs import REAL_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2
HEADLINE = re.compile(r"^VERDICT: (served as trained|NOT served as trained: (\d+) problems?)$", re.M)
KIMI = REAL_CONFIGS / "target" / "moonshotai--Kimi-K2.5.json"     # 61 layers: SGLang's DeepSeek class
SEED_ARGS = "--speculative-eagle-topk 1 --speculative-num-steps 1 --speculative-num-draft-tokens 16"
TRAINED_ON = "--trained-aux-layers=embed,3,31"


def run_pytest(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """pytest as a user runs it, from the repository root, one thread per process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@dataclass(frozen=True)
class Plant:
    id: str
    fmt: str
    plant: str | None
    exit: int
    problems: int | None      # the exact count, when the draft has exactly one thing wrong
    named: tuple[str, ...]    # what the verdict block must name: the cause's entry and file:line, the fix
    args: tuple[str, ...] = ()           # the run's options besides --draft-checkpoint
    eagle_ids: tuple[int, ...] | None = None   # config.json's eagle_config ids, rewritten for serving


PLANTED = [
    Plant("norm_before_residual", "sglang", "norm_before_residual", 1, 1,
          ("sglang-residual-never-normed", "llama_eagle3.py:97-99", "stage `layers.0.residual`",
           "retrain without it: norm_before_residual false")),
    Plant("two_layers", "sglang", "two_layers", 1, None,
          ("sglang-hidden-norm-on-later-layers", "llama_eagle3.py:103-105", "retrain without it: num_hidden_layers 1")),
    Plant("attention_bias", "sglang", "attention_bias", 1, None,
          ("sglang-qkv-bias-dropped", "llama_eagle3.py:67-75", "retrain without it: attention_bias false")),
    Plant("sliding_window", "sglang", "sliding_window", 1, 1,
          ("sglang-config-window-ignored", "llama_eagle3.py:286-299", "--speculative-draft-window-size 3")),
    Plant("fc_skip", "sglang", "fc_skip", 1, 1,
          ("sglang-fc-skipped-when-widths-coincide", "llama_eagle3.py:238", "1 * 40 == 40")),
    Plant(DROPPED_TENSOR, "sglang", DROPPED_TENSOR, 1, None,
          ("dropped silently: fc.bias", "llama_eagle3.py:363, 373", "speculators 0.9.0 cannot load this draft")),
    Plant("speculators_format", "speculators", None, 1, 1,
          ("1. SGLang cannot read this directory as written", "Unrecognized model in draft",
           "transformers/models/auto/configuration_auto.py", "python -m conformance.user.convert draft draft-sglang")),
]
CLEAN = [Plant(f"clean_{fmt}", fmt, None, 0, 0, ()) for fmt in ("sglang", "sglang-legacy", "specforge")]
SEED = [
    Plant("kimi_seed", "sglang", None, 1, 1,
          ("1. SGLang feeds the draft other target layers than it was trained on (training: [embed, 3, 31]  "
           "serving: [3, 31, 59])", "slot 0: training embed, serving 3  <- differs",
           "slot 1: training 3, serving 31  <- differs", "slot 2: training 31, serving 59  <- differs",
           "deepseek_v2.py:", '"eagle_aux_hidden_state_layer_ids": [0, 3, 31]'),
          (f"--target-config={KIMI}", TRAINED_ON), (3, 31, 59)),
    Plant("kimi_rewired", "sglang", None, 0, 0, (), (f"--target-config={KIMI}", TRAINED_ON), (0, 3, 31)),
    Plant("seed_flags", "sglang", None, 1, 1,
          ("draft tokens silently reduced: 16 asked, 2 served", "speculative_num_draft_tokens is adjusted",
           "sglang/srt/arg_groups/speculative_hook.py:", "--speculative-num-draft-tokens"),
          (f"--sglang-args={SEED_ARGS}",)),
]
CASES = PLANTED + CLEAN + SEED


def start_runs(root: Path, cases: list[Plant]) -> Iterator[dict[str, Future]]:
    """For a module fixture: every case's run, started at once, WORKERS at a time: (CompletedProcess, seconds)."""
    pool = ThreadPoolExecutor(WORKERS)

    def run(case: Plant, draft: Path):
        start = time.perf_counter()
        result = run_pytest(f"--draft-checkpoint={draft}", *case.args)
        return result, time.perf_counter() - start

    # The drafts are written here, one after the other: only the subprocesses run in threads (a first import
    # of a transformers class from two threads at once can fail inside its lazy module).
    drafts = {}
    for case in cases:
        drafts[case.id], _, _ = write_example(root / case.id, case.fmt, plant=case.plant)
        if case.eagle_ids is not None:
            write_eagle_ids(drafts[case.id], case.eagle_ids)
    futures = {case.id: pool.submit(run, case, drafts[case.id]) for case in cases}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def write_eagle_ids(draft: Path, ids) -> None:
    """config.json rewritten for serving: eagle_config ids only, nothing else changed."""
    config = json.loads((draft / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    (draft / "config.json").write_text(json.dumps(config, indent=2))


def verdict_block(stdout: str) -> str:
    return stdout[stdout.index("VERDICT: "):] if "VERDICT: " in stdout else ""


def check_verdict(case: Plant, runs: dict[str, Future]) -> None:
    """The run's exit code, its one verdict line, and every problem named with its parts."""
    __tracebackhide__ = True
    result, seconds = runs[case.id].result()
    out = result.stdout + result.stderr
    assert result.returncode == case.exit, \
        f"exit {result.returncode}, expected {case.exit} ({seconds:.0f} s):\n{out[-6000:]}"
    heads = HEADLINE.findall(result.stdout)
    assert len(heads) == 1, f"expected one verdict line:\n{out[-6000:]}"
    if case.exit == 0:
        assert heads[0][0] == "served as trained", heads
        return
    count = int(heads[0][1])
    assert count >= 1 and (case.problems is None or count == case.problems), f"{heads[0][0]}:\n{verdict_block(out)}"
    block = verdict_block(result.stdout)
    for words in case.named:
        assert words in block, f"{words!r} not in the verdict:\n{block}"
    for n in range(1, count + 1):   # each problem numbered, with its five parts
        item = block.split(f"\n{n}. ", 1)[1]
        assert all(f"   {part}:" in item for part in ("where", "evidence", "cause", "fix")), item
