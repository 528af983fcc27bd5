"""Step 0 (training TTT step 0 / SGLang draft EXTEND): each implementation against the reference.

The matrix is implementation x dtype x case; every stage both sides expose is compared. A pair the
registry in known_divergences.py names is a strict xfail that only counts when the first divergent
stage is the registered one.
"""
from __future__ import annotations

import pytest
import torch

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS
from conformance.compare import compare_traces
from conformance.harness import LoadFailed
from conformance.known_divergences import LOAD, KnownDivergence, known_divergence
from conformance.tolerances import DTYPES
from fixtures.cases import STEP0_CASES


class KnownDivergenceHit(AssertionError):
    """The registered divergence, at the registered stage: what a strict xfail expects."""


def matrix():
    for impl in IMPLEMENTATIONS:
        for dtype_name in DTYPES:
            for case in STEP0_CASES:
                known = known_divergence(impl, case.config)
                marks = [pytest.mark.xfail(strict=True, raises=KnownDivergenceHit, reason=known.describe())] if known else []
                yield pytest.param(impl, dtype_name, case, id=f"{impl}-{dtype_name}-{case.id}", marks=marks)


def check(comparison, known: KnownDivergence | None, report, nodeid: str, repro: str) -> None:
    """Record the comparison and fail with the full message; a registered divergence raises KnownDivergenceHit."""
    __tracebackhide__ = True
    first = comparison.first_divergence
    hit = known is not None and first is not None and first.stage == known.stage
    outcome = "pass" if first is None else ("known divergence" if hit else "FAIL")
    report.add(comparison, nodeid, outcome, known.reason if hit else "")
    if first is None:
        return
    message = comparison.message(repro)
    if hit:
        raise KnownDivergenceHit(f"{message}\n  known: {known.reason}")
    raise AssertionError(message)


@pytest.mark.cpu
@pytest.mark.parametrize("impl,dtype_name,case", list(matrix()))
def test_step0_matches_reference(impl, dtype_name, case, drafts, report, request, repro):
    dtype = DTYPES[dtype_name]
    known = known_divergence(impl, case.config)
    try:
        actual = drafts.trace(impl, case, dtype)
    except LoadFailed as exc:
        hit = known is not None and known.stage == LOAD
        report.add_load_failure(impl, case.id, dtype_name, request.node.nodeid,
                                "known divergence" if hit else "FAIL", str(exc))
        error = KnownDivergenceHit if hit else AssertionError
        raise error(f"{impl} vs reference [{case.id}, {dtype_name}]: first divergence at step 0, stage 'load'\n"
                    f"  {exc}\n  repro: {repro}") from None
    expected = drafts.trace("reference", case, dtype)
    precise = drafts.trace("reference", case, torch.float64)
    comparison = compare_traces(actual, expected, ADAPTERS[impl].claimed_stages, case.config.num_hidden_layers,
                                case.id, precise=precise)
    check(comparison, known, report, request.node.nodeid, repro)
