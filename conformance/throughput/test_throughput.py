"""Draft throughput of each implementation (pytest-benchmark): the EXTEND pass and one DECODE step.

Per adapter, size, dtype, batch B and context L, the bare pass (stage hooks off; what is timed is
each adapter's `timed_pass`) is timed after warm-up with device synchronisation, and reported as
tokens/s and as a fraction of the memory roofline measured in the same run. Marker `benchmark`:
`pytest -m benchmark` (CPU sweep, tiny and mid sizes); real Llama-3.1-8B / Kimi-K2.5 shapes on CUDA
are also marked `gpu`. `make bench-baseline` / `make bench-compare` record and gate the figures.
"""
from __future__ import annotations

import contextlib
import math
import statistics

import pytest
import torch

from conformance.adapters import ADAPTERS, REFERENCE
from conformance.session.harness import DraftStore
from conformance.core.sections import Section
from conformance.throughput.results import RESULTS, Figure, reference_id
from conformance.throughput.throughput import (
    COPY, CPU_SIZES, GPU_SIZES, ROOFLINE_GROUP, ROOFLINE_TIMER, BenchCase, planted_slowdown, step_bytes, sweep,
    synchronize, time_rounds,
)
from conformance.core.tolerances import DTYPES
from fixtures.cases import DraftCase
from fixtures.real_shapes import SHAPES
from fixtures.tiny import make_batch

CPU_CASES = sweep("cpu", CPU_SIZES, ("fp32", "bf16"))
# The lanes of their own (vLLM's: make bench-vllm), each with the reference's figures for the ratio.
OWN_LANE_CASES = [case for lane in sorted({a.lane for a in ADAPTERS.values()} - {"cpu"})
                  for case in sweep("cpu", CPU_SIZES, ("fp32", "bf16"), lane)]
GPU_CASES = sweep("cuda", GPU_SIZES, ("bf16",))
# Seconds of timed rounds per figure (rounds = budget / one call, within [MIN, MAX]).
BUDGET_S = {"cpu": 0.4, "cuda": 1.0}
MIN_ROUNDS, MAX_ROUNDS = 3, 30
WARMUP = {"cpu": 1, "cuda": 3}   # CUDA: first calls compile (speculators' forward is torch.compile'd)
COPIES = 5                       # device copies per figure; the fastest sets the roofline bandwidth


class BenchDrafts:
    """One checkpoint per size (written once); the drafts of one (size, dtype, device) stay loaded
    while its figures are taken (the sweep runs adapters fastest), then make room for the next."""

    def __init__(self, root):
        self.store = DraftStore(root)
        self.loaded: dict[str, object] = {}
        self.group: tuple | None = None

    def load(self, case: BenchCase):
        group = (case.size, case.dtype, case.device)
        if group != self.group:
            self.loaded.clear()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.group = group
        if case.impl not in self.loaded:
            adapter = ADAPTERS[case.impl]()
            ckpt = self.store.checkpoint(DraftCase(case.size, tuple(SHAPES[case.size].items())))
            self.loaded[case.impl] = adapter.load(ckpt[adapter.checkpoint_format], DTYPES[case.dtype],
                                                  device=case.device)
        return self.loaded[case.impl]


@pytest.fixture(scope="session")
def bench_drafts(tmp_path_factory) -> BenchDrafts:
    return BenchDrafts(tmp_path_factory.mktemp("bench-checkpoints"))


@pytest.fixture
def compile_every_shape(monkeypatch):
    """On CUDA speculators' forward is torch.compile'd (speculators models/utils.py:71-76) and the
    sweep has 12 shapes per size: past torch's default 8 recompiles it would fall back to eager flex
    attention, which materialises the full score matrix (hundreds of GiB at T = 32768)."""
    import torch._dynamo.config

    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 64)


def make_bench_batch(case: BenchCase):
    """B sequences of L tokens, seeded; teacher-forced ids for step 1 (what SGLang's DECODE is fed)."""
    return make_batch(case.config, (case.context,) * case.batch, torch.Generator().manual_seed(1), steps=2)


def make_timed_call(loaded, case: BenchCase, step: int, batch, stack):
    """(callable, the draft steps it runs): the adapter's bare pass for `step`, in scope for the rest of
    the figure, device-synchronised, slowed down only when the gate's self-test plants it
    (throughput.SLOWDOWN_ENV)."""
    timed_pass = stack.enter_context(loaded.timed_pass(batch, step))
    repeat = planted_slowdown(case.impl)

    def timed():
        for _ in range(repeat):
            timed_pass.call()
        synchronize(case.device)
    return timed, timed_pass


def callable_bytes(case: BenchCase, runs: tuple[int, ...]) -> int:
    return sum(sum(step_bytes(case.config, case, k)) for k in runs)


def run_benchmark(benchmark, bench_drafts, report, case: BenchCase) -> None:
    __tracebackhide__ = True
    loaded = bench_drafts.load(case)
    batch = make_bench_batch(case)
    with contextlib.ExitStack() as stack:
        timed, timed_pass = make_timed_call(loaded, case, case.step, batch, stack)
        if benchmark.disabled:   # --benchmark-disable: one untimed call (the pass still has to run)
            benchmark.pedantic(timed)
            return
        # Warm-up calls, then one timed call sizes the rounds: BUDGET_S of rounds, 3 at least.
        first = time_rounds(timed, case.device, rounds=1, warmup=WARMUP[case.device], clock=timed_pass.clock)[0]
        # The roofline's bandwidth: the best of COPIES device copies, taken next to this figure.
        bandwidth = max(COPY.bandwidths(case.device, COPIES))
        ROOFLINE_TIMER.unit = callable_bytes(case, timed_pass.runs) / bandwidth   # seconds per stored unit
        ROOFLINE_TIMER.clock = timed_pass.clock
        step0, step0_seconds = None, []
        if len(timed_pass.runs) > 1:
            # A TTT decode step alone: the timed callable runs steps 0 and 1, so before each round
            # (pytest-benchmark's untimed setup) step 0 alone, the EXTEND callable, is timed too;
            # the step is the median of the paired differences, both halves seeing the same machine.
            step0 = make_timed_call(loaded, case, 0, batch, stack)[0]

        def setup():
            if step0 is not None:
                step0_seconds.extend(time_rounds(step0, case.device, rounds=1, warmup=0, clock=timed_pass.clock))

        rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, math.ceil(BUDGET_S[case.device] / first / (1.5 if step0 else 1))))
        benchmark.group = f"{case.device} {case.size} {case.dtype} {case.pass_}{ROOFLINE_GROUP}"
        benchmark.pedantic(timed, setup=setup, rounds=rounds, iterations=1)
        seconds = [d * ROOFLINE_TIMER.unit for d in benchmark.stats.stats.data]
        assert len(seconds) == rounds and all(math.isfinite(s) and s > 0 for s in seconds), f"{case.id}: {seconds}"
        step = [t - t0 for t, t0 in zip(seconds, step0_seconds)] if step0 else seconds
        median = statistics.median(step)
        q = statistics.quantiles(step, n=4) if len(step) > 1 else [median] * 3
    weights, kv = step_bytes(case.config, case, case.step)
    figure = Figure(case, median, q[2] - q[0], len(seconds), weights, kv, bandwidth)
    RESULTS.add(figure)
    row = figure.row(RESULTS.figures.get(reference_id(case)) if case.impl != REFERENCE else None)
    benchmark.extra_info.update(row, timed=timed_pass.what, copy_bandwidth_Bps=bandwidth,
                                unit="callable time / roofline time", roofline_time_s=ROOFLINE_TIMER.unit)
    report.add_row(Section.THROUGHPUT, row)


@pytest.mark.benchmark(timer=ROOFLINE_TIMER)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_draft_throughput(case, benchmark, bench_drafts, report):
    run_benchmark(benchmark, bench_drafts, report, case)


@pytest.mark.benchmark(timer=ROOFLINE_TIMER)
@pytest.mark.parametrize("case", OWN_LANE_CASES, ids=lambda c: c.id)
def test_draft_throughput_own_lane(case, benchmark, bench_drafts, report):
    """vLLM's figures (its own lane; the reference's beside them, for the ratio): its pass timed inside its worker
    process (TimedPass.clock), so the pipe to it is not part of the figure."""
    run_benchmark(benchmark, bench_drafts, report, case)


@pytest.mark.gpu
@pytest.mark.benchmark(timer=ROOFLINE_TIMER)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_draft_throughput_gpu(case, benchmark, bench_drafts, report, compile_every_shape):
    run_benchmark(benchmark, bench_drafts, report, case)
