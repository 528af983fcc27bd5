"""NeMo Automodel 0.7.0: its checkpoint layout as the suite's `nemo` format writes it is what NeMo's own
checkpointer writes (config.json, tensor names and bytes, files), and what its checkpointer loads back."""
from __future__ import annotations

import json

import pytest
import torch

from conformance.adapters.nemo.checkpoint import load_with_nemo, save_with_nemo
from conformance.checkpoints import config_json, from_canonical, open_checkpoint, read_weights, write_draft
from conformance.checkpoints.formats import nemo
from fixtures.cases import ALL_CASES
from fixtures.tiny import make_draft_weights

pytestmark = [pytest.mark.cpu]
EXPRESSIBLE = [c for c in ALL_CASES if not nemo.inexpressible(c.config)]


def files(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("case", EXPRESSIBLE, ids=lambda c: c.id)
def test_the_nemo_format_is_what_nemos_checkpointer_writes(case, tmp_path):
    cfg = case.config
    weights = make_draft_weights(cfg, torch.Generator().manual_seed(case.seed))
    ours = write_draft(cfg, weights, tmp_path / "ours", "nemo")
    stored = {from_canonical(k, "nemo"): v for k, v in weights.items()}
    theirs = save_with_nemo(config_json(cfg, "nemo"), stored, tmp_path / "run" / "epoch_0_step_1")
    assert files(theirs) == files(ours)
    assert json.loads((theirs / "config.json").read_text()) == json.loads((ours / "config.json").read_text())
    got, want = read_weights(theirs, stored_names=True), read_weights(ours, stored_names=True)
    assert list(got) == list(want), "tensor names or order differ"
    different = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not different, f"NeMo's checkpointer wrote other bytes for {different}"
    assert open_checkpoint(theirs).config == cfg


def test_nemos_checkpointer_loads_the_nemo_format_bit_for_bit(tmp_path):
    case = EXPRESSIBLE[0]
    weights = make_draft_weights(case.config, torch.Generator().manual_seed(case.seed))
    out = write_draft(case.config, weights, tmp_path / "d", "nemo")
    model = load_with_nemo(out, torch.float32)
    state = {k: v for k, v in model.state_dict().items()}
    stored = read_weights(out, stored_names=True)
    assert set(state) == set(stored)
    assert all(torch.equal(state[k], stored[k]) for k in stored)
    assert files(out) == files(tmp_path / "d")   # loading wrote nothing into the draft's directory
