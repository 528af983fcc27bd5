"""Draft throughput: the sweep, each timed pass's memory-roofline bytes, the copy bandwidth.

Every figure is compared with the memory-bandwidth roofline measured in the same run on the same
device: the bytes a pass must read at least once (weights it uses + the K/V it attends to) over a
device copy's bandwidth. pytest-benchmark records each pass in units of that roofline time (a
`RooflineTimer`), so stored baselines and `--benchmark-compare-fail` gate machine-normalised ratios,
not seconds. Also a pytest plugin (registered in conformance/plugin.py): machine info, the throughput table.
"""
from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.throughput.cases import DECODE, EXTEND, BenchCase
from conformance.throughput.results import RESULTS
from reference.eagle3 import Eagle3Config

# Set only by the gate's self-test (conformance/meta/test_bench_gate.py): "sglang=2" makes every
# timed pass of that adapter run twice, a planted 2x slowdown the compare target must catch.
SLOWDOWN_ENV = "EAGLE3_BENCH_SLOWDOWN"

BATCHES = (1, 8, 32)
CONTEXTS = (128, 1024)
CPU_SIZES = ("tiny", "mid")
GPU_SIZES = ("llama31_8b", "kimi_k25")


def planted_slowdown(impl: str) -> int:
    """How many times `impl`'s timed pass runs per call (1 unless SLOWDOWN_ENV plants more)."""
    for part in filter(None, os.environ.get(SLOWDOWN_ENV, "").split(",")):
        name, _, factor = part.partition("=")
        if name.strip() == impl:
            return int(factor)
    return 1


# ---------------------------------------------------------------- the sweep

def restriction(case: BenchCase) -> str | None:
    """Why a combination is left out of the sweep, or None.

    On a 2-core CPU the sweep has to stay within minutes: an attention that is dense over the packed
    batch (the adapter's `dense_attention`: the reference's, speculators' on CPU) builds a
    [T, (k+1)T] mask and score matrix over the whole packed batch (T = B*L), so its cost grows with
    T^2, and bf16 matmuls run several times slower than fp32 on CPUs without bf16 instructions. So on
    CPU: tiny size, dense attention T <= 1024, the others everything; mid size, every adapter
    T <= 1024 in fp32 and T <= 128 in bf16. On CUDA dense attention runs T <= 8192 (the reference's
    score matrix at T = 32768 is over 100 GiB at real shapes); the others run all.
    """
    T = case.batch * case.context
    if case.device == "cpu" and (case.batch, case.context) in ADAPTERS[case.impl].cpu_compile_fails:
        return ADAPTERS[case.impl].cpu_compile_fails[case.batch, case.context]
    dense = ADAPTERS[case.impl]().dense_attention(case.device)
    if case.device == "cuda":
        limit = 8192 if dense else None
    elif case.size == "tiny":
        limit = 1024 if dense else None
    else:
        limit = 1024 if case.dtype == "fp32" else 128
    if limit is not None and T > limit:
        return f"{case.impl} on {case.device} at {case.size} size in {case.dtype}: B*L = {T} > {limit}"
    return None


def sweep(device: str, sizes, dtypes, lane: str = "cpu") -> list[BenchCase]:
    """The benchmark matrix in run order: adapters vary fastest, so a shape's figures sit together. `lane`:
    the default lane's adapters, or those of a lane of its own (vLLM's) next to the reference (its ratio)."""
    from conformance.adapters import REFERENCE

    impls = [name for name, a in ADAPTERS.items() if a.lane == lane or (lane != "cpu" and name == REFERENCE)]
    out = []
    for size in sizes:
        for dtype in dtypes:
            for B in BATCHES:
                for L in CONTEXTS:
                    for pass_ in (EXTEND, DECODE):
                        for impl in impls:
                            case = BenchCase(size, dtype, device, B, L, pass_, impl, lane)
                            if restriction(case) is None:
                                out.append(case)
    return out


# ---------------------------------------------------------------- roofline

def step_bytes(cfg: Eagle3Config, case: BenchCase, step: int) -> tuple[int, int]:
    """(weight bytes, K/V bytes) draft step `step` must read at least once (0: the EXTEND pass or TTT
    step 0; k >= 1: a serving DECODE pass or TTT step k). Weights: fc (step 0 only, when the adapter
    runs it), q/k/v/o, the MLP, lm_head and the embedding rows looked up; norms and d2t are
    negligible. K/V: the keys and values the step attends to: T = B*L at step 0, (k + 1) * T at TTT
    step k, the whole cache B*(L+k) at a serving DECODE."""
    adapter = ADAPTERS[case.impl]()
    e = 4 if case.dtype == "fp32" else 2
    H, T = cfg.hidden_size, case.batch * case.context
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    aux_width = cfg.num_aux_hidden_states * cfg.target_hidden_size
    fc_runs = step == 0 and adapter.fc_runs(cfg)
    queries = case.batch if (adapter.serving_decode and step > 0) else T
    weights = (aux_width * H if fc_runs else 0) + cfg.draft_vocab_size * H + min(queries, cfg.vocab_size) * H
    for i in range(cfg.num_hidden_layers):
        weights += (2 * H if i == 0 else H) * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * cfg.intermediate_size
    if step == 0:
        keys = T
    elif adapter.serving_decode:
        keys = T + step * case.batch
    else:
        keys = (step + 1) * T
    return weights * e, keys * 2 * nkv * hd * cfg.num_hidden_layers * e


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_rounds(fn: Callable[[], object], device: str, rounds: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of `fn` per round by `clock` (wall time unless a TimedPass says otherwise), device-synchronised,
    after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    out = []
    for _ in range(rounds):
        start = clock()
        fn()
        synchronize(device)
        out.append(clock() - start)
    return out


class DeviceCopy:
    """Bandwidth of a device copy (bytes read + written: STREAM's "copy" convention); buffers are
    allocated once per device, 64 MiB (well past the CPU caches) or 1 GiB on a GPU."""

    def __init__(self):
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def bandwidths(self, device: str, rounds: int) -> list[float]:
        """Bytes/s of `rounds` copies, after one warm-up copy."""
        if device not in self._buffers:
            nbytes = (1 << 30) if torch.device(device).type == "cuda" else (64 << 20)
            src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            self._buffers[device] = (src, torch.empty_like(src))
        src, dst = self._buffers[device]
        moved = 2 * src.numel() * src.element_size()
        return [moved / t for t in time_rounds(lambda: dst.copy_(src), device, rounds, warmup=1)]


COPY = DeviceCopy()


class RooflineTimer:
    """perf_counter in units of one roofline time (seconds per unit), so pytest-benchmark's stats of
    a pass are (pass time / roofline time) = 1 / roofline fraction: a ratio measured in this run."""

    unit = 1.0
    clock: Callable[[], float] = staticmethod(time.perf_counter)   # the figure's TimedPass.clock

    def __call__(self) -> float:
        return self.clock() / self.unit

    def __repr__(self) -> str:
        return "roofline-time units"


ROOFLINE_TIMER = RooflineTimer()
ROOFLINE_GROUP = ": time / roofline time"   # the end of every pytest-benchmark group of these figures


# ---------------------------------------------------------------- machine class

def machine_class(device: str, threads: int | None = None) -> str:
    """Where baselines live: benchmarks/baselines/<machine class>/ (e.g. cpu-x86_64-2c-1t-amd-epyc:
    2 cores, 1 torch thread; cuda-nvidia-h200). Figures are only compared within one class.
    `threads`: torch's CPU threads (default: this process's)."""
    if torch.device(device).type == "cuda":
        name = torch.cuda.get_device_name()
        return "cuda-" + _slug(name)
    try:
        import cpuinfo

        brand = cpuinfo.get_cpu_info().get("brand_raw", "") or "cpu"
    except Exception:   # py-cpuinfo is pytest-benchmark's; the class still needs a name without it
        brand = platform.processor() or "cpu"
    threads = torch.get_num_threads() if threads is None else threads
    return f"cpu-{platform.machine()}-{os.cpu_count()}c-{threads}t-{_slug(brand)}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "unknown"


# ---------------------------------------------------------------- pytest plugin hooks

def pytest_configure(config):
    # Runs before pytest-benchmark's own (trylast) configure, which reads these options.
    # `-m benchmark` asks for measurements: pytest.ini's --benchmark-disable (which keeps the other
    # lanes fast) would make every benchmark a single untimed call, so selecting the marker enables them.
    markexpr = config.getoption("markexpr", "") or ""
    if re.search(r"\bbenchmark\b", markexpr) and not re.search(r"\bnot\s+benchmark\b", markexpr):
        config.option.benchmark_enable = True
    root = config.getoption("--bench-baselines", None)
    if root:
        storage = Path(root) / machine_class(host_device())
        config.option.benchmark_storage = f"file://{storage}"
        if config.getoption("benchmark_compare", None) and not any(storage.glob("*/[0-9][0-9][0-9][0-9]_*.json")):
            raise pytest.UsageError(f"--bench-baselines: no baseline for machine class {storage.name!r} in {root}: "
                                    f"record one with `make bench-baseline` on such a machine and commit {storage}")


def host_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_benchmark_update_machine_info(config, machine_info):
    from conformance.adapters import versions

    machine_info.pop("node", None)   # the host name: baselines are per machine class, not per host
    device = host_device()
    machine_info["eagle3"] = {"machine_class": machine_class(device), "versions": versions(),
                              "torch_threads": torch.get_num_threads(),
                              "cuda_device": torch.cuda.get_device_name() if device == "cuda" else None}


def pytest_benchmark_scale_unit(config, unit, benchmarks, best, worst, sort):
    # The figures of test_throughput.py are ratios (RooflineTimer): no s/ms/us scaling, and the header
    # says what they are. Any other benchmark keeps pytest-benchmark's own scaling (None: not ours).
    if not all(str(b.get("group") or "").endswith(ROOFLINE_GROUP) for b in benchmarks):
        return None
    return ("roofline-time unit", 1.0) if unit == "seconds" else ("", 1.0)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = RESULTS.table()
    if lines:
        terminalreporter.section("eagle3 draft throughput (tokens/s, memory roofline)")
        for line in lines:
            terminalreporter.write_line(line)


if __name__ == "__main__":   # `python -m conformance.throughput.throughput`: this host's machine class
    print(machine_class(host_device()))
