"""SGLang 0.5.23's MLA EAGLE-3 draft (models/kimi_k25_eagle3.py, `Eagle3DeepseekV2ForCausalLM`) on this CPU: a
tiny draft shaped like the published Kimi-K2.5 one (fixtures/mla.py), built and loaded by SGLang's own class and
`load_weights`, and accounted for tensor by tensor (conformance/adapters/sglang/weights.py): every checkpoint
tensor lands bit for bit (q_a_proj and kv_a_proj_with_mqa in their rows of the fused parameter SGLang builds),
or is named. What SGLang does otherwise than training is stated as its registry entries (mla.entries(): the
registry's sglang-mla-*). Then its chain over its own MLA KV pool
(conformance/adapters/sglang/mla.py: step 0, then teacher-forced DECODE steps): the attention's stages of every
step against the reference's `mla_attention` on the same attention input, fp32 and bf16.
"""
from __future__ import annotations

import logging

import pytest
import torch

from conformance.adapters.sglang.mla import against_reference, entries
from conformance.adapters.sglang.weights import account_mla
from conformance.core.matching import KnownDivergenceHit, settle_accounting
from conformance.core.tolerances import DTYPES
from fixtures.mla import (ABSENT, LAYOUTS, TINY, TINY_ROPE, make_mla_config, make_mla_weights,
                          write_mla_checkpoint)
from reference import eagle3 as ref

pytestmark = pytest.mark.cpu
SEED = 20260
SGLANG_MLA_LOGGER = "sglang.srt.models.kimi_k25_eagle3"
FUSED = "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"

ENTRIES_BY_ID = {e.id: e for e in entries()}


def checkpoint(tmp_path, name="draft", layout="layers.0", edit=None, **config_changes):
    cfg = make_mla_config(**config_changes)
    weights = make_mla_weights(cfg, torch.Generator().manual_seed(SEED), layout)
    if edit is not None:
        edit(weights, cfg)
    return write_mla_checkpoint(tmp_path / name, cfg, weights)


@pytest.fixture
def patched_sglang():
    """Apply a source_patcher config (SGLang's own planting mechanism) for the test; restored afterwards."""
    from sglang.srt.debug_utils.source_patcher import apply_patches_from_config

    states = []
    yield lambda config: states.extend(apply_patches_from_config(config))
    for state in reversed(states):
        state.restore()


# ---------------------------------------------------------------- as published: every tensor lands

@pytest.mark.meta
def test_the_tiny_draft_is_the_published_config_made_small():
    """Every key of the published config and no other, each size smaller, every other value as published."""
    import json

    from fixtures.mla import PUBLISHED

    published, tiny = json.loads(PUBLISHED.read_text()), make_mla_config()
    assert tiny.keys() == published.keys()
    changed = {k for k in published if tiny[k] != published[k]}
    assert changed <= {*TINY, "rope_scaling", "eagle_config"}, sorted(changed)
    for key in changed & {k for k, v in published.items() if isinstance(v, int) and not isinstance(v, bool)}:
        assert tiny[key] < published[key], key
    assert {k: v for k, v in tiny["rope_scaling"].items() if k not in TINY_ROPE} == \
        {k: v for k, v in published["rope_scaling"].items() if k not in TINY_ROPE}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_mla_tensor_lands_bit_for_bit(layout, tmp_path, repro):
    """Both of TorchSpec's export layouts: SGLang maps `layers.0.*` and `midlayer.*` alike onto its midlayer."""
    acct, model = account_mla(checkpoint(tmp_path, layout=layout), torch.float32)
    settle_accounting(acct, (), f"sglang MLA weight accounting [{layout}]", repro)
    cfg = make_mla_config()
    q, kv = cfg["q_lora_rank"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    landed = dict(acct.landed)
    assert landed[f"{layout}.self_attn.q_a_proj.weight"] == f"{FUSED}[0:{q}]", acct.landed
    assert landed[f"{layout}.self_attn.kv_a_proj_with_mqa.weight"] == f"{FUSED}[{q}:{q + kv}]", acct.landed
    assert landed["d2t"] == "hot_token_id (d2t + arange)" and acct.ignored == ["t2d"], acct.row(layout)
    assert len(acct.landed) + len(acct.ignored) == acct.tensors, acct.row(layout)
    assert acct.uses["lm_head"] == "checkpoint lm_head", acct.uses
    assert type(model).__name__ == "Eagle3DeepseekV2ForCausalLM"


@pytest.mark.meta
def test_fused_rows_in_the_wrong_order_are_named(tmp_path, patched_sglang):
    """Planted in SGLang's own load_weights: the fused down projection concatenated kv first. Both pieces land
    in the rows the accounting expects them in, with other values there: both are named."""
    patched_sglang("""
patches:
  - target: sglang.srt.models.kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM.load_weights
    edits:
      - match: |
          [cached_a_proj[q_name], cached_a_proj[kv_name]], dim=0
        replacement: |
          [cached_a_proj[kv_name], cached_a_proj[q_name]], dim=0
""")
    acct, _ = account_mla(checkpoint(tmp_path), torch.float32)
    cfg = make_mla_config()
    q, kv = cfg["q_lora_rank"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert acct.differs == [f"{FUSED}[0:{q}]", f"{FUSED}[{q}:{q + kv}]"], acct.row("planted")


@pytest.mark.meta
def test_a_corrupted_tensor_is_named(tmp_path, patched_sglang):
    """Planted in SGLang's own load_weights: the plain (unfused) path writes one tensor scaled. Only it is named."""
    patched_sglang("""
patches:
  - target: sglang.srt.models.kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM.load_weights
    edits:
      - match: |
          param = params_dict[mapped_name]
        replacement: |
          param = params_dict[mapped_name]
          if mapped_name.endswith("kv_b_proj.weight"):
              loaded_weight = loaded_weight * 2
""")
    acct, _ = account_mla(checkpoint(tmp_path), torch.float32)
    assert acct.differs == ["model.midlayer.self_attn.kv_b_proj.weight"], acct.row("planted")


@pytest.mark.meta
def test_a_fused_piece_without_its_partner_is_dropped_silently(tmp_path, caplog):
    """SGLang holds q_a_proj until kv_a_proj_with_mqa comes (kimi_k25_eagle3.py:467-492); when it never comes, the
    held tensor is dropped without a warning and the fused parameter keeps its uninitialised memory."""
    def edit(w, cfg):
        del w["layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    with caplog.at_level(logging.WARNING, logger=SGLANG_MLA_LOGGER):
        acct, _ = account_mla(checkpoint(tmp_path, edit=edit), torch.float32)
    assert acct.dropped == ["layers.0.self_attn.q_a_proj.weight"], acct.row("planted")
    assert acct.never_loaded == [FUSED], acct.row("planted")
    assert not [r for r in caplog.records if "q_a_proj" in r.getMessage()], "SGLang warned after all"


@pytest.mark.parametrize("names", ["fc_norm", "aux_norm"], ids=["fc_norm_names", "legacy_aux_norm_names"])
def test_eagle31_fc_norm_lands_under_its_own_names_only(names, tmp_path):
    """EAGLE-3.1's per-aux norms (`fc_norm: true`, read by Eagle3MLAModel, kimi_k25_eagle3.py:228-241) land under
    `fc_norm.{i}`. The legacy `aux_norm_low/mid/high` names, which SGLang's Llama draft maps onto them
    (llama_eagle3.py:337-347), this loader does not map: skipped with a warning, the norms keep their init."""
    legacy = ("aux_norm_low", "aux_norm_mid", "aux_norm_high")

    def edit(w, cfg):
        for i in range(3):
            w[f"fc_norm.{i}.weight" if names == "fc_norm" else f"{legacy[i]}.weight"] = \
                torch.linspace(0.5 + i, 1.5 + i, cfg["hidden_size"])
    acct, _ = account_mla(checkpoint(tmp_path, edit=edit, fc_norm=True, norm_output=True), torch.float32)
    norms = [f"model.fc_norm.{i}.weight" for i in range(3)]
    if names == "fc_norm":
        assert not acct.problems and {p for _, p in acct.landed} >= set(norms), acct.row(names)
    else:
        assert acct.dropped == sorted(f"{n}.weight" for n in legacy) and acct.never_loaded == norms, acct.row(names)


@pytest.mark.parametrize("architecture,mla", [("Eagle3DeepseekV2ForCausalLM", True),
                                               ("Eagle3DeepseekV3ForCausalLM", False)], ids=["v2_name", "v3_name"])
def test_the_model_runner_reads_the_draft_as_mla(architecture, mla, tmp_path):
    """What SGLang's model runner sizes the draft's KV pool from (ModelConfig: model_config.py:1392-1400) and the aux
    ids it hands the target (eagle_config). The published name is MLA; vLLM's other name for the same draft
    (`Eagle3DeepseekV3ForCausalLM`, vLLM 0.33.0 model_executor/models/registry.py:712-713) is neither MLA here nor
    loadable."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    from conformance.adapters.sglang.target import AuxIds, sglang_aux_layer_ids

    cfg = make_mla_config(architectures=[architecture])
    draft = checkpoint(tmp_path, architectures=[architecture])
    read = ModelConfig(str(draft), is_draft_model=True, speculative_algorithm="EAGLE3", trust_remote_code=False)
    assert (read.attention_arch == AttentionArch.MLA) is mla
    assert sglang_aux_layer_ids(draft) == AuxIds(True, tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]))
    if mla:
        assert (read.kv_lora_rank, read.qk_rope_head_dim) == (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"])
    else:
        acct, model = account_mla(draft, torch.float32)
        assert model is None and architecture in acct.refused, acct.row(architecture)


# ---------------------------------------------------------------- what SGLang does otherwise than training

def test_input_norm_is_skipped_with_a_warning_only(tmp_path, caplog, repro):
    """A norm_before_fc draft's input_norm: SGLang's MLA draft has nowhere to put it; its loader logs and goes on."""
    def edit(w, cfg):
        w["input_norm.weight"] = torch.linspace(0.5, 1.5, 3 * cfg["hidden_size"])
    with caplog.at_level(logging.WARNING, logger=SGLANG_MLA_LOGGER):
        acct, _ = account_mla(checkpoint(tmp_path, edit=edit), torch.float32)
    assert acct.dropped == ["input_norm.weight"] and not acct.refused, acct.row("norm_before_fc")
    # once per load: the adapter's, then the accounting's replay
    assert {r.getMessage() for r in caplog.records if r.name == SGLANG_MLA_LOGGER} == {
        "Eagle3 MLA: skipping unexpected weight input_norm.weight"}
    with pytest.raises(KnownDivergenceHit):
        settle_accounting(acct, entries(), "sglang MLA weight accounting [norm_before_fc]", repro)


@pytest.mark.meta
def test_the_input_norm_entry_hides_no_other_dropped_tensor(tmp_path, repro):
    def edit(w, cfg):
        w["input_norm.weight"] = torch.ones(3 * cfg["hidden_size"])
        w["layers.0.self_attn.q_norm.weight"] = torch.ones(cfg["qk_nope_head_dim"])
    acct, _ = account_mla(checkpoint(tmp_path, edit=edit), torch.float32)
    with pytest.raises(AssertionError) as info:
        settle_accounting(acct, entries(), "sglang MLA weight accounting [planted]", repro)
    assert not isinstance(info.value, KnownDivergenceHit)
    assert "q_norm.weight" in str(info.value).split("registry:")[-1], str(info.value)


def test_q_straight_from_the_input_is_refused(tmp_path, repro):
    """`q_lora_rank: null` (q_proj, as training allows): SGLang's own words, matched by the pending load entry."""
    acct, model = account_mla(checkpoint(tmp_path, q_lora_rank=None), torch.float32)
    assert model is None and acct.refused == "Eagle3 MLA layer requires q_lora_rank in the draft config", acct.row("q")
    with pytest.raises(KnownDivergenceHit):
        settle_accounting(acct, entries(), "sglang MLA weight accounting [q_lora_rank null]", repro)


@pytest.mark.meta
def test_the_q_lora_entry_matches_only_its_message(tmp_path, repro):
    from dataclasses import replace

    acct, _ = account_mla(checkpoint(tmp_path, q_lora_rank=None), torch.float32)
    other = replace(ENTRIES_BY_ID["sglang-mla-requires-q-lora"], message="requires kv_lora_rank")
    with pytest.raises(AssertionError) as info:
        settle_accounting(acct, (other,), "sglang MLA weight accounting [planted]", repro)
    assert not isinstance(info.value, KnownDivergenceHit), str(info.value)


def test_an_absent_q_lora_rank_is_deepseeks_default(tmp_path):
    """No q_lora_rank key at all: SGLang reads the draft through DeepseekV3Config (model_type kimi_k2,
    utils/hf_transformers/common.py:229-233), whose default q_lora_rank is 1536, and builds the q LoRA path; a
    q_proj checkpoint then loads into nothing. The q_proj is skipped with a warning, its kv_a_proj_with_mqa is
    held for a q_a_proj that never comes and dropped silently; the q path keeps uninitialised memory."""
    acct, model = account_mla(checkpoint(tmp_path, q_lora_rank=ABSENT), torch.float32)
    assert model.model.midlayer.self_attn.q_lora_rank == 1536
    assert acct.dropped == ["layers.0.self_attn.kv_a_proj_with_mqa.weight", "layers.0.self_attn.q_proj.weight"], \
        acct.row("absent")
    assert acct.never_loaded == [FUSED, "model.midlayer.self_attn.q_a_layernorm.weight",
                                 "model.midlayer.self_attn.q_b_proj.weight"], acct.row("absent")


@pytest.mark.parametrize("draft_vocab_size,lm_head", [
    (61, "checkpoint lm_head"),
    (ABSENT, "the target's lm_head (no draft_vocab_size, kimi_k25_eagle3.py:355-358)"),
], ids=["with_draft_vocab_size", "without"])
def test_lm_head_comes_from_the_target_without_draft_vocab_size(draft_vocab_size, lm_head, tmp_path):
    """The registry's `sglang-lm-head-from-target-without-draft-vocab` (settings, asserted) observed on the MLA class:
    without draft_vocab_size its serving worker replaces the trained lm_head (and embedding) with the target's
    (eagle_worker_v2.py:355-360). Either way the checkpoint's own lm_head lands here."""
    acct, model = account_mla(checkpoint(tmp_path, draft_vocab_size=draft_vocab_size), torch.float32)
    assert acct.uses["lm_head"] == lm_head and not acct.problems, acct.row(str(draft_vocab_size))
    assert model.load_lm_head_from_target is (draft_vocab_size is ABSENT)


@pytest.mark.meta
def test_a_head_kept_without_draft_vocab_size_is_seen(tmp_path, monkeypatch):
    """Planted: SGLang's class keeps its own head without draft_vocab_size; the reading above sees it. (Its
    __init__ calls super(), which source_patcher cannot recompile: the plant wraps it instead.)"""
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM

    built = Eagle3DeepseekV2ForCausalLM.__init__

    def keeps_its_head(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.load_lm_head_from_target = False
    monkeypatch.setattr(Eagle3DeepseekV2ForCausalLM, "__init__", keeps_its_head)
    acct, _ = account_mla(checkpoint(tmp_path, draft_vocab_size=ABSENT), torch.float32)
    assert acct.uses["lm_head"] == "checkpoint lm_head", acct.uses


# ---------------------------------------------------------------- step 0: the attention over SGLang's MLA pool

LENGTHS = [5, 3]   # two requests, packed
F32 = torch.float32


def reference_mla(cfg: dict) -> ref.MLAConfig:
    """The draft config as training reads it (DeepseekV3Config's names and defaults; yarn's legacy `type` key)."""
    from inspect import signature

    from transformers import DeepseekV3Config

    scaling = dict(cfg["rope_scaling"])
    scaling["rope_type"] = scaling.pop("type")
    defaults = signature(DeepseekV3Config.__init__).parameters
    return ref.MLAConfig(
        num_attention_heads=cfg["num_attention_heads"], q_lora_rank=cfg["q_lora_rank"],
        kv_lora_rank=cfg["kv_lora_rank"], qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"], rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"], rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", defaults["max_position_embeddings"].default),
        rope_interleave=cfg.get("rope_interleave", defaults["rope_interleave"].default))


def attention_results(tmp_path, offset: int, dtype: torch.dtype = F32, steps: int = 1):
    """SGLang's chain in `dtype` (step 0, then teacher-forced DECODE steps) on two seeded requests starting at
    position `offset`; each attention stage of each step compared with the reference's mla_attention fed SGLang's
    own attention input, in the dtype the suite holds `dtype` against (tolerances.AGAINST: fp32 itself, bf16 the
    fp64 reference). At step k >= 1 SGLang runs each request's last row only; the reference runs every row (its
    other rows' inputs zero: a row's step-k key is visible to that row alone) and its last rows are compared."""
    cfg = make_mla_config()
    weights = make_mla_weights(cfg, torch.Generator().manual_seed(SEED))
    _, model = account_mla(write_mla_checkpoint(tmp_path / "draft", cfg, weights), dtype)
    g = torch.Generator().manual_seed(SEED + 1)
    T, H = sum(LENGTHS), cfg["hidden_size"]
    aux = torch.randn(T, 3 * H, generator=g)
    input_ids = torch.randint(0, cfg["vocab_size"], (T,), generator=g)
    next_ids = torch.randint(0, cfg["vocab_size"], (len(LENGTHS), steps - 1), generator=g)
    index = torch.cat([torch.arange(n) for n in LENGTHS])
    return against_reference(model, weights, reference_mla(cfg), aux, input_ids, index + offset, LENGTHS,
                             next_ids if steps > 1 else None)[0]


def first_failed(results):
    return next((r for r in results if r.failed), None)


@pytest.mark.parametrize("offset", [3, 200], ids=["positions_from_3", "deep_positions"])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_mla_attention_at_step0_matches_the_reference(dtype_name, offset, tmp_path):
    """Deep positions: past yarn's original context (64), within the scaled one (x factor 4), the extent of
    SGLang's cos/sin cache (layers/rotary_embedding/rope_variant.py:406-411: original context x factor)."""
    results = attention_results(tmp_path, offset, DTYPES[dtype_name])
    assert_conforms(results)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_mla_attention_over_three_teacher_forced_steps_matches_the_reference(dtype_name, tmp_path):
    """K = 3: steps 1 and 2 are SGLang's DECODE passes over its pool (the request's step-0 latents and its own
    earlier draft tokens), at positions last + k."""
    assert_conforms(attention_results(tmp_path, 3, DTYPES[dtype_name], steps=3))


def assert_conforms(results):
    __tracebackhide__ = True
    bad = first_failed(results)
    assert bad is None, (f"sglang MLA draft diverges from the reference at step {bad.step} `{bad.stage}`: max abs "
                         f"{bad.max_abs:.3e} at {bad.abs_index} {bad.detail}")


# Faults planted in SGLang's own absorbed-MLA code (forward_mla.py) through its source_patcher: each must be
# the first divergence, at exactly its stage.
MLA_PREPARE = ("sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla."
               "DeepseekMLAForwardMixin.forward_absorb_prepare")
PLANTED_MLA = {
    # the latent's kv_a_layernorm skipped (what the pool caches is the raw latent)
    "latent_norm_skipped": ("layers.0.kv_latent", """
          q = self.q_a_layernorm(q)
          k_nope = self.kv_a_layernorm(k_nope)
        replacement: |
          q = self.q_a_layernorm(q)
"""),
    # the rope slice of q and of the shared key left unrotated
    "rope_not_rotated": ("layers.0.k_rope", """
          ):
              q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        replacement: |
          ):
              pass
"""),
}


def prepare_patch(edit: str) -> str:
    """A source_patcher config applying one PLANTED_MLA edit to forward_absorb_prepare."""
    return f"""
patches:
  - target: {MLA_PREPARE}
    edits:
      - match: |{edit}"""


@pytest.mark.meta
@pytest.mark.parametrize("plant", list(PLANTED_MLA))
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_a_planted_mla_fault_fails_at_its_stage(dtype_name, plant, tmp_path, patched_sglang):
    stage, edit = PLANTED_MLA[plant]
    patched_sglang(prepare_patch(edit))
    bad = first_failed(attention_results(tmp_path, 3, DTYPES[dtype_name]))
    assert bad is not None and bad.stage == stage, f"planted {plant}: first divergence {bad and bad.stage}"


# Planted in SGLang's torch_native DECODE: the softmax scale doubled.
DECODE_SCALE_DOUBLED = """
patches:
  - target: sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode
    edits:
      - match: |
          scaling=layer.scaling,
        replacement: |
          scaling=layer.scaling * 2,
"""


@pytest.mark.meta
def test_a_decode_only_fault_fails_at_step_1(tmp_path, patched_sglang):
    """Planted in SGLang's torch_native DECODE: the softmax scale doubled. Step 0's first-token DECODE attends to one
    key (a softmax of one is 1 whatever the scale), so the first divergence is step 1's attention output."""
    patched_sglang(DECODE_SCALE_DOUBLED)
    bad = first_failed(attention_results(tmp_path, 3, F32, steps=3))
    assert bad is not None and (bad.step, bad.stage) == (1, "layers.0.attn_out"), \
        f"first divergence {bad and (bad.step, bad.stage)}"


# ---------------------------------------------------------------- the matrix's SGLang column on the MLA cases
# (conformance/draft/test_step0.py, test_multistep.py): SGLang's MLA class loaded from the case's sglang-mla
# checkpoint by the adapter, its trace compared by compare_traces as every pair's is.

def matrix_comparison(drafts, case_id: str, ckpt=None, steps: int = 1):
    from conformance.adapters import ADAPTERS, REFERENCE
    from conformance.core.compare import compare_traces
    from fixtures.cases import CASES_BY_ID

    case = CASES_BY_ID[case_id]
    actual = ADAPTERS["sglang"]().load(ckpt or drafts.directory("sglang", case), F32).run(
        drafts.batch(case, steps), steps)
    return compare_traces(actual, drafts.trace(REFERENCE, case, F32, steps), case.id)


def assert_first_divergence(comparison, step: int, stage: str):
    __tracebackhide__ = True
    first = comparison.first_divergence
    assert first is not None and (first.step, first.stage) == (step, stage), \
        f"expected step {step} `{stage}`, got:\n{comparison.message('-')}"
    message = comparison.message("python -m pytest 'x::y'")
    for part in ("sglang", comparison.case_id, f"step {step}", f"stage '{stage}'", "max abs error", "repro:"):
        assert part in message, f"failure message lacks {part!r}:\n{message}"


def test_the_mla_trace_has_every_stage_it_claims(drafts):
    """What the column compares: the attention stages, the logits and the drafted ids, each produced; nothing it
    does not produce is claimed (a claimed stage it lacks would fail as missing)."""
    from conformance.core import stages
    from fixtures.cases import CASES_BY_ID

    case = CASES_BY_ID["mla_q_lora"]
    trace = drafts.trace("sglang", case, F32)
    expected = drafts.trace("reference", case, F32)
    assert trace.claimed_stages >= {"q_latent", "kv_latent", "k_rope", "attn_out", "logits"}, trace.claimed_stages
    missing = [s for s in expected.steps[0] if s.rsplit(".", 1)[-1] in trace.claimed_stages and s not in trace.steps[0]]
    assert not missing, f"sglang claims but did not produce: {missing}"
    unclaimed = {s.rsplit(".", 1)[-1] for s in trace.steps[0]} - trace.claimed_stages
    assert not unclaimed and set(trace.steps[0]) <= set(stages.stage_names(1)), sorted(trace.steps[0])


@pytest.mark.meta
@pytest.mark.parametrize("plant", list(PLANTED_MLA))
def test_the_matrix_names_a_planted_mla_fault_at_its_stage(plant, drafts, patched_sglang):
    stage, edit = PLANTED_MLA[plant]
    patched_sglang(prepare_patch(edit))
    assert_first_divergence(matrix_comparison(drafts, "mla_q_lora"), 0, stage)


@pytest.mark.meta
@pytest.mark.parametrize("tensor,stage", [("layers.0.mlp.down_proj.weight", "layers.0.mlp_out"),
                                          ("norm.weight", "logits")], ids=["mlp", "final_norm"])
def test_the_matrix_names_a_fault_outside_the_attention(tensor, stage, drafts, tmp_path):
    """Outside the attention: the MLP's output is claimed; the final norm is not (fused with the residual add), and
    with norm_output false the hidden fed back is the pre-norm one, so a fault there is named at the logits."""
    from fixtures.cases import CASES_BY_ID
    from fixtures.checkpoint import edited_copy

    def edit(w):
        w[tensor][3] += 0.5
    ckpt = edited_copy(drafts.directory("sglang", CASES_BY_ID["mla_q_lora"]), tmp_path / "planted", edit)
    assert_first_divergence(matrix_comparison(drafts, "mla_q_lora", ckpt), 0, stage)


@pytest.mark.meta
def test_the_matrix_sees_the_rope_order_sglang_reads(drafts, tmp_path):
    """SGLang reads rope_interleave (deepseek_v2.py:2166: is_neox_style); the written flag flipped on an interleaved
    draft turns its rope slice half-split, first seen in the cached rope key."""
    import json
    import shutil

    from fixtures.cases import CASES_BY_ID

    ckpt = shutil.copytree(drafts.directory("sglang", CASES_BY_ID["mla_q_lora"]), tmp_path / "flipped")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["rope_interleave"] is True
    (ckpt / "config.json").write_text(json.dumps({**config, "rope_interleave": False}))
    assert_first_divergence(matrix_comparison(drafts, "mla_q_lora", ckpt), 0, "layers.0.k_rope")


@pytest.mark.meta
def test_the_matrix_names_a_decode_only_fault_at_step_1(drafts, patched_sglang):
    """The teacher-forced column's later steps are SGLang's DECODE passes: its softmax scale doubled there shows at
    step 1's attention output (step 0's first-token DECODE attends to one key, where any scale gives 1)."""
    patched_sglang(DECODE_SCALE_DOUBLED)
    assert_first_divergence(matrix_comparison(drafts, "ms_mla_q_lora", steps=3), 1, "layers.0.attn_out")


@pytest.mark.parametrize("case_id,rotary,neox", [("mla_q_lora", "RotaryEmbedding", False),
                                                 ("mla_rope_half_split", "RotaryEmbedding", True),
                                                 ("mla_rope_yarn", "DeepseekScalingRotaryEmbedding", False)])
def test_the_mla_rope_is_built_as_served(case_id, rotary, neox, drafts):
    """A plain rope through SGLang's serving factory (draft_model.serving_mla_rope: its CPU factory asserts on it),
    a scaled one through its CPU factory, the order from rope_interleave; SGLang's module is left as it was."""
    from sglang.srt.layers.rotary_embedding import get_rope_wrapper
    from sglang.srt.models import deepseek_v2

    from conformance.adapters.sglang.draft_model import load_model
    from fixtures.cases import CASES_BY_ID

    model = load_model(drafts.directory("sglang", CASES_BY_ID[case_id]), F32)
    rope = model.model.midlayer.self_attn.rotary_emb
    assert (type(rope).__name__, rope.is_neox_style) == (rotary, neox)
    assert deepseek_v2.get_rope_wrapper is get_rope_wrapper
