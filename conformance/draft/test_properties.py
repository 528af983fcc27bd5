"""Property-based conformance: drawn draft configs and batches, every implementation vs the reference.

Each example writes its own tiny checkpoint and runs speculators and SGLang for two draft steps
(teacher-forced) in the drawn dtype. Where the registry (conformance/core/registry.toml) has an entry for
the example, the observation must be exactly that entry's: a load refusal with its exception class and
message pattern, or its first divergent step and stage; otherwise every stage must conform.
Profiles (conftest.py): `ci` (default, derandomized), `dev`, `nightly`.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from conformance.adapters import IMPLEMENTATIONS
from conformance.core.harness import DraftStore, LoadFailed, compare_with_reference
from conformance.core.matching import deciding, match_forward, match_load
from conformance.core.registry import for_case
from conformance.core.report import Section
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
        known = for_case(impl, case, STEPS)
        entry = deciding(known, case.config.num_hidden_layers)
        expected = "conforms" if entry is None else f"{entry.place} ({entry.id})"
        try:
            comparison = compare_with_reference(drafts, impl, case, dtype_name, steps=STEPS)
        except LoadFailed as exc:
            assert match_load(known, exc.error, exc.detail) is not None, (
                f"{impl} vs reference [{case.id}, {dtype_name}]: first divergence at step 0, stage 'load' "
                f"(registry expects: {expected})\n  {exc}")
            continue
        first = comparison.first_divergence
        got = None if first is None else (first.step, first.stage)
        layers = case.config.num_hidden_layers
        as_registered = entry is None if first is None else match_forward(known, first, layers)
        report.add_row(Section.PROPERTY_EXAMPLES, {"case": case.id, "impl": impl, "dtype": dtype_name,
                                             "first divergence": "conforms" if got is None else f"step {got[0]} {got[1]}",
                                             "registry": expected})
        assert as_registered, (f"registry expects: {expected}\n"
                             + comparison.message(f"python -m pytest '{request.node.nodeid}' (the failing example "
                                                  "is printed above; the ci profile replays it)"))
