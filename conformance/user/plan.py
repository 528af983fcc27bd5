"""What the verdict runs on the user's draft: every check in full for a draft that fits, a reduced set
for a large one (a real-size draft on a CPU host), and what was reduced, said in the verdict.

The full set runs each implementation in fp32 and bf16, one step and STEPS teacher-forced steps, and
the reference also in fp64 (the error model's exact result); the weight accounting loads every
implementation in fp32. For a Llama-3.1-8B-shaped draft that is 17 loads of ~1e9 parameters and an
fp64 copy of 7.6 GB; for Kimi-K2.5's, 19 GB for the fp64 copy alone. Above LARGE_PARAMS:
  - one dtype, bf16: what SGLang serves a draft in on a bf16 target (the checkpoint's dtype for the
    published drafts), compared, as always for bf16, against the more precise reference;
  - that reference in fp32 instead of fp64 (fp32 rounding is 2^16 times below bf16's, so the error
    model's rho is the same to within 2^-16; conformance/draft/real_size.py makes the same choice);
  - step 0 judged on the STEPS-step run's step 0 (the same computation: step 0 reads no later ids);
  - the weight accounting loads in the checkpoint's dtype (bit-exactness is checked in any dtype that
    holds the stored values: the stored one does).
Each implementation is loaded once per dtype and freed before the next; the draft's files are linked,
not copied, where the implementation reads them as stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STEPS = 3                      # speculators' default TTT steps (train/config/schema.py:316-320)
LARGE_PARAMS = 256 * 2 ** 20   # above: the fp64 reference alone would need more than 2 GiB
FULL_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Plan:
    dtypes: tuple[str, ...]           # the dtypes each implementation runs in (conformance/core/tolerances.py)
    precise: torch.dtype              # the reference the error model takes as exact
    accounting: torch.dtype           # the dtype the weight accounting loads in
    step0_from_steps: bool            # step 0 read off the STEPS-step run
    reduced: str = ""                 # what was reduced, one line ("" when nothing)


FULL = Plan(FULL_DTYPES, torch.float64, torch.float32, False)


def float_params(tensors) -> int:
    """Floating-point parameters of a checkpoint, from its tensor headers (TensorInfo)."""
    return sum(_numel(i.shape) for i in tensors.values() if i.dtype.is_floating_point)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_for(tensors) -> Plan:
    params = float_params(tensors)
    if params <= LARGE_PARAMS:
        return FULL
    stored = sorted({str(i.dtype).replace("torch.", "") for i in tensors.values() if i.dtype.is_floating_point})
    accounting = torch.bfloat16 if stored == ["bfloat16"] else torch.float32
    return Plan(("bf16",), torch.float32, accounting, True,
                f"reduced for a draft of {params / 1e9:.2f}e9 parameters (> {LARGE_PARAMS / 1e9:.2f}e9): bf16 "
                f"only, against the fp32 reference in place of fp64; step 0 read off the {STEPS}-step run; "
                f"weight accounting in {'bf16' if accounting == torch.bfloat16 else 'fp32'} "
                f"(stored: {', '.join(stored)})")
