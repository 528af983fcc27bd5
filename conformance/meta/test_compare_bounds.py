"""compare_tensors applies the tolerance table element by element: on errors planted just inside and just
outside each element's allowed error (conformance/core/tolerances.py, recomputed here from its definition),
its verdict, its count of elements out and its max abs error are the planted ones. Where the table has no
error model (fp64, fp32 logits) the verdict agrees with torch.testing.assert_close. The bound is the
element's own: an error that passes on a large element of a large row fails on a small one, a deeper stage
allows more, and so does a stage where the reference in the dtype is itself further from fp64. NaN never
passes, and ids differ only where the reference's logits cannot order them."""
from __future__ import annotations

import math

import pytest
import torch

from conformance.core.compare import DIVERGED, OK, compare_tensors
from conformance.core.tolerances import TOLERANCES, allowed_error, dtype_name

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

STAGE_OF_KIND = {"hidden": "layers.0.attn_out", "logits": "logits"}
BOUNDS = [pytest.param(kind, dtype, id=f"{kind}-{dtype_name(dtype)}") for kind, dtype in TOLERANCES if kind != "ids"]
SHAPE = (6, 8)
PLANTED = ((1, 2), (4, 7), (5, 0), (0, 3))   # the elements given an error; the first is the one moved outside
MARGIN = 1e-3                                 # "just": 0.1% of the bound, far above float64 rounding
DEPTH = 9


def stages(seed: int = 7):
    """(expected, precise, same) in float64: rows of different scales, the reference in the dtype up to 2% off."""
    g = torch.Generator().manual_seed(seed)
    precise = torch.randn(SHAPE, generator=g, dtype=torch.float64) * torch.tensor([0.1, 1, 3, 1, 10, 0.5])[:, None]
    same = precise * (1 + 0.02 * (2 * torch.rand(SHAPE, generator=g, dtype=torch.float64) - 1))
    return same, precise, same


def documented_bound(kind, dtype, expected, precise, same, depth):
    """The allowed error as tolerances.py's docstring defines it, written out here without its code."""
    tol = TOLERANCES[(kind, dtype)]
    bound = tol.atol + tol.rtol * expected.abs()
    if tol.k or tol.m:
        u = torch.finfo(dtype).eps / 2
        rms = precise.pow(2).mean(dim=1, keepdim=True).sqrt()
        rho = ((same - precise).abs() / rms).max().item()
        multiple = max(tol.k * u * math.sqrt(depth), tol.m * rho)
        bound = bound + (u * precise.abs() + multiple * rms if multiple else 0)
    return bound


def planted(kind: str, dtype: torch.dtype, outside: bool):
    expected, precise, same = stages()
    bound = documented_bound(kind, dtype, expected, precise, same, DEPTH)
    actual = expected.clone()
    errors = {}
    for k, index in enumerate(PLANTED):
        scale = 1 + MARGIN if outside and k == 0 else 1 - MARGIN
        errors[index] = (-1) ** k * scale * float(bound[index])
        actual[index] = expected[index] + errors[index]
    return actual, expected, precise, same, bound, max(errors, key=lambda i: abs(errors[i]))


def assert_close_passes(actual, expected, rtol: float, atol: float) -> bool:
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("kind,dtype", BOUNDS)
@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_verdict_is_the_element_wise_bound(kind, dtype, outside):
    actual, expected, precise, same, bound, largest = planted(kind, dtype, outside)
    tol = TOLERANCES[(kind, dtype)]
    r = compare_tensors(0, STAGE_OF_KIND[kind], actual, expected, dtype, precise=precise, same=same, depth=DEPTH)
    where = f"{kind} {dtype_name(dtype)}, errors planted just {'outside' if outside else 'inside'}"
    assert (r.verdict == OK) is not outside, f"{where}: compare_tensors says {r.verdict}\n{r}"
    assert r.mismatched == int(outside), f"{where}: {r.mismatched} elements out of tolerance, planted {int(outside)}"
    assert r.abs_index == largest, f"{where}: max abs error at {r.abs_index}, the largest planted error is at {largest}"
    assert r.max_abs == pytest.approx(float((actual - expected).abs()[largest]), rel=1e-12)
    assert r.allowed == pytest.approx(float(bound[largest]), rel=1e-12), f"{where}: {r.bound}"
    if not (tol.k or tol.m):   # no error model: the bound is assert_close's
        assert assert_close_passes(actual, expected, tol.rtol, tol.atol) is not outside, where


@pytest.mark.parametrize("kind", ["hidden", "logits"])
def test_bf16_bound_is_the_elements_own(kind):
    """One absolute error: inside on the large element of the large row, outside on a small one of a small row;
    a deeper stage, or a reference further from fp64, lets more through."""
    _, precise, same = stages()
    bf16, tol, stage = torch.bfloat16, TOLERANCES[(kind, torch.bfloat16)], STAGE_OF_KIND[kind]
    big, small = (4, int(precise[4].abs().argmax())), (0, int(precise[0].abs().argmin()))

    def allowed(depth, same_):
        return allowed_error(tol, bf16, precise, precise, same_, depth)[0]

    def verdict(index, error, depth, same_):
        actual = precise.clone()
        actual[index] += error
        return compare_tensors(0, stage, actual, precise, bf16, precise=precise, same=same_, depth=depth).verdict

    cases = {   # what differs: (index, error between the two allowed errors, (depth, same) that passes, that fails)
        "element": (big, small, DEPTH, same),
        "depth": (small, small, 16, precise, 1, precise),
        "rho": (small, small, 1, precise + 10 * (same - precise), 1, same),
    }
    a_big, a_small = allowed(DEPTH, same)[big], allowed(DEPTH, same)[small]
    error = float(a_big + a_small) / 2
    assert (verdict(big, error, DEPTH, same), verdict(small, error, DEPTH, same)) == (OK, DIVERGED), \
        f"error {error:.3e}: allowed {a_big:.3e} on {big}, {a_small:.3e} on {small}"
    for what, (_, index, d_ok, s_ok, d_bad, s_bad) in {k: v for k, v in cases.items() if k != "element"}.items():
        hi, lo = float(allowed(d_ok, s_ok)[index]), float(allowed(d_bad, s_bad)[index])
        assert hi > lo, f"{what}: {hi:.3e} allowed where more is expected, {lo:.3e} where less"
        error = (hi + lo) / 2
        assert (verdict(index, error, d_ok, s_ok), verdict(index, error, d_bad, s_bad)) == (OK, DIVERGED), what


@pytest.mark.parametrize("nan_in", ["actual", "both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_name)
def test_nan_never_passes(nan_in, dtype):
    expected = torch.linspace(-1, 1, 12, dtype=torch.float64)
    actual = expected.clone()
    actual[5] = float("nan")
    if nan_in == "both":
        expected[5] = float("nan")
    r = compare_tensors(0, "logits", actual, expected, dtype)
    assert not assert_close_passes(actual, expected, 1.0, 1.0)
    assert (r.verdict, r.mismatched, r.abs_index) == (DIVERGED, 1, (5,)), r


def test_ids_differ_only_where_the_logits_cannot_order_them():
    """Three drafted ids differ from the reference's: one at a position whose top two logits are closer than
    their allowed errors (excused), one that is not the runner-up of such a position, and one where the gap is
    wide (both count)."""
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0], [2.0, 1.99, -3.0, 0.0], [2.0, 1.995, 1.0, -3.0]],
                          dtype=torch.float64)
    expected = logits.argmax(-1)
    allowed = torch.full_like(logits, 0.01)
    actual = torch.tensor([1, 1, 2])   # row 0: gap 1 (wide); row 1: the runner-up (tie); row 2: the third id
    r = compare_tensors(0, "draft_ids", actual, expected, torch.bfloat16, logits, logits_allowed=allowed)
    assert (r.verdict, r.mismatched, r.abs_index) == (DIVERGED, 2, (0,)), r
    assert "1 mismatch(es) excused" in r.detail, r.detail
    r = compare_tensors(0, "draft_ids", torch.tensor([0, 1, 0]), expected, torch.bfloat16, logits,
                        logits_allowed=allowed)
    assert r.verdict == OK and r.mismatched == 0, r
