"""The reference's building blocks against transformers' Llama modules (the HF semantics it claims).

RMSNorm, MLP, rotary (default, linear, llama3, yarn) and attention (GQA, explicit head_dim, biases,
causal mask) are each run through `transformers.models.llama.modeling_llama` on the same weights and
inputs, in fp32 (HF's RMSNorm computes in fp32 whatever the input dtype), under the fp32 tolerances
of conformance/core/tolerances.py.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as hf

from conformance.core.compare import compare_tensors
from fixtures.tiny import ROPE_SCALINGS, make_config, with_changes
from reference import eagle3 as ref
from reference.rope import rope_cos_sin, rotate

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
F32 = torch.float32


def hf_config(cfg: ref.Eagle3Config) -> LlamaConfig:
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **dict(cfg.rope_scaling or {})}
    c = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                    num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads,
                    num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                    max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
                    attention_bias=cfg.attention_bias, mlp_bias=cfg.mlp_bias)
    c._attn_implementation = "eager"
    return c


def assert_same(name: str, actual: torch.Tensor, expected: torch.Tensor):
    __tracebackhide__ = True
    r = compare_tensors(0, name, actual, expected, F32)
    assert not r.failed, (f"reference {name} differs from transformers: max abs {r.max_abs:.3e} at {r.abs_index} "
                          f"{r.detail}")


def causal_mask(T: int) -> torch.Tensor:
    """HF's additive causal mask, [1, 1, T, T]."""
    return torch.full((T, T), float("-inf"), dtype=F32).triu(1)[None, None]


def random_module(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for an HF module (norm weights around 1, so a missing norm shows); returns its state dict."""
    g = torch.Generator().manual_seed(seed)
    module.float()
    is_norm = isinstance(module, hf.LlamaRMSNorm)
    with torch.no_grad():
        for name, p in module.named_parameters():
            centre = 1.0 if is_norm or "norm" in name else 0.0
            p.copy_(centre + 0.3 * torch.randn(p.shape, generator=g, dtype=F32))
    return {k: v.detach() for k, v in module.state_dict().items()}


def test_rms_norm_matches_llama_rms_norm():
    norm = hf.LlamaRMSNorm(40, eps=1e-6)
    w = random_module(norm, 1)
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(2), dtype=F32)
    assert_same("rms_norm", ref.rms_norm(x, w["weight"], 1e-6), norm(x))


@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no_bias", "bias"])
def test_mlp_matches_llama_mlp(mlp_bias):
    cfg = make_config(mlp_bias=mlp_bias)
    mlp = hf.LlamaMLP(hf_config(cfg))
    w = {f"mlp.{k}": v for k, v in random_module(mlp, 3).items()}
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(4), dtype=F32)
    assert_same("mlp", ref.mlp(x, w, "mlp"), mlp(x))


@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
def test_rotary_matches_llama_rotary_embedding(rope):
    cfg = make_config(rope_scaling=ROPE_SCALINGS[rope])
    rotary = hf.LlamaRotaryEmbedding(hf_config(cfg))
    positions = torch.tensor([0, 1, 2, 5, 17, 40, 63])   # small: HF's fp32 angles stay within fp32 tolerance
    x = torch.zeros(1, positions.numel(), cfg.hidden_size, dtype=F32)
    cos_hf, sin_hf = rotary(x, positions[None])
    cos, sin = rope_cos_sin(cfg, positions, F32)
    assert_same(f"rope_{rope}.cos", cos, cos_hf[0])
    assert_same(f"rope_{rope}.sin", sin, sin_hf[0])
    q = torch.randn(positions.numel(), cfg.num_attention_heads, cfg.head_dim,
                    generator=torch.Generator().manual_seed(5), dtype=F32)
    expected, _ = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None], sin[None])
    assert_same("q_rot", rotate(q, cos, sin), expected[0].transpose(0, 1))


@pytest.mark.parametrize("attention_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["mqa", "gqa", "mha"])
def test_attention_matches_llama_attention(attention_bias, kv_heads):
    cfg = make_config(attention_bias=attention_bias, num_key_value_heads=kv_heads)
    attn = hf.LlamaAttention(hf_config(cfg), layer_idx=0)
    w = {f"self_attn.{k}": v for k, v in random_module(attn, 6).items()}
    T = 9
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(7), dtype=F32)
    positions = torch.arange(T)
    cos, sin = rope_cos_sin(cfg, positions, F32)
    expected, _ = attn(x[None], position_embeddings=(cos[None], sin[None]), attention_mask=causal_mask(T))

    q = ref.linear(x, w, "self_attn.q_proj").view(T, cfg.num_attention_heads, cfg.head_dim)
    k = ref.linear(x, w, "self_attn.k_proj").view(T, kv_heads, cfg.head_dim)
    v = ref.linear(x, w, "self_attn.v_proj").view(T, kv_heads, cfg.head_dim)
    visible = ref.visibility(torch.zeros(T, dtype=torch.long), positions, step=0, window=None)
    core = ref.attention(rotate(q, cos, sin), [rotate(k, cos, sin)], [v], visible, cfg)
    assert_same("attn_out", ref.linear(core, w, "self_attn.o_proj"), expected[0])


def test_decoder_layer_matches_llama_decoder_layer():
    """A reference layer >= 1 is a stock HF decoder layer (speculators core.py:91-93)."""
    cfg = with_changes(make_config(), num_hidden_layers=2, hidden_size=40, target_hidden_size=40)
    layer = hf.LlamaDecoderLayer(hf_config(cfg), layer_idx=1)
    w = {f"layers.1.{k}": v for k, v in random_module(layer, 8).items()}
    T = 6
    h = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(9), dtype=F32)
    positions = torch.arange(T)
    cos, sin = rope_cos_sin(cfg, positions, F32)
    expected = layer(h[None], attention_mask=causal_mask(T), position_embeddings=(cos[None], sin[None]))
    expected = expected[0] if isinstance(expected, tuple) else expected

    model = ref.Eagle3Reference(cfg, w, F32)
    visible = ref.visibility(torch.zeros(T, dtype=torch.long), positions, step=0, window=None)
    cache = [([], []), ([], [])]
    out, _ = model.layer(1, h, None, cos, sin, cache, visible)
    assert_same("layer_out", out, expected[0])
