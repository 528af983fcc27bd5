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

pytestmark = [pytest.mark.cpu, pytest.mark.meta]   # the format and the adapter checked: harness self-tests
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


# ---------------------------------------------------------------- the adapter's stages can fail where they should

# A weight scaled in NeMo's checkpoint -> the first stage the reference (on the unscaled weights) must then part
# at: each hook is read where NeMo computes that stage, so a hook on the wrong module shows another stage.
PLANTS = {"fc.weight": "fc_out", "fc_norm.1.weight": "fc_in_norm", "layers.0.input_layernorm.weight":
          "layers.0.embeds_norm", "layers.0.self_attn.k_proj.weight": "layers.0.k",
          "layers.0.self_attn.o_proj.weight": "layers.0.attn_out", "layers.0.post_attention_layernorm.weight":
          "layers.0.post_attn_norm", "layers.0.mlp.down_proj.weight": "layers.0.mlp_out",
          "norm.weight": "final_norm", "lm_head.weight": "logits"}


@pytest.mark.parametrize("tensor,stage", PLANTS.items(), ids=list(PLANTS))
def test_a_planted_weight_shows_at_its_own_stage(tensor, stage, drafts, tmp_path):
    from conformance.adapters.nemo import NemoAdapter
    from conformance.core.compare import compare_traces
    from fixtures.cases import CASES_BY_ID
    from fixtures.checkpoint import edited_copy

    case = CASES_BY_ID["fc_norm"]

    def scale(weights):
        weights[tensor] = weights[tensor] * 1.5

    planted = edited_copy(drafts.checkpoint(case)[nemo.NAME], tmp_path / "planted", scale)
    actual = NemoAdapter().load(planted, torch.float32).run(drafts.batch(case)).on_cpu()
    first = compare_traces(actual, drafts.trace("reference", case, torch.float32), case.id).first_divergence
    assert first is not None and (first.step, first.stage) == (0, stage), first


# The same for NeMo's MLA draft (DeepseekV3Eagle3DraftModel): a weight, or a slice of one, scaled in its checkpoint ->
# the first stage that must part. The slices split the fused projections where NeMo splits them: the rope rows of
# kv_a_proj_with_mqa (its shared rope key, draft_deepseek.py:187-190) and the k_nope and v rows of each head of
# kv_b_proj (:198-201), so a hook reading the wrong side of a split shows another stage.
MLA_PLANTS = {
    "q_a_layernorm": ("mla_q_lora", "layers.0.self_attn.q_a_layernorm.weight", slice(None), "layers.0.q_latent"),
    "q_b_proj": ("mla_q_lora", "layers.0.self_attn.q_b_proj.weight", slice(None), "layers.0.q"),
    "q_proj": ("mla_direct_q", "layers.0.self_attn.q_proj.weight", slice(None), "layers.0.q"),
    "kv_a_rope_rows": ("mla_q_lora", "layers.0.self_attn.kv_a_proj_with_mqa.weight", "rope", "layers.0.k_rope"),
    "kv_b_k_nope_rows": ("mla_q_lora", "layers.0.self_attn.kv_b_proj.weight", "k_nope", "layers.0.k_rot"),
    "kv_b_v_rows": ("mla_q_lora", "layers.0.self_attn.kv_b_proj.weight", "v", "layers.0.v"),
    "o_proj": ("mla_direct_q", "layers.0.self_attn.o_proj.weight", slice(None), "layers.0.attn_out"),
}


@pytest.mark.parametrize("case_id,tensor,rows,stage", MLA_PLANTS.values(), ids=list(MLA_PLANTS))
def test_a_planted_mla_weight_shows_at_its_own_stage(case_id, tensor, rows, stage, drafts, tmp_path):
    from conformance.adapters.nemo import NemoAdapter
    from conformance.core.compare import compare_traces
    from fixtures.cases import CASES_BY_ID
    from fixtures.checkpoint import edited_copy

    case = CASES_BY_ID[case_id]
    cfg = case.config
    if rows == "rope":   # [latent | rope key] rows of kv_a_proj_with_mqa
        rows = torch.arange(cfg.kv_lora_rank + cfg.qk_rope_head_dim) >= cfg.kv_lora_rank
    elif isinstance(rows, str):   # per head [k_nope | v] rows (kv_b_proj's layout)
        per_head = cfg.qk_nope_head_dim + cfg.v_head_dim
        within = torch.arange(per_head) < cfg.qk_nope_head_dim
        rows = (within if rows == "k_nope" else ~within).repeat(cfg.num_attention_heads)

    def scale(weights):
        weights[tensor] = weights[tensor].clone()
        weights[tensor][rows] *= 1.5

    planted = edited_copy(drafts.checkpoint(case)[nemo.NAME], tmp_path / "planted", scale)
    actual = NemoAdapter().load(planted, torch.float32).run(drafts.batch(case)).on_cpu()
    first = compare_traces(actual, drafts.trace("reference", case, torch.float32), case.id).first_divergence
    assert first is not None and (first.step, first.stage) == (0, stage), first


def test_steps_feed_back_what_nemo_feeds_back(drafts):
    """Step k's hidden_in is step k-1's recurrent_hidden (NeMo's cur_hidden_states), and with norm_output the
    post-norm hidden (draft_llama.py:1011-1012): recorded from the modules, never assumed."""
    from conformance.adapters.nemo import NemoAdapter
    from fixtures.cases import CASES_BY_ID

    for case_id, normed in (("ms_gqa", False), ("ms_norm_output", True)):
        case = CASES_BY_ID[case_id]
        trace = NemoAdapter().load(drafts.checkpoint(case)[nemo.NAME], torch.float32).run(drafts.batch(case, 3), 3)
        for k in (1, 2):
            assert torch.equal(trace.steps[k]["hidden_in"], trace.steps[k - 1]["recurrent_hidden"]), (case_id, k)
        fed = trace.steps[0]["recurrent_hidden"]
        assert torch.equal(fed, trace.steps[0]["final_norm"] if normed else trace.steps[0]["layers.0.layer_out"])


# Planted into one loaded MLA draft's attention (Eagle3DeepseekMLAAttention.forward, draft_deepseek.py:208-228), the
# TTT recurrence bugs multi-step drafting must catch, each at the step and stage where it acts: its keys turned at
# the step-0 positions (no `position_ids + step_idx`, :219-222), and the keys of the steps between 0 and the current
# one forgotten (only step 0's cache and its own kept), which training's diagonal attention reads (:245-258).
def _without_step_offset(forward):
    def planted(states, mask, position_ids, cache):
        return forward(states, mask, position_ids - len(cache[0]), cache)
    return planted


def _forgetting_middle_steps(forward):
    def planted(states, mask, position_ids, cache):
        kept = [cache[0][:1], cache[1][:1]]   # NeMo appends this step's k/v to the list it is given
        # its rotary offset is len(cache[0]) (:219): the positions make up for the steps dropped
        out = forward(states, mask, position_ids + max(len(cache[0]) - 1, 0), kept)
        cache[0].append(kept[0][-1])
        cache[1].append(kept[1][-1])
        return out
    return planted


@pytest.mark.parametrize("plant,step,stage", [(_without_step_offset, 1, "layers.0.k_rope"),
                                              (_forgetting_middle_steps, 2, "layers.0.attn_core")],
                         ids=["without_step_offset", "forgetting_middle_steps"])
def test_a_planted_mla_recurrence_bug_shows_at_its_step_and_stage(plant, step, stage, drafts):
    from conformance.adapters.nemo import NemoAdapter
    from conformance.core.compare import compare_traces
    from fixtures.cases import CASES_BY_ID

    case, steps = CASES_BY_ID["ms_mla_q_lora"], 3
    loaded = NemoAdapter().load(drafts.checkpoint(case)[nemo.NAME], torch.float32)
    attn = loaded.model.model.layers[0].self_attn
    attn.forward = plant(attn.forward)
    actual = loaded.run(drafts.batch(case, steps), steps).on_cpu()
    first = compare_traces(actual, drafts.trace("reference", case, torch.float32, steps), case.id).first_divergence
    assert first is not None and (first.step, first.stage) == (step, stage), first
