"""The one tolerance table: (stage kind, dtype) -> Tol, with named fields.

An element passes when |actual - expected| <= atol + rtol * |expected| + noise * floor, where
`floor` is the stage's noise floor: the largest difference between the reference run in this dtype
and the reference run in fp64 (what rounding alone costs the reference at that stage; field-evidence
§4.5, "a noise floor of k*|fp32 - bf16| of the reference"). An implementation as accurate as the
reference is at most about twice the floor away from it, hence noise = 2 for bf16 and for fp32 hidden
stages, whose atol/rtol are torch.testing's fp32 defaults. fp32 needs the floor term because the recurrent
hidden grows over draft steps (|h| ~ 20 by step 6 of a two-layer draft) and the reference's own fp32 rounding
(vs fp64) then exceeds the fixed atol: 1.47e-5 at step 6 `layers.0.post_attn` of ms_two_layers, where speculators
is 1.20e-5 from the fp32 reference and 1.49e-5 from fp64 (as accurate as the reference), and where the
outcome depended on which CPU kernels summed it. The bf16 atol/rtol are the 2e-2 gate peers use for
tiny-model parity (field-evidence.md §1.7: SpecForge HF vs SGLang bf16). Id stages are exact,
except where the reference's own top-1/top-2 logit gap is within the logits tolerance (a tie the
dtype cannot resolve; see conformance/core/compare.py). Change a value here, in review, with a reason;
never in a test.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    noise: float = 0.0   # multiple of the stage's noise floor (reference in this dtype vs in fp64)


TOLERANCES: dict[tuple[str, torch.dtype], Tol] = {
    ("hidden", torch.float64): Tol(atol=1e-10, rtol=1e-10),
    ("hidden", torch.float32): Tol(atol=1e-5, rtol=1.3e-6, noise=2.0),
    ("hidden", torch.bfloat16): Tol(atol=2e-2, rtol=2e-2, noise=2.0),
    # Logits are a dot product over H of O(1) values: one more accumulation than a hidden stage.
    ("logits", torch.float64): Tol(atol=1e-10, rtol=1e-10),
    ("logits", torch.float32): Tol(atol=2e-5, rtol=1.3e-6),
    ("logits", torch.bfloat16): Tol(atol=5e-2, rtol=2e-2, noise=2.0),
    ("ids", torch.float64): Tol(atol=0.0, rtol=0.0),
    ("ids", torch.float32): Tol(atol=0.0, rtol=0.0),
    ("ids", torch.bfloat16): Tol(atol=0.0, rtol=0.0),
}


# The dtypes implementations run in, by the short names used in test ids and reports.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def tol_for(kind: str, dtype: torch.dtype) -> Tol:
    try:
        return TOLERANCES[(kind, dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for stage kind {kind!r} in {dtype}; "
                       "add it to conformance/core/tolerances.py") from None


# ---------------------------------------------------------------- accept length (conformance/acceptance/acceptance.py)
# The simulated accept length is the mean over R verify rounds whose start rows are drawn uniformly
# (seeded, with replacement) from the held-out rows that the prediction 1 + sum_k full_acc_k averages
# over. A faithfully served draft accepts at each row exactly what speculators' training forward
# scored there (the data are the target's greedy tokens, so teacher forcing feeds the chain the
# tokens it would draft itself while it is right), so the only difference is which rows were drawn:
# by the CLT, |simulated - predicted| <= z * s / sqrt(R), s the sample standard deviation of the R
# accept lengths (each in [1, K + 1]), with probability 1 - 2*Phi(-z). z = 4: 6e-5 per comparison,
# about 1e-3 over the 15 of a run (3 implementations x K = 1..5); the draws are seeded, so z bounds
# how unlucky a seed can be. Left out by assumption (rows are alike wherever they sit): full_acc_k
# does not score the last k rows of a sequence, and it scores row 0, whose input is a prompt token
# (no server round starts there): at most 5 of 65 rows per held-out sequence. A planted fault's drop
# is reported next to the same bound on its per-round differences (the same rounds, paired): the
# test requires the drop, the bound says whether this many rounds could tell it from chance.
ACCEPT_LENGTH_Z = 4.0


def accept_length_tolerance(std: float, rounds: int) -> float:
    """z * s / sqrt(R): the sampling error allowed between a mean of R rounds and the prediction."""
    return ACCEPT_LENGTH_Z * std / rounds ** 0.5
