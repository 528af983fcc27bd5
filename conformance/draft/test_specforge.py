"""SpecForge 0.2.0's adapter (conformance/adapters/specforge/): what its conformance runs rest on, and the
facts about SpecForge they found. The conformance itself runs in test_step0.py / test_multistep.py like
every implementation's; these check the adapter's own choices can fail where they should:

- its CPU loss shim feeds nothing back into the draft (a NaN loss leaves every stage as it was);
- SpecForge's teacher forcing shifts ids per row, so at step k the last k rows of every sequence but the
  last embed SpecForge's 0 padding: a trace claiming those rows diverges at `input_ids` (Trace.rows
  keeps them out, and only them);
- a config written for the others (`norm_output: false`) makes SpecForge drop its final norm;
- the trainer's loading path builds the rotary cache; `AutoDraftModel.from_pretrained` leaves it
  uninitialised under transformers 5.19 (the reason the adapter loads as the trainer does).
"""
from __future__ import annotations

import json

import pytest
import torch

from conformance.core.trace import Trace
from conformance.adapters.specforge.adapter import PaddedRows, SpecForgeAdapter
from conformance.adapters.specforge.shims import torch_loss
from conformance.checkpoints import CONFIG_FILE, read_weights, write_draft
from conformance.checkpoints.formats import sglang
from conformance.core.compare import compare_traces
from fixtures.cases import CASES_BY_ID

pytestmark = pytest.mark.cpu
IMPL = SpecForgeAdapter.name
CASE = CASES_BY_ID["fc_norm_target_hidden"]   # fc_norm, Ht != H, d2t: what SpecForge can express, all of it
MS_CASE = CASES_BY_ID["ms_target_hidden"]
STEPS = 3


@pytest.fixture(scope="module")
def loaded(drafts):
    return SpecForgeAdapter().load(drafts.checkpoint(CASE)[SpecForgeAdapter.checkpoint_format], torch.float32)


class NaNLoss(torch.autograd.Function):
    """A loss that is all NaN: if anything of it reached the draft, its stages would turn NaN."""

    @staticmethod
    def forward(ctx, logits, target_p, position_mask):
        return torch.full((), float("nan"))


def test_loss_shim_feeds_nothing_back(loaded, drafts, monkeypatch):
    batch = drafts.batch(MS_CASE, STEPS)
    rows = PaddedRows(batch, torch.float32)
    shimmed = loaded.forward(rows, STEPS, record=True)
    monkeypatch.setattr("conformance.adapters.specforge.adapter.torch_loss", lambda: torch_loss(NaNLoss))
    poisoned = loaded.forward(rows, STEPS, record=True)
    assert [sorted(s) for s in shimmed] == [sorted(s) for s in poisoned]
    differ = [(k, name) for k, s in enumerate(shimmed) for name in s if not torch.equal(s[name], poisoned[k][name])]
    assert not differ, f"SpecForge's stages depend on the loss: {differ}"


def test_loss_shim_is_scoped_to_the_call(loaded, drafts):
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.core.loss import LogSoftmaxLoss

    loaded.run(drafts.batch(MS_CASE, 2), 2)
    assert eagle3_model.LogSoftmaxLoss is LogSoftmaxLoss, "the loss shim outlived the adapter's call"


def test_every_claimed_stage_is_produced(drafts):
    trace = drafts.trace(IMPL, MS_CASE, torch.float32, STEPS)
    expected = drafts.trace("reference", MS_CASE, torch.float32, STEPS)
    for k in range(STEPS):
        missing = [s for s in expected.steps[k] if s.rsplit(".", 1)[-1] in trace.claimed_stages
                   and s not in trace.steps[k]]
        assert not missing, f"step {k}: SpecForge's adapter claims but did not produce {missing}"


def test_per_row_shift_rows_are_the_only_ones_left_out(loaded, drafts, repro):
    """Claiming every row at steps >= 1 must fail at `input_ids` (the finding: SpecForge pads each row
    with 0 where the packed batch continues with the next sequence); the covered rows conform."""
    case = MS_CASE
    batch = drafts.batch(case, STEPS)
    full = loaded.forward(PaddedRows(batch, torch.float32), STEPS, record=True)
    full[0]["aux_in"] = batch.aux.float()
    every_row = Trace(IMPL, torch.float32, full, [{} for _ in full], claimed_stages=SpecForgeAdapter.claimed_stages,
                      num_layers=1)
    expected = drafts.trace("reference", case, torch.float32, STEPS)
    first = compare_traces(every_row, expected, case.id).first_divergence
    assert first is not None and (first.step, first.stage) == (1, "input_ids"), first
    lengths = torch.bincount(batch.seq_ids).tolist()
    wrong = (full[1]["input_ids"] != expected.steps[1]["input_ids"]).nonzero().flatten().tolist()
    ends = torch.tensor(lengths).cumsum(0).tolist()
    assert wrong == [end - 1 for end in ends[:-1]], f"rows {wrong} differ; sequence ends {ends}"
    covered = loaded.run(batch, STEPS)
    comparison = compare_traces(covered, expected, case.id)
    assert comparison.first_divergence is None, comparison.message(repro)


def test_config_written_for_the_others_drops_the_final_norm(drafts, tmp_path):
    """`norm_output: false` (speculators', SGLang's and vLLM's default: feed the pre-norm hidden back) means
    "no final norm before lm_head" to SpecForge (llama3_eagle.py:1690, 1773): its logits then differ."""
    case = CASES_BY_ID["gqa"]
    cfg = case.config
    out = write_draft(cfg, read_weights(drafts.checkpoint(case)["speculators"]), tmp_path / "d", "specforge")
    config = json.loads((out / CONFIG_FILE).read_text())
    config["norm_output"] = sglang.config_json(cfg)["norm_output"]
    assert config["norm_output"] is False
    (out / CONFIG_FILE).write_text(json.dumps(config))
    trace = SpecForgeAdapter().load(out, torch.float32).run(drafts.batch(case))
    first = compare_traces(trace, drafts.trace("reference", case, torch.float32), case.id).first_divergence
    assert first is not None and (first.step, first.stage) == (0, "final_norm") and first.verdict == "missing", first


def test_rotary_cache_from_the_trainer_path_not_from_pretrained(loaded):
    """The trainer's path (from_config + warm_start) computes SpecForge's rotary inverse frequencies; the
    finding: AutoDraftModel.from_pretrained leaves those non-persistent buffers as uninitialised memory under
    transformers 5.19 (llama3_eagle.py:218-301 computes them in __init__, which HF 5.x runs on the meta device)."""
    from specforge.modeling.auto import AutoDraftModel

    rotary = loaded.model.midlayer.self_attn.rotary_emb
    cfg = CASE.config
    formula = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    assert torch.equal(rotary.inv_freq, formula), "the trainer's path did not build the rotary cache"
    with torch.random.fork_rng():
        pretrained = AutoDraftModel.from_pretrained(loaded.report.source, attention_backend="sdpa")
    assert not torch.equal(pretrained.midlayer.self_attn.rotary_emb.inv_freq, formula), \
        "from_pretrained now builds the rotary cache: the finding is gone (docs/specforge.md)"
