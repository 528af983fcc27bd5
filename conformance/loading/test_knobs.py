"""The effective-knob rows come from what each implementation built: attributes of its loaded modules,
and, for what no attribute states (fc run or skipped, what layer 0 adds attention to, which weights
normalise layers >= 1), one observed step of the loaded draft (accounting.observed_knobs). The plants
change SGLang's built model and the row follows; the cases show the rows disagree where it differs.
"""
from __future__ import annotations

from types import MethodType

import pytest
import torch

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS, IMPLEMENTATIONS, REFERENCE, cannot_express
from conformance.adapters.sglang import weights
from conformance.loading.accounting import checkpoint_tensors, knob_rows
from conformance.adapters import account
from fixtures.cases import CASES_BY_ID
from conformance.meta.plants import honouring_norm_before_residual

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
IMPLS = (REFERENCE, *IMPLEMENTATIONS)   # the default lane's


def _accounts(drafts, case_id: str) -> list:
    case = CASES_BY_ID[case_id]
    dirs = drafts.checkpoint(case)
    return [account(impl, dirs[ADAPTERS[impl]().format_for(case.config)]) for impl in IMPLS
            if cannot_express(impl, case.config) is None]


def _sglang(drafts, case_id: str):
    ckpt_dir = drafts.checkpoint(CASES_BY_ID[case_id])["sglang"]
    return ADAPTERS["sglang"]().load(ckpt_dir, torch.float32), checkpoint_tensors(ckpt_dir)


@pytest.mark.parametrize("case_id,knob,values", [
    ("fc_skip", "fc", {"reference": "40 -> 40, runs at step 0", "speculators": "40 -> 40, runs at step 0",
                       "sglang": "40 -> 40, NOT RUN at step 0"}),
    ("norm_before_residual", "norm_before_residual", {"reference": "True", "speculators": "True", "sglang": "False"}),
    ("two_layers", "layers >= 1 pre-norm", {
        "reference": "layers.1.input_layernorm.weight", "speculators": "layers.1.input_layernorm.weight",
        "sglang": "not from the checkpoint: its own layers.1.hidden_norm.weight"}),
])
def test_observed_knob_rows_disagree_where_the_builds_differ(case_id, knob, values, drafts):
    rows = {r["knob"]: r for r in knob_rows(case_id, _accounts(drafts, case_id), only_disagreements=True)}
    assert knob in rows, f"[{case_id}] no disagreement on {knob!r}: {sorted(rows)}"
    assert {impl: rows[knob][impl] for impl in values} == values, rows[knob]


def test_sglang_residual_knob_follows_its_layer(drafts):
    """The row was hard-coded False; now SGLang's layer 0 patched to add attention to the normed hidden
    reads True, on the same checkpoint."""
    loaded, ckpt = _sglang(drafts, "norm_before_residual")
    assert weights._knobs(loaded, ckpt)["norm_before_residual"] is False
    layer0 = loaded.model.model.layers[0]
    layer0.forward = MethodType(honouring_norm_before_residual, layer0)
    assert weights._knobs(loaded, ckpt)["norm_before_residual"] is True


def test_sglang_pre_norm_knob_follows_its_weights(drafts):
    """The row was hard-coded 'hidden_norm'; it names the weights applied: SGLang's own (never loaded)
    layers.1.hidden_norm, and the checkpoint's input_layernorm once that is what the module holds."""
    loaded, ckpt = _sglang(drafts, "two_layers")
    before = weights._knobs(loaded, ckpt)["layers >= 1 pre-norm"]
    assert before == "not from the checkpoint: its own layers.1.hidden_norm.weight", before
    with torch.no_grad():
        loaded.model.model.layers[1].hidden_norm.weight.copy_(ckpt["layers.1.input_layernorm.weight"])
    assert weights._knobs(loaded, ckpt)["layers >= 1 pre-norm"] == "layers.1.input_layernorm.weight"



@pytest.mark.parametrize("impl", [i for i in ALL_IMPLEMENTATIONS if i not in IMPLEMENTATIONS])   # own lanes (vLLM)
@pytest.mark.parametrize("case_id,knob", [("norm_before_residual", "norm_before_residual"),
                                          ("two_layers", "layers >= 1 pre-norm"), ("gqa", "fc")])
def test_an_own_lane_server_knobs_are_observed(impl, case_id, knob, drafts):
    """vLLM's observed knobs on the drafts where SGLang's build differs: read off its own run, they equal the
    reference's (vLLM applies norm_before_residual and layer 1's input_layernorm) and SGLang's differ
    (test above), so the row tells the two servers apart."""
    case = CASES_BY_ID[case_id]
    dirs = drafts.checkpoint(case)
    got = {name: account(name, dirs[ADAPTERS[name].checkpoint_format]).knobs[knob] for name in (REFERENCE, impl)}
    assert got[impl] == got[REFERENCE], got
