"""A fixed divergence passes: SGLang patched to honour norm_before_residual passes the case its registry
entry decides, so the entry would no longer hit (docs/registry.md: a fixed divergence turns its xfail into a failure).

This holds only because the SGLang adapter observes `layers.0.residual` (the residual SGLang's own
post_attention_layernorm receives) instead of labelling hidden_norm's input as it. The plant is SGLang's
layer-0 forward (llama_eagle3.py:96-116) with the one change speculators makes for the knob
(models/eagle3/model_definitions.py:80-81), set on one loaded model in this test and nowhere else.
"""
from __future__ import annotations

from types import MethodType

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.core.compare import compare_traces
from conformance.core.matching import match_forward
from conformance.core.areas import deciding
from conformance.core.registry import for_case
from conformance.core.tolerances import AGAINST, DTYPES
from conformance.meta.plants import honouring_norm_before_residual
from fixtures.cases import CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
CASE = CASES_BY_ID["norm_before_residual"]
STEPS = 2   # the EXTEND and one DECODE pass


def compare(drafts, dtype_name: str, patched: bool):
    dtype = DTYPES[dtype_name]
    if patched:
        loaded = ADAPTERS["sglang"]().load(drafts.checkpoint(CASE)["sglang"], dtype)
        layer0 = loaded.model.model.layers[0]
        layer0.forward = MethodType(honouring_norm_before_residual, layer0)
        actual = loaded.run(drafts.batch(CASE, STEPS), STEPS).on_cpu()
    else:
        actual = drafts.trace("sglang", CASE, dtype, STEPS)
    same = drafts.trace("reference", CASE, dtype, STEPS)
    precise = drafts.trace("reference", CASE, torch.float64, STEPS)
    expected = precise if AGAINST[dtype] == torch.float64 else same   # as harness.compare_with_reference
    return compare_traces(actual, expected, CASE.id, precise=precise, same=same)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_sglang_honouring_norm_before_residual_passes_and_the_entry_no_longer_hits(dtype_name, drafts):
    known = for_case("sglang", CASE)
    entry = deciding(known, CASE.config.num_hidden_layers)
    assert entry is not None and (entry.step, entry.stage) == (0, "layers.0.residual"), \
        f"the case {CASE.id} is no longer decided by a layers.0.residual entry: {entry}"

    unpatched = compare(drafts, dtype_name, patched=False).first_divergence
    assert match_forward(known, unpatched, CASE.config.num_hidden_layers) == entry, \
        f"stock SGLang no longer shows {entry.id}: first divergence {unpatched}"

    fixed = compare(drafts, dtype_name, patched=True)
    assert fixed.first_divergence is None, \
        f"SGLang honouring norm_before_residual still diverges:\n{fixed.message('(planted; no repro)')}"
