"""Step 0 at real draft sizes on CPU in bf16: each implementation against the reference, within 16 GB.

    python -m conformance.draft.real_size {llama31_8b,kimi_k25} WORKDIR

prints one JSON line: seconds per phase, the process's peak RSS, and each comparison's first
divergence. Run as its own process (conformance/draft/test_real_size.py does) so the peak RSS is this
run's alone. Memory stays bounded because every phase holds one copy of the weights at a time and
drops it before the next: seeded bf16 weights are written tensor by tensor, each implementation
loads, runs once and is freed. bf16 is compared against the reference in fp32, the stand-in for fp64
(which would need 4x the bf16 weights; fp32 rounding is 2^16 times below bf16's), with the bf16
reference for the error model (conformance/core/tolerances.py).
"""
from __future__ import annotations

import gc
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS, REFERENCE
from conformance.core.trace import Trace
from conformance.core.compare import compare_traces
from conformance.checkpoints import WEIGHTS_FILE
from fixtures.checkpoint import write_checkpoints
from conformance.checkpoints import expected_tensors
from fixtures.real_shapes import SHAPES
from fixtures.tiny import make_batch, make_config, make_vocab_map
from reference.eagle3 import Eagle3Config, Eagle3Reference

LENGTHS = (7, 5)          # two sequences: enough rows for every stage, little activation memory
SEED = 0
CHUNK = 1 << 24           # values drawn per randn call: bounds the fp32 scratch to 64 MB


def make_real_size_weights(cfg: Eagle3Config, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Seeded bf16 weights with make_draft_weights' scales (linear 1/sqrt(fan_in), norms 1 + noise),
    drawn in chunks so no fp32 copy of a whole tensor ever exists."""
    out = {}
    for name, (shape, kind) in expected_tensors(cfg).items():
        if kind != "float":
            continue
        norm = name.endswith("norm.weight") or ".fc_norm." in name or name.startswith("fc_norm.")
        out[name] = seeded_bf16(shape, "norm" if norm else "embed" if name == "embed_tokens.weight" else "linear",
                                generator)
    if cfg.draft_vocab_size != cfg.vocab_size:
        out["d2t"], out["t2d"] = make_vocab_map(cfg, generator)
    return out


def seeded_bf16(shape: tuple[int, ...], kind: str, generator: torch.Generator) -> torch.Tensor:
    """One bf16 tensor drawn CHUNK values at a time: "norm" 1 + 0.1 noise, "linear" scaled by 1/sqrt(fan_in),
    "embed" as drawn."""
    t = torch.empty(shape, dtype=torch.bfloat16)
    flat = t.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        n = min(CHUNK, flat.numel() - start)
        x = torch.randn(n, generator=generator)
        if kind == "norm":
            x = 1.0 + 0.1 * x
        elif kind == "linear":
            x /= shape[-1] ** 0.5
        flat[start:start + n] = x.to(torch.bfloat16)
    return t


def make_real_size_mla_weights(cfg: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """An MLA draft config's tensors (fixtures/mla.py mla_tensors: the exported names, `layers.0`), seeded bf16 as
    make_real_size_weights draws them."""
    from fixtures.mla import mla_tensors

    return {name: seeded_bf16(shape, kind, generator) for name, (shape, kind) in mla_tensors(cfg).items()}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def reference_fp32(ckpt_dir: Path, cfg: Eagle3Config) -> Eagle3Reference:
    """The fp32 reference, read and widened one tensor at a time (largest first), each through its own
    short-lived file mapping: the bf16 file is never resident alongside the whole fp32 copy."""
    path = str(ckpt_dir / WEIGHTS_FILE)
    with safe_open(path, framework="pt") as f:
        names = sorted(f.keys(), key=lambda k: -math.prod(f.get_slice(k).get_shape()))
    fp32 = {}
    for name in names:
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(name)
        fp32[name] = t.float() if t.is_floating_point() else t
        del t
    return Eagle3Reference(cfg, fp32, torch.float32)


def run(shape: str, workdir: Path) -> dict:
    cfg = make_config(**SHAPES[shape])
    timings: dict[str, float] = {}
    peaks: dict[str, float] = {}      # the process's peak RSS so far, after each phase
    clock = time.perf_counter()

    def lap(name):
        nonlocal clock
        gc.collect()
        now = time.perf_counter()
        timings[name] = round(now - clock, 1)
        peaks[name] = round(peak_rss_bytes() / 2**30, 2)
        clock = now

    weights = make_real_size_weights(cfg, torch.Generator().manual_seed(SEED))
    params = sum(t.numel() for t in weights.values())
    dirs = write_checkpoints(cfg, weights, workdir / shape)
    del weights
    lap("write weights")
    batch = make_batch(cfg, LENGTHS, torch.Generator().manual_seed(SEED + 1))

    expected = ADAPTERS[REFERENCE]().load(dirs["speculators"], torch.bfloat16).run(batch)
    lap("reference bf16")
    model = reference_fp32(dirs["speculators"], cfg)
    precise = Trace(REFERENCE, torch.float32, model.run(batch), [{}], claimed_stages=expected.claimed_stages,
                    num_layers=cfg.num_hidden_layers)
    del model
    lap("reference fp32 (noise floor)")

    comparisons = []
    for impl in IMPLEMENTATIONS:
        adapter = ADAPTERS[impl]()
        loaded = adapter.load(dirs[adapter.checkpoint_format], torch.bfloat16)
        actual = loaded.run(batch)
        del loaded
        lap(f"{impl} bf16")
        c = compare_traces(actual, precise, shape, precise=precise, same=expected)
        first = c.first_divergence
        comparisons.append({"impl": impl, "first_divergence": None if first is None else
                            {"step": first.step, "stage": first.stage, "max_abs": first.max_abs},
                            "message": "" if first is None
                            else c.message(f"python -m conformance.draft.real_size {shape} DIR")})
    return {"shape": shape, "parameters": params, "tokens": sum(LENGTHS), "seconds": timings,
            "total_seconds": round(sum(timings.values()), 1), "peak_rss_gib": round(peak_rss_bytes() / 2**30, 2),
            "peak_rss_gib_after": peaks,
            "comparisons": comparisons}


def main(argv: list[str]) -> int:
    shape, workdir = argv[0], Path(argv[1])
    torch.manual_seed(SEED)   # nothing should draw from it; fixed anyway
    print(json.dumps(run(shape, workdir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
