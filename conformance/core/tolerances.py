"""The one tolerance table, (stage kind, dtype) -> Tol, and the error model its bounds come from.

Error model. An implementation computing in a dtype of unit roundoff u (2^-8 bf16, 2^-24 fp32) is, at
element i of a stage, within
    u * |p_i|  +  max(k * u * sqrt(d), m * rho) * rms_row(p)_i
of the exact result p (the fp64 reference), where
  u|p_i|     the element's own rounding: the stage is stored in the dtype;
  rms_row(p) the RMS of p over the element's row (one token: every dim but the first). The sums and norms
             that made the token's row spread their rounding over every element of it, so an element near
             zero carries as much as a large one (measured: with a quarter of |p_i| added to this scale the
             calibration below is 3.88 instead of 4.30, and a planted scaling is caught 1.4x later);
  d          the stage's depth in its draft step: the stages the reference computes in that step up to and
             including this one. Each is at least one rounded operation, and d independent roundings grow
             like sqrt(d) * u (probabilistic rounding-error analysis, Higham and Mary, SIAM J. Sci. Comput.
             41(5), 2019). k is what one such rounding costs at most, in units of the row's RMS;
  rho        the reference's own error in the dtype at this stage, max_j |ref_j - p_j| / rms_row(p)_j: what
             no magnitude shows, i.e. what earlier draft steps left in the recurrent hidden (steps >= 1) and
             the stage's conditioning (a softmax over a few keys with close scores, RoPE deep in a context).
Which reference each dtype is compared against (AGAINST): bf16 against fp64, with the bound alone (atol =
rtol = 0). fp32 against the fp32 reference, which shares the fp32 RoPE frequencies every implementation
uses (reference/rope.py rope_cos_sin: 2.4e-5 rad from fp64 at position 2000, where rho is ~500 u), with
torch.testing's fp32 atol/rtol as the floor (k = 0) plus the model's m * rho term, m = 2 because
|impl - ref32| <= |impl - p| + |ref32 - p| for an implementation as accurate as the reference; it keeps
fp32 tight where the recurrent hidden grows (|h| ~ 20 by step 6 of ms_two_layers, whose reference is
1.47e-5 from fp64 at layers.0.post_attn), element by element where a stage-wide floor was before.

The multiples, by measurement (conformance/meta/test_bf16_sensitivity.py re-measures k): bf16 k = 8 is a
margin of 1.86 on the largest (|ref_bf16 - p| - u|p|) / (u sqrt(d) rms_row(p)) the reference reaches at
step 0 of the built-in cases, 4.30 (fc_norm, layers.0.attn_core; 6.9 once in 100 drawn property examples,
an ill-conditioned stage that rho covers). bf16 m = 3: speculators and SGLang, where they conform, come
within 1.9 rho of fp64 (built-in, 7 steps), so they reach at most 0.63 of the bound built-in, 0.54 over
the property examples; fp32 at most 0.23. What bf16 cannot show: u = 0.39%, so a stage scaled by 1%
hides in the rounding of every stage; the self-test prints where each planted fault is caught. Id
stages are exact, except where the reference's logits cannot order the ids within these bounds (a tie
the dtype cannot resolve; conformance/core/compare.py). Change a value here, in review, with a reason;
never in a test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    k: float = 0.0   # multiple of u * sqrt(depth) * rms_row(p): what a well-conditioned stage accumulates
    m: float = 0.0   # multiple of rho * rms_row(p): rho, the reference's own error in this dtype at the stage


TOLERANCES: dict[tuple[str, torch.dtype], Tol] = {
    ("hidden", torch.float64): Tol(atol=1e-10, rtol=1e-10),
    ("hidden", torch.float32): Tol(atol=1e-5, rtol=1.3e-6, m=2.0),
    ("hidden", torch.bfloat16): Tol(atol=0.0, rtol=0.0, k=8.0, m=3.0),
    # Logits are a dot product over H of O(1) values: one more accumulation than a hidden stage.
    ("logits", torch.float64): Tol(atol=1e-10, rtol=1e-10),
    ("logits", torch.float32): Tol(atol=2e-5, rtol=1.3e-6),
    ("logits", torch.bfloat16): Tol(atol=0.0, rtol=0.0, k=8.0, m=3.0),
    ("ids", torch.float64): Tol(atol=0.0, rtol=0.0),
    ("ids", torch.float32): Tol(atol=0.0, rtol=0.0),
    ("ids", torch.bfloat16): Tol(atol=0.0, rtol=0.0),
}

# The reference each dtype is compared against (see the error model above).
AGAINST = {torch.float64: torch.float64, torch.float32: torch.float32, torch.bfloat16: torch.float64}


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def row_rms(precise: torch.Tensor) -> torch.Tensor:
    """The RMS of p over each element's row (one token: every dim but the first), in float64, p's shape
    (NaNs left out: they fail as themselves, not their row)."""
    p = precise.detach().cpu().double()
    rows = p.reshape(p.shape[0] if p.dim() > 1 else 1, -1)
    return rows.pow(2).nanmean(-1, keepdim=True).sqrt().expand_as(rows).reshape(p.shape)


def allowed_error(tol: Tol, dtype: torch.dtype, expected: torch.Tensor, precise: torch.Tensor | None = None,
                  same: torch.Tensor | None = None, depth: int = 1) -> tuple[torch.Tensor, str]:
    """The allowed |actual - expected| per element, and how it was made (for failure messages).

    `precise` is the stage from the fp64 reference (default: `expected`); `same` the stage from the
    reference in `dtype` (default: `expected` unless it is fp64), whose distance from `precise` is rho.
    Tensors of another shape than `expected` are ignored (no model term from them)."""
    e = expected.detach().cpu().double()
    allowed = tol.atol + tol.rtol * e.abs()
    how = f"atol={tol.atol:g} + rtol={tol.rtol:g}*|ref|"
    if not (tol.k or tol.m):
        return allowed, how
    p = e if precise is None or precise.shape != e.shape else precise.detach().cpu().double()
    if same is None and expected.dtype != torch.float64:
        same = expected
    u, rms = unit_roundoff(dtype), row_rms(p)
    rho = 0.0
    if tol.m and same is not None and same.shape == e.shape:
        ratio = (same.detach().cpu().double() - p).abs() / rms.clamp_min(torch.finfo(torch.float64).tiny)
        rho = float(ratio.nan_to_num(0.0).max())
    multiple = max(tol.k * u * math.sqrt(depth), tol.m * rho)
    if multiple == 0:   # fp32 with no reference in the dtype to measure rho against: atol and rtol alone
        return allowed, how
    model = (f"u*|p| + max(k={tol.k:g} * u={u:.3g} * sqrt(depth={depth}), m={tol.m:g} * rho={rho:.3g}) * rms_row(p)"
             f" = u*|p| + {multiple:.3g} * rms_row(p)")
    how = model if not (tol.atol or tol.rtol) else f"{how} + {model}"
    return allowed + u * p.abs() + multiple * rms.nan_to_num(0.0), how


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


# ---------------------------------------------------------------- accept length (conformance/acceptance/)
# In fp32 greedy chain drafting acceptance is exact, with no bound (conformance/acceptance/exact.py):
# each implementation drafts the reference's token in every round and position, and the reference's
# round at start row t accepts exactly the leading drafts that speculators' metrics scored right at t
# (the data are the target's greedy tokens, so teacher forcing feeds the chain the tokens it drafts
# itself while it is right); both hold on all 512 rounds of the trained draft. What stays statistical
# is sampling: the R rounds start at rows drawn uniformly (seeded, with replacement) from the rows
# the prediction 1 + sum_k full_acc_k averages over, so |simulated - predicted| <= z * s / sqrt(R), s
# the sample standard deviation of the R accept lengths (each in [1, K + 1]), with probability
# 1 - 2*Phi(-z). z = 4: 6e-5 per comparison, about 3e-4 over the 5 of a run (K = 1..5); the draws
# are seeded, so z bounds how unlucky a seed can be. The prediction also scores row 0 (no round
# starts there) and not the last k rows at step k: at most 5 of 65 rows per held-out sequence. A
# planted fault's drop over the same rounds is compared with the same bound on its paired per-round
# drops: a fault that costs acceptance must drop it by more than the bound at every K (a bf16 or
# sampled acceptance check would use the bound the same way).
ACCEPT_LENGTH_Z = 4.0


def accept_length_tolerance(std: float, rounds: int) -> float:
    """z * s / sqrt(R): the sampling error allowed between a mean of R rounds and the prediction."""
    return ACCEPT_LENGTH_Z * std / rounds ** 0.5
