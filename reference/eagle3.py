"""The reference EAGLE-3 draft: one small forward pass with every knob, in training semantics.

This is the arbiter every implementation is compared against. It follows speculators 0.9.0's
`Eagle3DraftModel` (the training path, `eagle3-semantics.md` §1.1) and honours every knob of §2,
including the ones SGLang lacks (`norm_before_residual`, q/k/v bias, `input_layernorm` on layers
>= 1, the qwen3 draft layers' q_norm/k_norm), and partial rotary. One code path, plain
`softmax(QK^T/sqrt(d) + mask) V` attention, no side effects.

Precision policy (one place): every matmul runs in the working dtype; RMSNorm and softmax upcast
to fp32 (fp64 stays fp64) and cast back, as HF and SGLang do; RoPE angles and cos/sin are
computed in fp32 from the fp32 inverse frequencies HF and SGLang compute (fp64 throughout in fp64
runs) and cast to the working dtype (see rope_cos_sin).

Multi-step drafting is the training TTT unroll (speculators core.py:269-358): step k feeds back the
previous step's recurrent hidden at the same token index, positions advance by one per step, and a
query at index t attends the step-0 keys s <= t of its own sequence plus its own keys of steps 1..k.
The next token is either given (teacher forcing, as in training) or the draft's own argmax mapped
through d2t (free running, as in serving).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Eagle3Config:
    """Every knob of an EAGLE-3 draft, named as in the speculators config (training semantics)."""

    vocab_size: int                      # V: the target vocabulary (embedding rows)
    draft_vocab_size: int                # Vd: lm_head rows; d2t maps them into V
    hidden_size: int                     # H: the draft's width
    target_hidden_size: int              # Ht: width of each aux hidden state
    num_aux_hidden_states: int           # A: aux states concatenated in front of fc
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None  # {"rope_type": "linear"|"llama3"|"yarn", ...}; None = default
    max_position_embeddings: int = 2048
    norm_before_fc: bool = False         # one RMSNorm over the concatenated A*Ht aux input
    fc_norm: bool = False                # one RMSNorm per aux chunk (exclusive with norm_before_fc)
    norm_before_residual: bool = False   # residual of layer 0 is the normed hidden, not the raw one
    norm_output: bool = False            # feed the post-norm hidden back (else the pre-norm one)
    tie_word_embeddings: bool = False    # lm_head is embed_tokens (needs Vd == V)
    attention_bias: bool = False         # q/k/v/o biases
    mlp_bias: bool = False               # gate/up/down biases
    hidden_act: str = "silu"
    aux_layer_ids: tuple[int, ...] | None = None  # training convention: input of layer i (0 = embedding)
    sliding_window: int | None = None    # None = full attention in every draft layer
    draft_arch: str = "llama"            # decoder layers: "llama", or "qwen3" (per-head q_norm/k_norm before RoPE)
    partial_rotary_factor: float = 1.0   # RoPE on the first int(head_dim * factor) channels of each head only

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are mutually exclusive")
        if self.tie_word_embeddings and self.draft_vocab_size != self.vocab_size:
            raise ValueError("tie_word_embeddings needs draft_vocab_size == vocab_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not implemented by the reference")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not implemented by the reference")
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux_hidden_states:
            raise ValueError("aux_layer_ids must have num_aux_hidden_states entries")
        if self.draft_arch not in DRAFT_ARCHS:
            raise ValueError(f"draft_arch {self.draft_arch!r} is not implemented ({', '.join(DRAFT_ARCHS)} are)")
        if self.draft_arch == "qwen3" and self.mlp_bias:
            raise ValueError("a qwen3 draft has no MLP biases (transformers Qwen3MLP: bias=False)")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim} "
                             f"of head_dim {self.head_dim}: needs an even number >= 2")

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE turns (HF modeling_rope_utils, SGLang llama.py:199-200)."""
        return int(self.head_dim * self.partial_rotary_factor)


DRAFT_ARCHS = ("llama", "qwen3")   # speculators' draft_arch choices (models/eagle3/model_definitions.py:135-142)


# ---------------------------------------------------------------- building blocks

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in (at least) fp32, cast back, then scale."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(cfg: Eagle3Config, exact: bool = True) -> tuple[torch.Tensor, float]:
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


def rope_cos_sin(cfg: Eagle3Config, positions: torch.Tensor, dtype: torch.dtype):
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


def mlp(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate = linear(x, w, f"{prefix}.gate_proj")
    up = linear(x, w, f"{prefix}.up_proj")
    return linear(F.silu(gate) * up, w, f"{prefix}.down_proj")


def attention(q, k_steps, v_steps, visible, cfg: Eagle3Config) -> torch.Tensor:
    """q: [T, nh, hd]; k/v_steps: per step [T, nkv, hd]; visible: [T, S*T] bool -> [T, nh*hd]."""
    k = torch.cat(k_steps, dim=0)                                    # [S*T, nkv, hd]
    v = torch.cat(v_steps, dim=0)
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    k = k.repeat_interleave(groups, dim=1)                           # [S*T, nh, hd] (GQA)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)   # [nh, T, S*T]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = scores.to(compute).softmax(dim=-1).to(q.dtype)
    out = torch.einsum("hqk,khd->qhd", probs, v)                     # [T, nh, hd]
    return out.reshape(out.shape[0], -1)


def visibility(seq_ids: torch.Tensor, index_in_seq: torch.Tensor, step: int, window: int | None):
    """[T, (step+1)*T] bool: step-0 keys causal within the sequence, plus the diagonal of later steps.

    This is speculators' TTT mask (attention.py:11-34 and extend_*_mask_for_draft_tokens): at step k a
    query sees the step-0 keys up to itself (the last `window` of them in sliding layers) and its own
    keys from steps 1..k.
    """
    T = seq_ids.shape[0]
    same = seq_ids[:, None] == seq_ids[None, :]
    causal = index_in_seq[None, :] <= index_in_seq[:, None]
    step0 = same & causal
    if window is not None:
        step0 &= index_in_seq[None, :] > index_in_seq[:, None] - window
    diagonal = torch.eye(T, dtype=torch.bool)
    return torch.cat([step0] + [diagonal] * step, dim=1)


# ---------------------------------------------------------------- the draft

@dataclass
class DraftBatch:
    """A packed batch: all sequences back to back, T tokens in total."""

    aux: torch.Tensor            # [T, A*Ht] target aux hidden states, in capture order
    input_ids: torch.Tensor      # [T] target-vocab ids fed at step 0 (x_{t+1} next to g_t)
    positions: torch.Tensor      # [T] step-0 positions
    seq_ids: torch.Tensor        # [T] which sequence each token belongs to
    next_ids: torch.Tensor | None = None  # [T, steps-1] teacher-forced ids for steps >= 1; None = free running
    cached_prefix: tuple[int, ...] | None = None  # per sequence, tokens a server already holds in its KV
    # cache (chunked prefill); the math is the same, so the reference and training ignore it

    @property
    def index_in_seq(self) -> torch.Tensor:
        starts = torch.zeros_like(self.seq_ids)
        for s in self.seq_ids.unique():
            where = (self.seq_ids == s).nonzero().flatten()
            starts[where] = torch.arange(where.numel())
        return starts


@dataclass
class Eagle3Reference:
    """The reference draft, holding its weights (speculators/SGLang tensor names) in one dtype."""

    cfg: Eagle3Config
    weights: dict[str, torch.Tensor]
    dtype: torch.dtype = torch.float32
    w: dict[str, torch.Tensor] = field(init=False, repr=False)

    def __post_init__(self):
        # Integer buffers keep their dtype; everything else runs in the working dtype.
        self.w = {k: (v if not v.is_floating_point() else v.to(self.dtype)) for k, v in self.weights.items()}

    def lm_head_weight(self) -> torch.Tensor:
        return self.w["embed_tokens.weight"] if self.cfg.tie_word_embeddings else self.w["lm_head.weight"]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """d2t holds offsets: target_id = draft_id + d2t[draft_id] (absent when Vd == V)."""
        d2t = self.w.get("d2t")
        return draft_ids if d2t is None else draft_ids + d2t[draft_ids]

    def layer(self, i: int, h: torch.Tensor, embeds: torch.Tensor, cos, sin, cache, visible, stages: dict):
        """One decoder layer; appends this step's k/v to cache[i]; records its stages."""
        cfg, w, p = self.cfg, self.w, f"layers.{i}"
        if i == 0:
            e = rms_norm(embeds, w[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps)  # [T, H]
            hn = rms_norm(h, w[f"{p}.hidden_norm.weight"], cfg.rms_norm_eps)          # [T, H]
            residual = hn if cfg.norm_before_residual else h
            attn_in = torch.cat([e, hn], dim=-1)                                       # [T, 2H]: [embeds, hidden]
            stages[f"{p}.embeds_norm"] = e
        else:
            hn = rms_norm(h, w[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps)
            residual = h
            attn_in = hn
        stages.update({f"{p}.hidden_norm": hn, f"{p}.residual": residual, f"{p}.attn_in": attn_in})

        T, hd = h.shape[0], cfg.head_dim
        q = linear(attn_in, w, f"{p}.self_attn.q_proj").view(T, cfg.num_attention_heads, hd)
        k = linear(attn_in, w, f"{p}.self_attn.k_proj").view(T, cfg.num_key_value_heads, hd)
        v = linear(attn_in, w, f"{p}.self_attn.v_proj").view(T, cfg.num_key_value_heads, hd)
        stages.update({f"{p}.q": q, f"{p}.k": k, f"{p}.v": v})
        if cfg.draft_arch == "qwen3":   # Qwen3Attention: RMSNorm over each head's channels, before RoPE
            q = rms_norm(q, w[f"{p}.self_attn.q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, w[f"{p}.self_attn.k_norm.weight"], cfg.rms_norm_eps)
            stages.update({f"{p}.q_norm": q, f"{p}.k_norm": k})
        q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
        cache[i][0].append(k_rot)
        cache[i][1].append(v)
        core = attention(q_rot, cache[i][0], cache[i][1], visible, cfg)               # [T, nh*hd]
        attn_out = linear(core, w, f"{p}.self_attn.o_proj")                          # [T, H]
        post_attn = residual + attn_out
        x = rms_norm(post_attn, w[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        mlp_out = mlp(x, w, f"{p}.mlp")
        out = post_attn + mlp_out
        stages.update({
            f"{p}.q_rot": q_rot, f"{p}.k_rot": k_rot,
            f"{p}.attn_core": core, f"{p}.attn_out": attn_out, f"{p}.post_attn": post_attn,
            f"{p}.post_attn_norm": x, f"{p}.mlp_out": mlp_out, f"{p}.layer_out": out,
        })
        return out

    @torch.no_grad()
    def run(self, batch: DraftBatch, steps: int = 1) -> list[dict[str, torch.Tensor]]:
        """Draft `steps` TTT steps; returns one {stage name: tensor} per step (names in conformance.core.stages)."""
        cfg, w, dt = self.cfg, self.w, self.dtype
        aux = batch.aux.to(dt)                                                        # [T, A*Ht]
        index_in_seq = batch.index_in_seq
        trace: list[dict[str, torch.Tensor]] = []
        cache = [([], []) for _ in range(cfg.num_hidden_layers)]                      # per layer: k, v per step
        ids = batch.input_ids
        h = None
        for step in range(steps):
            stages: dict[str, torch.Tensor] = {}
            if step == 0:
                stages["aux_in"] = aux
                x = aux
                if cfg.norm_before_fc:
                    x = rms_norm(x, w["input_norm.weight"], cfg.rms_norm_eps)
                if cfg.fc_norm:
                    chunks = x.chunk(cfg.num_aux_hidden_states, dim=-1)             # A x [T, Ht]
                    x = torch.cat([rms_norm(c, w[f"fc_norm.{j}.weight"], cfg.rms_norm_eps)
                                   for j, c in enumerate(chunks)], dim=-1)
                if cfg.norm_before_fc or cfg.fc_norm:
                    stages["fc_in_norm"] = x
                h = linear(x, w, "fc")                                                 # [T, H]
                stages["fc_out"] = h
            else:
                stages["hidden_in"] = h                                                # fed back from step - 1
            stages["input_ids"] = ids
            embeds = F.embedding(ids, w["embed_tokens.weight"])                        # [T, H]
            stages["embeds"] = embeds
            positions = batch.positions + step
            cos, sin = rope_cos_sin(cfg, positions, dt)
            visible = visibility(batch.seq_ids, index_in_seq, step, cfg.sliding_window)
            for i in range(cfg.num_hidden_layers):
                h = self.layer(i, h, embeds, cos, sin, cache, visible, stages)
            normed = rms_norm(h, w["norm.weight"], cfg.rms_norm_eps)                   # [T, H]
            logits = F.linear(normed, self.lm_head_weight())                           # [T, Vd]
            draft_ids = logits.argmax(dim=-1)
            target_ids = self.to_target_ids(draft_ids)
            h = normed if cfg.norm_output else h                                       # fed to step + 1
            stages.update({"final_norm": normed, "recurrent_hidden": h, "logits": logits,
                           "draft_ids": draft_ids, "target_ids": target_ids})
            trace.append(stages)
            if step + 1 < steps:
                ids = batch.next_ids[:, step] if batch.next_ids is not None else target_ids
        return trace
