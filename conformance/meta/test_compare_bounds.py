"""compare_tensors' pass mask is torch's own: on errors planted just inside and just outside each bound of
the tolerance table (atol + noise * floor + rtol * |expected|), its verdict agrees with
torch.testing.assert_close given the same bounds, it counts exactly the planted elements that are out, and
its max abs error names the planted element it should. NaN never passes, not even against NaN."""
from __future__ import annotations

import pytest
import torch

from conformance.core.compare import DIVERGED, OK, compare_tensors
from conformance.core.tolerances import TOLERANCES, dtype_name

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

STAGE_OF_KIND = {"hidden": "layers.0.attn_out", "logits": "logits"}
BOUNDS = [pytest.param(kind, dtype, id=f"{kind}-{dtype_name(dtype)}") for kind, dtype in TOLERANCES if kind != "ids"]
SHAPE = (6, 8)
PLANTED = ((1, 2), (4, 7), (5, 0), (0, 3))   # the elements given an error; the first is the one moved outside
MARGIN = 1e-3                                 # "just": 0.1% of the bound, far above float64 rounding


def planted(kind: str, dtype: torch.dtype, outside: bool):
    """(actual, expected, precise, allowed atol, the element of the largest error): float64 tensors, so
    the planted errors are exactly what is compared; `dtype` only selects the tolerance."""
    tol = TOLERANCES[(kind, dtype)]
    g = torch.Generator().manual_seed(7)
    expected = 3 * torch.randn(SHAPE, generator=g, dtype=torch.float64)           # both signs, |e| up to ~10
    # The fp64 reference differs by up to 5e-3: a noise term as large as half the bf16 atol.
    precise = expected + 5e-3 * (2 * torch.rand(SHAPE, generator=g, dtype=torch.float64) - 1)
    floor = float((expected - precise).abs().max())
    atol = tol.atol + tol.noise * floor
    actual = expected.clone()
    errors = {}
    for k, index in enumerate(PLANTED):
        scale = 1 + MARGIN if outside and k == 0 else 1 - MARGIN
        errors[index] = (-1) ** k * scale * (atol + tol.rtol * abs(float(expected[index])))
        actual[index] = expected[index] + errors[index]
    return actual, expected, precise, atol, max(errors, key=lambda i: abs(errors[i]))


def assert_close_passes(actual, expected, rtol: float, atol: float) -> bool:
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("kind,dtype", BOUNDS)
@pytest.mark.parametrize("outside", [False, True], ids=["inside", "outside"])
def test_verdict_agrees_with_assert_close(kind, dtype, outside):
    actual, expected, precise, atol, largest = planted(kind, dtype, outside)
    tol = TOLERANCES[(kind, dtype)]
    r = compare_tensors(0, STAGE_OF_KIND[kind], actual, expected, dtype, precise=precise)
    torch_says = assert_close_passes(actual, expected, tol.rtol, atol)
    where = f"{kind} {dtype_name(dtype)}, errors planted just {'outside' if outside else 'inside'}"
    assert torch_says is not outside, f"{where}: the planted errors are not where they should be for assert_close"
    assert (r.verdict == OK) is torch_says, f"{where}: compare_tensors says {r.verdict}, assert_close " \
                                            f"{'passes' if torch_says else 'fails'}"
    assert r.mismatched == int(outside), f"{where}: {r.mismatched} elements out of tolerance, planted {int(outside)}"
    assert r.abs_index == largest, f"{where}: max abs error at {r.abs_index}, the largest planted error is at {largest}"
    assert r.max_abs == pytest.approx(float((actual - expected).abs()[largest]), rel=1e-12)


@pytest.mark.parametrize("nan_in", ["actual", "both"])
def test_nan_never_passes(nan_in):
    expected = torch.linspace(-1, 1, 12, dtype=torch.float64)
    actual = expected.clone()
    actual[5] = float("nan")
    if nan_in == "both":
        expected[5] = float("nan")
    r = compare_tensors(0, "logits", actual, expected, torch.float32)
    assert not assert_close_passes(actual, expected, 1.0, 1.0)
    assert (r.verdict, r.mismatched, r.abs_index) == (DIVERGED, 1, (5,)), r
