"""Property-based conformance: drawn draft configs and batches, every implementation vs the reference.

Each example writes its own tiny checkpoint and runs speculators and SGLang for two draft steps
(teacher-forced) in the drawn dtype. Where the registry (known_divergences.toml) has an entry for the
example, the first divergence must be exactly that entry's step and stage; otherwise every stage must
conform. Profiles (conftest.py): `ci` (default, derandomized), `dev`, `nightly`.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from conformance.adapters import IMPLEMENTATIONS
from conformance.core.harness import DraftStore, LoadFailed, compare_with_reference
from conformance.core.registry import LOAD, known_divergence
from conformance.draft.strategies import draw_case
from conformance.core.tolerances import DTYPES

STEPS = 2


@pytest.mark.cpu
@given(data=st.data())
def test_property_every_implementation_conforms_or_diverges_as_registered(data, tmp_path_factory, report, request):
    case = draw_case(data)
    dtype_name = data.draw(st.sampled_from(sorted(DTYPES)), label="dtype")
    note(f"config: {json.dumps(dict(case.overrides), default=str)}; lengths {case.lengths}; seed {case.seed}")
    drafts = DraftStore(tmp_path_factory.mktemp(case.id))   # one store per example: nothing accumulates
    for impl in IMPLEMENTATIONS:
        known = known_divergence(impl, case)
        expected = "conforms" if known is None else f"step {known.step} '{known.stage}' ({known.id})"
        try:
            comparison = compare_with_reference(drafts, impl, case, dtype_name, steps=STEPS)
        except LoadFailed as exc:
            assert known is not None and known.stage == LOAD, (
                f"{impl} vs reference [{case.id}, {dtype_name}]: first divergence at step 0, stage 'load' "
                f"(registry expects: {expected})\n  {exc}")
            continue
        first = comparison.first_divergence
        got = None if first is None else (first.step, first.stage)
        want = None if known is None else (known.step, known.stage)
        report.add_row("property examples", {"case": case.id, "impl": impl, "dtype": dtype_name,
                                             "first divergence": "conforms" if got is None else f"step {got[0]} {got[1]}",
                                             "registry": expected})
        assert got == want, (f"registry expects: {expected}\n"
                             + comparison.message(f"python -m pytest '{request.node.nodeid}' (the failing example "
                                                  "is printed above; the ci profile replays it)"))
