"""The reference's MLA block against transformers' own DeepSeek-V3 attention (the semantics it claims).

`reference.eagle3.mla_attention` and transformers 5.19.0's `DeepseekV3Attention`, each with its own
RoPE tables (`rope_cos_sin`; `DeepseekV3RotaryEmbedding`), run on the same seeded weights and input in
fp32, q direct and through q_lora_rank, plain RoPE and yarn (DeepSeek-V3's mscale = mscale_all_dim, and
the two apart, which also scales cos/sin), interleaved and half-split rope layouts, with and without
biases; compared under the fp32 tolerances of conformance/core/tolerances.py. Planted faults in the
reference (the rope slice turned half-split where the config says interleaved; the softmax without
yarn's mscale) must be caught by the same comparison.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from conformance.core.compare import compare_tensors
from conformance.meta.test_reference_blocks import assert_same, causal_mask, random_module
from reference import eagle3 as ref
from reference.rope import rope_cos_sin, rotate, rotate_interleaved

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
F32 = torch.float32

ROPES = {
    "plain": None,
    # DeepSeek-V3's and Kimi-K2's yarn (fixtures/data/real-configs/target/), on a small original context.
    "yarn": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
             "beta_slow": 1, "original_max_position_embeddings": 64},
    # mscale != mscale_all_dim: the cos/sin tables carry their ratio as well as the softmax scale.
    "yarn_mscale_split": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 1.3,
                          "original_max_position_embeddings": 64},
}
T = 9
POSITIONS = torch.arange(T) * 3 + 2   # not 0..T-1: a position off by a constant would also show


def make_mla(q_lora: bool, rope: str, interleave: bool) -> ref.MLAConfig:
    """Odd, distinct widths: a nope/rope or k/v split taken at the wrong channel changes shapes or values."""
    scaling = ROPES[rope] or {}
    # A yarn context is factor x the original one, as in the real configs (else transformers warns).
    context = int(scaling["factor"] * scaling["original_max_position_embeddings"]) if scaling else 2048
    return ref.MLAConfig(num_attention_heads=3, q_lora_rank=22 if q_lora else None, kv_lora_rank=18,
                         qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=14, rms_norm_eps=1e-6,
                         rope_theta=10000.0, rope_scaling=ROPES[rope], max_position_embeddings=context,
                         rope_interleave=interleave)


def hf_config(cfg: ref.MLAConfig, hidden_size: int, attention_bias: bool) -> DeepseekV3Config:
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **dict(cfg.rope_scaling or {})}
    c = DeepseekV3Config(vocab_size=97, hidden_size=hidden_size, num_hidden_layers=1,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
                         q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                         qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                         v_head_dim=cfg.v_head_dim, rms_norm_eps=cfg.rms_norm_eps,
                         max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
                         rope_interleave=cfg.rope_interleave, attention_bias=attention_bias)
    c._attn_implementation = "eager"
    return c


def run_both(q_lora: bool, rope: str, interleave: bool, attention_bias: bool):
    """(reference stages, transformers' outputs by stage name) on the same weights, input and positions."""
    cfg, H = make_mla(q_lora, rope, interleave), 40
    attn = hf.DeepseekV3Attention(hf_config(cfg, H, attention_bias), layer_idx=0)
    w = {f"layers.0.self_attn.{k}": v for k, v in random_module(attn, 11).items()}
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(12), dtype=F32)

    seen = {}   # what transformers' norms emit: the latents
    for name, module in (("q_latent", attn.q_a_layernorm), ("kv_latent", attn.kv_a_layernorm)):
        if module is not None:
            module.register_forward_hook(lambda _m, _i, out, name=name: seen.__setitem__(name, out))
    rotary = hf.DeepseekV3RotaryEmbedding(attn.config)
    with torch.no_grad():
        out, _ = attn(x[None], position_embeddings=rotary(x[None], POSITIONS[None]), attention_mask=causal_mask(T))
    expected = {"attn_out": out[0], **{k: v.reshape(T, -1) for k, v in seen.items()}}

    cos, sin = rope_cos_sin(cfg, POSITIONS, F32)
    visible = ref.visibility(torch.zeros(T, dtype=torch.long), torch.arange(T), step=0, window=None)
    _, stages = ref.mla_attention(x, w, "layers.0", cfg, cos, sin, ([], []), visible)
    return stages, expected


@pytest.mark.parametrize("attention_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half_split"])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("q_lora", [False, True], ids=["q_direct", "q_lora"])
def test_mla_attention_matches_deepseek_v3_attention(q_lora, rope, interleave, attention_bias):
    stages, expected = run_both(q_lora, rope, interleave, attention_bias)
    assert expected.keys() == ({"attn_out", "kv_latent"} | ({"q_latent"} if q_lora else set()))
    for name, hf_out in expected.items():
        assert_same(name, stages[f"layers.0.{name}"], hf_out)


def test_softmax_scale_is_deepseek_v3s():
    for rope in ROPES:
        cfg = make_mla(True, rope, True)
        attn = hf.DeepseekV3Attention(hf_config(cfg, 40, False), layer_idx=0)
        assert cfg.softmax_scale == attn.scaling, rope
    assert make_mla(True, "yarn", True).softmax_scale != make_mla(True, "plain", True).softmax_scale


def test_interleaved_rope_is_transformers_deinterleaved():
    """The reference keeps DeepSeek's pair order; transformers writes [evens' | odds'] (the same numbers)."""
    cfg = make_mla(True, "yarn_mscale_split", True)
    g = torch.Generator().manual_seed(13)
    q = torch.randn(T, 3, cfg.qk_rope_head_dim, generator=g, dtype=F32)
    k = torch.randn(T, 1, cfg.qk_rope_head_dim, generator=g, dtype=F32)
    cos, sin = rope_cos_sin(cfg, POSITIONS, F32)
    q_hf, k_hf = hf.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                     cos[None], sin[None])
    deinterleave = torch.cat([torch.arange(0, cfg.qk_rope_head_dim, 2), torch.arange(1, cfg.qk_rope_head_dim, 2)])
    assert_same("q_rope", rotate_interleaved(q, cos, sin)[..., deinterleave], q_hf[0].transpose(0, 1))
    assert_same("k_rope", rotate_interleaved(k, cos, sin)[..., deinterleave], k_hf[0].transpose(0, 1))


def plain_softmax_scale(self) -> float:
    return self.qk_head_dim ** -0.5


PLANTS = {
    # The rope slice turned as Llama's half-split pairs where the config (and DeepSeek) says interleaved.
    "rope_half_split": ("rotate_interleaved", rotate, "yarn"),
    # yarn's mscale(factor, mscale_all_dim)^2 left out of the softmax scale.
    "no_yarn_mscale": ("MLAConfig.softmax_scale", property(plain_softmax_scale), "yarn"),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_planted_mla_fault_is_caught(plant, monkeypatch):
    target, replacement, rope = PLANTS[plant]
    owner, _, attr = target.rpartition(".")
    monkeypatch.setattr(getattr(ref, owner) if owner else ref, attr, replacement)
    stages, expected = run_both(True, rope, True, False)
    assert not compare_tensors(0, "kv_latent", stages["layers.0.kv_latent"], expected["kv_latent"], F32).failed
    r = compare_tensors(0, "attn_out", stages["layers.0.attn_out"], expected["attn_out"], F32)
    assert r.failed, f"planted {plant} not caught: attn_out within fp32 tolerance (max abs {r.max_abs:.3e})"


# ---------------------------------------------------------------- the draft config that carries MLA

MLA_DRAFT = dict(draft_arch="mla", num_key_value_heads=4, head_dim=6, q_lora_rank=22, kv_lora_rank=18,
                 qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=14)


@pytest.mark.parametrize("changes,message", [
    (dict(draft_arch="llama"), "MLA fields set on a 'llama' draft"),
    (dict(kv_lora_rank=None), "an MLA draft needs kv_lora_rank"),
    (dict(num_key_value_heads=2), "no GQA"),
    (dict(head_dim=12), "head_dim is its qk_rope_head_dim"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor must be 1"),
    (dict(attention_bias=True), "attention_bias is not implemented"),
    (dict(sliding_window=4), "sliding_window is not implemented"),
], ids=["mla_fields_on_llama", "no_kv_lora_rank", "gqa", "head_dim", "partial_rotary", "bias", "window"])
def test_an_mla_draft_config_rejects_what_its_layer_would_ignore(changes, message):
    """Every Eagle3Config field is honoured or rejected: an MLA layer has no GQA, no head_dim of its own, no
    partial rotary, and the reference's has no biases or window; MLA widths on a Llama draft are refused."""
    from fixtures.tiny import make_config

    make_config(**MLA_DRAFT)   # the tiny MLA draft itself is accepted
    with pytest.raises(ValueError, match=message):
        make_config(**{**MLA_DRAFT, **changes})


def test_the_draft_layer_runs_mla_attention_on_its_rope_tables(monkeypatch):
    """An MLA draft's layers call mla_attention with its MLAConfig and the rope tables of the rope slice
    (rotary_dim = qk_rope_head_dim); a Llama draft's never call it."""
    from fixtures.tiny import make_batch, make_config, make_draft_weights

    calls = []
    real = ref.mla_attention

    def spy(x, w, prefix, cfg, cos, sin, cache, visible):
        calls.append((prefix, cfg, cos.shape[-1]))
        return real(x, w, prefix, cfg, cos, sin, cache, visible)

    monkeypatch.setattr(ref, "mla_attention", spy)
    for draft in (make_config(**MLA_DRAFT), make_config()):
        weights = make_draft_weights(draft, torch.Generator().manual_seed(0))
        batch = make_batch(draft, (3, 2), torch.Generator().manual_seed(1), steps=2)
        ref.Eagle3Reference(draft, weights, F32).run(batch, steps=2)
    assert calls == [("layers.0", make_config(**MLA_DRAFT).mla, 6)] * 2, calls
