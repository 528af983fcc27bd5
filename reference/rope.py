"""The reference draft's rotary position embedding: tables and rotation, in training semantics.

Every rope scaling the reference implements (ROPE_TYPES, per HF modeling_rope_utils) and partial
rotary (the first `cfg.rotary_dim` channels of each head turn, the rest pass through). Two channel
layouts: the half-split pairs (i, i + rd/2) of Llama and neox (`rotate`), and DeepSeek's interleaved
pairs (2i, 2i + 1) of MLA drafts (`rotate_interleaved`), over the same cos/sin tables. `cfg` is the
draft's Eagle3Config (reference/eagle3.py); only its rotary_dim, rope_theta, rope_scaling and
max_position_embeddings are read.

Precision: the angles and cos/sin are computed in fp32 from the fp32 inverse frequencies HF and
SGLang compute (fp64 throughout in fp64 runs) and cast to the working dtype (rope_cos_sin).
"""
from __future__ import annotations

import math
from typing import Protocol

import torch


class RopeConfig(Protocol):
    """What RoPE reads of the draft's Eagle3Config (eagle3.py imports this module, so it is not imported here)."""

    rotary_dim: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(cfg: RopeConfig, exact: bool = True) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [hd/2] (fp64) and the cos/sin scale, per HF modeling_rope_utils.

    exact=False starts from the fp32 base frequencies that transformers and SGLang compute, with
    their fp32 formula (transformers modeling_llama.py:105, sglang rotary_embedding/base.py:240-248):
    1 ulp off the exact value is 2.4e-5 rad at position 2000, so below fp64 that rounding is part
    of the model.
    """
    d, base = cfg.rotary_dim, cfg.rope_theta   # partial rotary: frequencies over the rotated channels only
    p = dict(cfg.rope_scaling or {})
    kind = p.get("rope_type", "default")
    if exact:
        inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    else:
        inv_freq = (1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))).double()
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / p["factor"], 1.0
    if kind == "llama3":
        factor, old_ctx = p["factor"], p["original_max_position_embeddings"]
        low_wavelen = old_ctx / p["low_freq_factor"]
        high_wavelen = old_ctx / p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: NTK-by-parts interpolation plus an attention scale on cos/sin.
    factor = p["factor"]
    old_ctx = p.get("original_max_position_embeddings", cfg.max_position_embeddings)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("attention_factor") is not None:
        attn_factor = p["attention_factor"]
    elif p.get("mscale") and p.get("mscale_all_dim"):
        attn_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
    else:
        attn_factor = mscale(factor)

    def correction_dim(rotations):
        return d * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp                     # 1 = keep the original frequency
    inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, attn_factor


def rope_cos_sin(cfg: RopeConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin: [T, rotary_dim] for the half-split (neox) rotation.

    Below fp64 as transformers and SGLang compute them, whatever the working dtype: fp32 inverse
    frequencies, one fp32 product per angle (transformers modeling_llama.py:110-116; SGLang's
    cos/sin cache, rotary_embedding/base.py:253-264), fp32 cos/sin. An angle is position x
    frequency, so its rounding grows with the position: deep in a context it is a radian-sized
    difference if the frequencies were held in bf16, and 1e-4 rad in fp32 against fp64.
    """
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq, scale = rope_inv_freq(cfg, exact=compute == torch.float64)
    angles = positions.to(compute)[:, None] * inv_freq.to(compute)[None, :]   # [T, rotary_dim/2]
    emb = torch.cat([angles, angles], dim=-1)                                  # [T, rotary_dim]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; HF apply_rotary_pos_emb (rotate_half convention).

    Partial rotary (cos narrower than the head) turns the leading channels and passes the rest through,
    as SGLang's neox RoPE does (rotary_embedding/base.py) and speculators' patch for HF
    (models/eagle3/rotary_partial.py:27-66)."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([rotate(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, rd]; DeepSeek's interleaved RoPE: channels (2i, 2i+1) form pair i, turned by frequency i.

    The output keeps the interleaved order, as DeepSeek's view_as_complex rotation and SGLang's non-neox
    RoPE write it. transformers 5.19.0 (models/deepseek_v3/modeling_deepseek_v3.py:341-346,
    apply_rotary_pos_emb_interleave) writes the same values de-interleaved, [evens' | odds']: one
    permutation of q's and k's channels alike, so q.k and the attention do not change. cos/sin are
    rope_cos_sin's [T, rd] tables (the angles repeated), of which the first half holds one angle per pair.
    """
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]                            # [T, 1, rd/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]                                        # [T, heads, rd/2] each
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
