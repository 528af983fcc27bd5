"""The one tolerance table, (stage kind, dtype) -> Tol, and the error model its bounds come from.

Error model. An implementation computing in a dtype of unit roundoff u (2^-8 bf16, 2^-24 fp32) is, at
element i of a stage, within  s_i * max(k * u * sqrt(d), m * rho)  of the exact (fp64) result p, where
  s_i = |p_i| + rms(p over i's row): the magnitudes that entered it; a row is one token (every dim but the
        first), and an element near zero still carries the rounding of its row's sums and norms;
  d   = the stage's depth: the stages the reference computes up to and including it, over all draft steps.
        Each is at least one rounded operation, and independent roundings of d operations grow like
        sqrt(d) * u (probabilistic rounding-error analysis; Higham and Mary, SIAM J. Sci. Comput. 2019);
  rho = the reference's own error in this dtype at this stage, max_j |ref_j - p_j| / s_j: the stage's
        conditioning (a softmax over a few keys with close scores, a long context's RoPE angles) that no
        magnitude shows; an implementation as accurate as the reference reaches about rho, m = 2 leaves
        it the same again.
Which reference a dtype is compared against (AGAINST): bf16 against fp64, with that bound alone (atol =
rtol = 0). fp32 against the fp32 reference, which shares the fp32 RoPE frequencies every implementation
uses (reference/eagle3.py rope_cos_sin: 2.4e-5 rad from fp64 at position 2000, rho ~500 u there), with
torch.testing's fp32 atol/rtol plus m * rho * s_i (|impl - ref32| <= |impl - p| + |ref32 - p|; k = 0, the
atol is its floor); this keeps fp32 tight where the recurrent hidden grows (|h| ~ 20 by step 6 of
ms_two_layers, whose reference is 1.47e-5 from fp64 at layers.0.post_attn).

k for bf16, by measurement (conformance/meta/test_bf16_sensitivity.py re-measures it): the largest
|ref_bf16 - p| / (s * u * sqrt(d)) over every stage and step of the built-in cases is 3.37 (step 0
layers.0.mlp_out of attention_bias; 4.62 over 80 drawn property examples); k = 5 is a margin of 1.48 on
it. speculators and SGLang, where they conform, reach at most 0.59 of the bound (built-in) and 0.51
(property examples). What bf16 cannot show: u = 0.39%, so a stage scaled by 1% is inside the rounding
of any stage past the inputs; the self-test's table says where each planted fault is caught.
Id stages are exact, except where the reference's own logits cannot order the ids within this bound (a
tie the dtype cannot resolve; see conformance/core/compare.py). Change a value here, in review, with a
reason; never in a test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    k: float = 0.0   # multiple of u * sqrt(depth) * s: a well-conditioned stage
    m: float = 0.0   # multiple of rho * s: the reference's own error in this dtype at this stage


TOLERANCES: dict[tuple[str, torch.dtype], Tol] = {
    ("hidden", torch.float64): Tol(atol=1e-10, rtol=1e-10),
    ("hidden", torch.float32): Tol(atol=1e-5, rtol=1.3e-6, m=2.0),
    ("hidden", torch.bfloat16): Tol(atol=0.0, rtol=0.0, k=5.0, m=2.0),
    # Logits are a dot product over H of O(1) values: one more accumulation than a hidden stage.
    ("logits", torch.float64): Tol(atol=1e-10, rtol=1e-10),
    ("logits", torch.float32): Tol(atol=2e-5, rtol=1.3e-6),
    ("logits", torch.bfloat16): Tol(atol=0.0, rtol=0.0, k=5.0, m=2.0),
    ("ids", torch.float64): Tol(atol=0.0, rtol=0.0),
    ("ids", torch.float32): Tol(atol=0.0, rtol=0.0),
    ("ids", torch.bfloat16): Tol(atol=0.0, rtol=0.0),
}

# The reference each dtype is compared against (see the error model above).
AGAINST = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float64}


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def magnitude(precise: torch.Tensor) -> torch.Tensor:
    """s = |p| + the RMS of p over the element's row (one token: every dim but the first), in float64."""
    p = precise.detach().cpu().double()
    rows = p.reshape(p.shape[0] if p.dim() > 1 else 1, -1)
    rms = rows.pow(2).mean(-1, keepdim=True).sqrt()
    return (rows.abs() + rms).reshape(p.shape)


def allowed_error(tol: Tol, dtype: torch.dtype, expected: torch.Tensor, precise: torch.Tensor | None = None,
                  same: torch.Tensor | None = None, depth: int = 1) -> tuple[torch.Tensor, str]:
    """The allowed |actual - expected| per element, and how it was made (for failure messages).

    `precise` is the stage from the fp64 reference (default: `expected`); `same` the stage from the
    reference in `dtype` (default: `expected` unless it is fp64), whose distance from `precise` is rho.
    Tensors of another shape than `expected` are ignored (no model term from them)."""
    e = expected.detach().cpu().double()
    allowed = tol.atol + tol.rtol * e.abs()
    if not (tol.k or tol.m):
        return allowed, f"atol={tol.atol:g} + rtol={tol.rtol:g}*|ref|"
    p = e if precise is None or precise.shape != e.shape else precise.detach().cpu().double()
    if same is None and expected.dtype != torch.float64:
        same = expected
    s = magnitude(p)
    rho = 0.0
    if tol.m and same is not None and same.shape == e.shape:
        rho = float(((same.detach().cpu().double() - p).abs() / s.clamp_min(torch.finfo(torch.float64).tiny)).max())
    model = tol.k * unit_roundoff(dtype) * math.sqrt(depth)
    multiple = max(model, tol.m * rho)
    how = (f"(|p| + rms_row(p)) * max(k={tol.k:g} * u={unit_roundoff(dtype):.3g} * sqrt(depth={depth}), "
           f"m={tol.m:g} * rho={rho:.3g}) = {multiple:.3g} * (|p| + rms_row(p))")
    if tol.atol or tol.rtol:
        how = f"atol={tol.atol:g} + rtol={tol.rtol:g}*|ref| + {how}"
    return allowed + multiple * s, how


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
