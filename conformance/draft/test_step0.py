"""Step 0 (training TTT step 0 / SGLang draft EXTEND): each implementation against the reference.

The matrix is implementation x dtype x case; every stage both sides expose is compared. A pair the
registry in known_divergences.py names is a strict xfail that only counts when the first divergent
stage is the registered one.
"""
from __future__ import annotations

import pytest

from conformance.adapters import ALL_IMPLEMENTATIONS
from conformance.session.harness import assert_conforms, conformance_params
from conformance.core.tolerances import DTYPES
from fixtures.cases import STEP0_CASES


@pytest.mark.cpu
@pytest.mark.parametrize("impl,dtype_name,case",
                         list(conformance_params(ALL_IMPLEMENTATIONS, DTYPES, STEP0_CASES, steps=1)))
def test_step0_matches_reference(impl, dtype_name, case, drafts, report, request, repro):
    assert_conforms(drafts, report, impl, case, dtype_name, request.node.nodeid, repro)
