"""Self-tests of the lanes around the cpu lane: the gpu gate, the CI workflow, what benchmarks time.

The gpu lane is run in a subprocess as users run it (`pytest -m gpu [--require-gpu]`); the workflow
is read as YAML and its CPU job checked against the README's commands; the benchmarks' bare passes
(each adapter's timed_pass: hooks off, SGLang passes replayed) are checked to compute what the
recorded conformance runs compute, and the roofline byte count against the checkpoint's own tensors.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS
from conformance.throughput.throughput import DECODE, EXTEND, BenchCase, step_bytes
from fixtures.cases import CASES_BY_ID
from conformance.checkpoints import WEIGHTS_FILE

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "conformance.yml"
GPU_SKIP_REASON = "gpu: torch.cuda.is_available() is False"
# The modules with gpu tests (collecting only them keeps this self-test quick; the gate in conformance/plugin.py
# acts on whatever `-m gpu` selects).
GPU_MODULES = ("conformance/draft/test_gpu.py", "conformance/throughput/test_throughput.py",
               "conformance/engine/test_engine_gpu.py")


def run_pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_gpu_lane_skips_with_a_reason_and_fails_under_require_gpu():
    if torch.cuda.is_available():   # a CUDA host (CI's gpu job): --require-gpu has nothing to refuse
        required = run_pytest(*GPU_MODULES, "-m", "gpu", "--require-gpu", "--collect-only", "-q")
        assert required.returncode == 0 and " collected" in required.stdout, required.stdout[-2000:]
        return
    skipped = run_pytest(*GPU_MODULES, "-m", "gpu", "-q", "-rs")
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    n = int(re.search(r"\b(\d+) skipped\b", skipped.stdout).group(1))
    assert n > 0 and not re.search(r"\d+ (passed|failed|error)", skipped.stdout), skipped.stdout[-3000:]
    reasons = [line for line in skipped.stdout.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all(GPU_SKIP_REASON in line for line in reasons), "\n".join(reasons)

    required = run_pytest(*GPU_MODULES, "-m", "gpu", "--require-gpu", "-q")
    assert required.returncode != 0, "--require-gpu without CUDA must fail"
    message = f"--require-gpu: {n} gpu tests selected but torch.cuda.is_available() is False"
    assert message in required.stdout + required.stderr, required.stdout[-2000:] + required.stderr[-2000:]


def readme_commands() -> list[str]:
    """The commands of the README's `sh` block under "Set up and run", comments stripped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Set up and run.*?```sh\n(.*?)```", text, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_workflow_cpu_job_runs_the_readme_commands():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    triggers = workflow.get("on", workflow.get(True))   # YAML 1.1 reads a bare `on` key as True
    assert {"push", "pull_request"} <= set(triggers), triggers
    cpu = workflow["jobs"]["cpu"]
    runs = [step["run"] for step in cpu["steps"] if "run" in step and "GITHUB_STEP_SUMMARY" not in step["run"]]
    assert runs == readme_commands(), f"cpu job runs {runs}, the README says {readme_commands()}"
    assert not str(cpu["runs-on"]).startswith("self-hosted")


def test_workflow_gpu_job_cannot_pass_by_skipping():
    workflow = yaml.safe_load(WORKFLOW.read_text())
    gpu = workflow["jobs"]["gpu"]
    assert "self-hosted" in gpu["runs-on"] and "cuda" in gpu["runs-on"], gpu["runs-on"]
    runs = "\n".join(step.get("run", "") for step in gpu["steps"])
    # the model-level gpu lane and the CUDA engine lane (make engine-gpu) each refuse to run without CUDA
    assert 'pytest -m "gpu and not engine" --require-gpu' in runs
    assert "make engine-gpu" in runs and "make bench-compare" in runs
    assert "GITHUB_STEP_SUMMARY" in runs and "report.md" in runs
    makefile = (ROOT / "Makefile").read_text()
    for target in ("bench-compare:", "bench-baseline:", "engine-gpu:"):
        assert target in makefile, f"the workflow uses a make target the Makefile lacks: {target}"
    recipe = makefile.split("\nengine-gpu:", 1)[1].split("\n\n", 1)[0]
    assert '-m "engine and gpu" --require-gpu' in recipe, recipe
    for line in (ROOT / "requirements-gpu.lock").read_text().splitlines():
        assert line.startswith("#") or re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][^ ]*", line), f"not pinned: {line!r}"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_unrecorded_runs_compute_what_recorded_runs_compute(impl, drafts):
    """run(record=False), what benchmarks time, drafts the same tokens as the recorded run."""
    case = CASES_BY_ID["gqa"]
    loaded = ADAPTERS[impl]().load(drafts.checkpoint(case)[ADAPTERS[impl].checkpoint_format], torch.float32)
    batch = drafts.batch(case, steps=2)
    recorded, bare = loaded.run(batch, 2), loaded.run(batch, 2, record=False)
    for step in range(2):
        for stage in ("draft_ids", "target_ids"):
            assert torch.equal(recorded.steps[step][stage], bare.steps[step][stage]), f"{impl} step {step} {stage}"
    assert "layers.0.q" in recorded.steps[0] and "layers.0.q" not in bare.steps[0], "record=False still traced"


@pytest.mark.parametrize("impl", ["reference", *IMPLEMENTATIONS])
@pytest.mark.parametrize("step", [0, 1])
def test_timed_pass_runs_the_asked_step(impl, step, drafts):
    """Every adapter's timed pass ends at the asked step and says what it is; where it runs earlier
    steps too (a TTT step has no pass of its own) it runs them all from step 0, which the benchmark
    subtracts by timing step 0's pass."""
    case = CASES_BY_ID["gqa"]
    loaded = ADAPTERS[impl]().load(drafts.checkpoint(case)[ADAPTERS[impl].checkpoint_format], torch.float32)
    with loaded.timed_pass(drafts.batch(case, steps=2), step) as timed:
        assert timed.runs in ((step,), tuple(range(step + 1))), f"{impl}: runs {timed.runs} for step {step}"
        assert timed.what, f"{impl}: the timed pass does not say what it is"
        timed.call()


def test_sglang_timed_passes_compute_the_recorded_passes(drafts):
    """A benchmark times SGLang's EXTEND and DECODE passes replayed on their own pools, hooks detached
    (timed_pass): the replay rewrites the same KV slots and returns what the recorded run's passes
    returned."""
    case = CASES_BY_ID["gqa"]
    loaded = ADAPTERS["sglang"]().load(drafts.checkpoint(case)["sglang"], torch.float32)
    batch = drafts.batch(case, steps=2)
    trace = loaded.run(batch, 2)
    for step in (0, 1):
        with loaded.timed_pass(batch, step) as timed:
            assert not loaded.recorder.handles, "timed with the stage hooks attached"
            assert len(loaded.passes) == 2, "one EXTEND and one DECODE pass expected"
            for again in (1, 0, 1):   # any order: each pass leaves the pools as it found them
                out = loaded.replay_pass(again)
                assert torch.equal(out.next_token_logits, trace.steps[again]["logits"]), f"replayed pass {again}"
            assert torch.equal(timed.call().next_token_logits, trace.steps[step]["logits"]), f"timed pass {step}"
        assert loaded.recorder.handles, "hooks must be re-attached after timing"


@pytest.mark.parametrize("impl", ["reference", "sglang"])
@pytest.mark.parametrize("pass_", [EXTEND, DECODE])
def test_roofline_weight_bytes_are_the_checkpoint_tensors_a_pass_reads(impl, pass_, drafts):
    """step_bytes' weight count against the checkpoint itself: every tensor the pass multiplies by
    (fc only at step 0), plus the embedding rows it looks up; norms and d2t/t2d excluded."""
    case = CASES_BY_ID["gqa"]
    weights = load_file(str(drafts.checkpoint(case)["speculators"] / WEIGHTS_FILE))
    bench = BenchCase("tiny", "fp32", "cpu", 2, 3, pass_, impl)
    cfg = case.config
    step = 0 if pass_ == EXTEND else 1
    read = [k for k in weights if k.endswith(".weight") and "norm" not in k and not k.startswith("embed_tokens")
            and not (k.startswith("fc.") and step > 0)]
    expected = 4 * (sum(weights[k].numel() for k in read) + min(bench.tokens, cfg.vocab_size) * cfg.hidden_size)
    # step_bytes takes the config from the bench case's size; use this case's config instead.
    assert step_bytes(cfg, bench, step)[0] == expected
