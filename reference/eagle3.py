"""The reference EAGLE-3 draft: one small forward pass with every knob, in training semantics.

This is the arbiter every implementation is compared against. It follows speculators 0.9.0's
`Eagle3DraftModel` (the training path, `eagle3-semantics.md` §1.1) and honours every knob of §2,
including the ones SGLang lacks (`norm_before_residual`, q/k/v bias, `input_layernorm` on layers
>= 1, the qwen3 draft layers' q_norm/k_norm), and partial rotary. One code path, plain
`softmax(QK^T/sqrt(d) + mask) V` attention, no side effects. MLA drafts' attention (DeepSeek's latent
attention, `mla_attention` with its `MLAConfig`) is a separate block next to the Llama one: a draft with
draft_arch "mla" runs it in every layer in place of the Llama attention, everything around it unchanged (the
[embeds, hidden] input of layer 0, residuals, MLP, norms, the TTT recurrence; NeMo Automodel's
DeepseekV3Eagle3DraftModel and SGLang's Eagle3DeepseekV2ForCausalLM are built so).

Precision policy (one place): every matmul runs in the working dtype; RMSNorm and softmax upcast
to fp32 (fp64 stays fp64) and cast back, as HF and SGLang do; RoPE angles and cos/sin are
computed in fp32 from the fp32 inverse frequencies HF and SGLang compute (fp64 throughout in fp64
runs) and cast to the working dtype (reference/rope.py).

Every block returns the stages it computes (names in conformance.core.stages) next to its output;
`run` collects them into one {stage name: tensor} per step.

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

from reference.rope import ROPE_TYPES, rope_cos_sin, rotate, rotate_interleaved


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
    draft_arch: str = "llama"            # decoder layers: "llama", "qwen3" (per-head q_norm/k_norm before RoPE), or
                                         # "mla" (DeepSeek's latent attention, the fields below; `mla`)
    partial_rotary_factor: float = 1.0   # RoPE on the first int(head_dim * factor) channels of each head only
    # MLA drafts only (draft_arch "mla"), named as in DeepseekV3Config; None / unset for the other archs.
    q_lora_rank: int | None = None       # None: q_proj straight from the input; else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None  # RoPE's channels; DeepseekV3Config states head_dim = qk_rope_head_dim
    v_head_dim: int | None = None
    rope_interleave: bool = True         # DeepSeek's (2i, 2i+1) rope pairs; False: half-split

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
        mla_fields = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if self.draft_arch == "mla":
            self._check_mla(mla_fields)
        elif any(f is not None for f in mla_fields + (self.q_lora_rank,)) or not self.rope_interleave:
            raise ValueError(f"MLA fields set on a {self.draft_arch!r} draft (they need draft_arch 'mla')")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {self.rotary_dim} "
                             f"of head_dim {self.head_dim}: needs an even number >= 2")

    def _check_mla(self, mla_fields) -> None:
        """An MLA draft states its MLA widths, and nothing of a Llama layer that its attention would ignore."""
        if any(f is None for f in mla_fields):
            raise ValueError("an MLA draft needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("an MLA draft has no GQA: num_key_value_heads must equal num_attention_heads")
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError("an MLA draft's head_dim is its qk_rope_head_dim (transformers DeepseekV3Config)")
        if self.partial_rotary_factor != 1:
            raise ValueError("an MLA draft turns its whole rope slice: partial_rotary_factor must be 1")
        for knob in ("attention_bias", "sliding_window"):
            if getattr(self, knob):
                raise ValueError(f"{knob} is not implemented by the reference's MLA draft layer")

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE turns (HF modeling_rope_utils, SGLang llama.py:199-200)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mla(self) -> MLAConfig:
        """The MLA attention of every layer of an MLA draft (its own RoPE config: rotary_dim = qk_rope_head_dim)."""
        return MLAConfig(num_attention_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank,
                         kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                         qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
                         rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                         max_position_embeddings=self.max_position_embeddings, rope_interleave=self.rope_interleave)


# speculators' draft_arch choices (models/eagle3/model_definitions.py:135-142), and DeepSeek's MLA layer (mla-drafts.md)
DRAFT_ARCHS = ("llama", "qwen3", "mla")


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention (MLA) of an MLA draft layer, named as in DeepseekV3Config.

    It is the RopeConfig of its own RoPE (reference/rope.py): the tables span the rope slice of a head."""

    num_attention_heads: int
    q_lora_rank: int | None              # None: q_proj straight from the input; else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int                    # the compressed KV latent every head's k_nope and v come from
    qk_nope_head_dim: int                # channels of each q/k head that RoPE leaves alone
    qk_rope_head_dim: int                # channels RoPE turns; one rope key shared by all heads
    v_head_dim: int
    rms_norm_eps: float = 1e-6           # q_a_layernorm, kv_a_layernorm
    rope_theta: float = 10000.0
    rope_scaling: Mapping | None = None  # as Eagle3Config's; yarn's mscale_all_dim also scales the softmax
    max_position_embeddings: int = 2048
    rope_interleave: bool = True         # DeepSeek's pairs (2i, 2i+1); False: half-split as Llama (transformers
                                         # modeling_deepseek_v3.py:453-456; SGLang deepseek_v2.py:2166)

    def __post_init__(self):
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not implemented by the reference")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim < 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim}: needs an even number >= 2")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times yarn's mscale(factor, mscale_all_dim) squared when the scaling has one.

        transformers 5.19.0 models/deepseek_v3/modeling_deepseek_v3.py:262-275 (yarn_get_mscale,
        yarn_apply_mscale: any rope_type but default), applied at :406; SGLang 0.5.23 the same
        (configs/model_config.py:2623-2648, at models/deepseek_v2.py:2177-2178). The cos/sin tables
        carry the other factor, mscale(factor, mscale) / mscale(factor, mscale_all_dim) (rope.py
        rope_inv_freq), so q.k of the rope slice sees both."""
        scale = self.qk_head_dim ** -0.5
        p = dict(self.rope_scaling or {})
        if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
            factor = p["factor"]
            m = 1.0 if factor <= 1 else 0.1 * p["mscale_all_dim"] * math.log(factor) + 1.0
            scale = scale * m * m
        return scale


# ---------------------------------------------------------------- building blocks

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in (at least) fp32, cast back, then scale."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


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


def mla_attention(x: torch.Tensor, w: dict, prefix: str, cfg: MLAConfig, cos, sin, cache, visible
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DeepSeek's MLA over x [T, D] (D = 2H on layer 0) -> (o_proj output [T, H], its stages).

    As transformers 5.19.0's DeepseekV3Attention (models/deepseek_v3/modeling_deepseek_v3.py:350-484),
    with its weight names under `{prefix}.self_attn.` and the stages `{prefix}.<name>` of
    conformance.core.stages. cos/sin: rope_cos_sin(cfg, ...) [T, qk_rope_head_dim]; cache: this layer's
    (keys, values) per step, to which this step's are appended; visible: as for `attention`. The keys
    are kept expanded per head (what an absorbed MLA kernel never materialises, but the same q.k).
    """
    a, nh, T = f"{prefix}.self_attn", cfg.num_attention_heads, x.shape[0]
    nope, rd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    stages: dict[str, torch.Tensor] = {}
    if cfg.q_lora_rank is None:
        q = linear(x, w, f"{a}.q_proj")                                                   # [T, nh*(nope+rd)]
    else:
        q_latent = rms_norm(linear(x, w, f"{a}.q_a_proj"), w[f"{a}.q_a_layernorm.weight"], cfg.rms_norm_eps)
        stages[f"{prefix}.q_latent"] = q_latent                                           # [T, q_lora_rank]
        q = linear(q_latent, w, f"{a}.q_b_proj")
    q = q.view(T, nh, cfg.qk_head_dim)                                                    # [T, nh, nope+rd]
    # One down projection gives the KV latent and the rope key, both shared by every head.
    latent, k_pe = linear(x, w, f"{a}.kv_a_proj_with_mqa").split([cfg.kv_lora_rank, rd], dim=-1)
    kv_latent = rms_norm(latent, w[f"{a}.kv_a_layernorm.weight"], cfg.rms_norm_eps)     # [T, kv_lora_rank]
    kv = linear(kv_latent, w, f"{a}.kv_b_proj").view(T, nh, nope + cfg.v_head_dim)
    k_nope, v = kv.split([nope, cfg.v_head_dim], dim=-1)                                  # [T, nh, nope], [T, nh, vd]
    # RoPE turns only the rope slice of each q head and the one shared rope key.
    turn = rotate_interleaved if cfg.rope_interleave else rotate
    k_rope = turn(k_pe[:, None, :], cos, sin)                                             # [T, 1, rd]
    q_rot = torch.cat([q[..., :nope], turn(q[..., nope:], cos, sin)], dim=-1)             # [T, nh, nope+rd]
    k_rot = torch.cat([k_nope, k_rope.expand(T, nh, rd)], dim=-1)                         # [T, nh, nope+rd]
    cache[0].append(k_rot)
    cache[1].append(v)
    k_all, v_all = torch.cat(cache[0], dim=0), torch.cat(cache[1], dim=0)                 # [S*T, nh, ...]
    scores = torch.einsum("qhd,khd->hqk", q_rot, k_all) * cfg.softmax_scale              # [nh, T, S*T]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = scores.to(compute).softmax(dim=-1).to(q.dtype)
    core = torch.einsum("hqk,khd->qhd", probs, v_all).reshape(T, nh * cfg.v_head_dim)    # [T, nh*vd]
    attn_out = linear(core, w, f"{a}.o_proj")                                             # [T, H]
    stages.update({f"{prefix}.{name}": t for name, t in (
        ("q", q), ("kv_latent", kv_latent), ("k_rope", k_rope[:, 0]), ("v", v), ("q_rot", q_rot), ("k_rot", k_rot),
        ("attn_core", core), ("attn_out", attn_out))})
    return attn_out, stages


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

    def fc_in(self, aux: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Step 0's input: the aux hidden states (optionally normed) through fc -> (h [T, H], stages)."""
        cfg, w = self.cfg, self.w
        stages = {"aux_in": aux}
        x = aux
        if cfg.norm_before_fc:
            x = rms_norm(x, w["input_norm.weight"], cfg.rms_norm_eps)
        if cfg.fc_norm:
            chunks = x.chunk(cfg.num_aux_hidden_states, dim=-1)                         # A x [T, Ht]
            x = torch.cat([rms_norm(c, w[f"fc_norm.{j}.weight"], cfg.rms_norm_eps)
                           for j, c in enumerate(chunks)], dim=-1)
        if cfg.norm_before_fc or cfg.fc_norm:
            stages["fc_in_norm"] = x
        h = linear(x, w, "fc")                                                             # [T, H]
        stages["fc_out"] = h
        return h, stages

    def layer(self, i: int, h: torch.Tensor, embeds: torch.Tensor, cos, sin, cache, visible
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One decoder layer -> (its output, its stages); appends this step's k/v to cache[i] (MLA: the keys
        [k_nope | shared rope key] and values per head, as training keeps them)."""
        cfg, w, p = self.cfg, self.w, f"layers.{i}"
        stages: dict[str, torch.Tensor] = {}
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

        if cfg.draft_arch == "mla":   # DeepSeek's latent attention over the same input (mla_attention)
            attn_out, attn_stages = mla_attention(attn_in, w, p, cfg.mla, cos, sin, cache[i], visible)
        else:
            attn_out, attn_stages = self.attention(i, attn_in, cos, sin, cache, visible)
        stages.update(attn_stages)
        post_attn = residual + attn_out
        x = rms_norm(post_attn, w[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        mlp_out = mlp(x, w, f"{p}.mlp")
        out = post_attn + mlp_out
        stages.update({f"{p}.post_attn": post_attn, f"{p}.post_attn_norm": x, f"{p}.mlp_out": mlp_out,
                       f"{p}.layer_out": out})
        return out, stages

    def attention(self, i: int, attn_in: torch.Tensor, cos, sin, cache, visible
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Layer i's Llama (or qwen3) attention over attn_in -> (o_proj output [T, H], its stages);
        appends this step's k/v to cache[i]."""
        cfg, w, p = self.cfg, self.w, f"layers.{i}"
        T, hd = attn_in.shape[0], cfg.head_dim
        q = linear(attn_in, w, f"{p}.self_attn.q_proj").view(T, cfg.num_attention_heads, hd)
        k = linear(attn_in, w, f"{p}.self_attn.k_proj").view(T, cfg.num_key_value_heads, hd)
        v = linear(attn_in, w, f"{p}.self_attn.v_proj").view(T, cfg.num_key_value_heads, hd)
        stages = {f"{p}.q": q, f"{p}.k": k, f"{p}.v": v}
        if cfg.draft_arch == "qwen3":   # Qwen3Attention: RMSNorm over each head's channels, before RoPE
            q = rms_norm(q, w[f"{p}.self_attn.q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, w[f"{p}.self_attn.k_norm.weight"], cfg.rms_norm_eps)
            stages.update({f"{p}.q_norm": q, f"{p}.k_norm": k})
        q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
        cache[i][0].append(k_rot)
        cache[i][1].append(v)
        core = attention(q_rot, cache[i][0], cache[i][1], visible, cfg)               # [T, nh*hd]
        attn_out = linear(core, w, f"{p}.self_attn.o_proj")                          # [T, H]
        stages.update({f"{p}.q_rot": q_rot, f"{p}.k_rot": k_rot, f"{p}.attn_core": core, f"{p}.attn_out": attn_out})
        return attn_out, stages

    def draft_pass(self, h: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, cache, visible
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One pass of the draft over T rows: embed `ids` at `positions`, every layer over the hidden h,
        final norm and lm_head -> (the hidden fed to the next step, the pass's stages)."""
        cfg, w = self.cfg, self.w
        embeds = F.embedding(ids, w["embed_tokens.weight"])                                # [T, H]
        stages = {"input_ids": ids, "embeds": embeds}
        # An MLA draft's tables span the rope slice of its heads (its MLAConfig is its RoPE config).
        cos, sin = rope_cos_sin(cfg.mla if cfg.draft_arch == "mla" else cfg, positions, self.dtype)
        for i in range(cfg.num_hidden_layers):
            h, layer_stages = self.layer(i, h, embeds, cos, sin, cache, visible)
            stages.update(layer_stages)
        normed = rms_norm(h, w["norm.weight"], cfg.rms_norm_eps)                           # [T, H]
        logits = F.linear(normed, self.lm_head_weight())                                   # [T, Vd]
        fed_back = normed if cfg.norm_output else h
        stages.update({"final_norm": normed, "recurrent_hidden": fed_back, "logits": logits})
        return fed_back, stages

    @torch.no_grad()
    def run(self, batch: DraftBatch, steps: int = 1) -> list[dict[str, torch.Tensor]]:
        """Draft `steps` TTT steps; returns one {stage name: tensor} per step (names in conformance.core.stages)."""
        cfg = self.cfg
        index_in_seq = batch.index_in_seq
        trace: list[dict[str, torch.Tensor]] = []
        cache = [([], []) for _ in range(cfg.num_hidden_layers)]                      # per layer: k, v per step
        ids = batch.input_ids
        for step in range(steps):
            if step == 0:
                h, stages = self.fc_in(batch.aux.to(self.dtype))                       # aux: [T, A*Ht]
            else:
                stages = {"hidden_in": h}                                              # fed back from step - 1
            visible = visibility(batch.seq_ids, index_in_seq, step, cfg.sliding_window)
            h, pass_stages = self.draft_pass(h, ids, batch.positions + step, cache, visible)
            stages.update(pass_stages)
            draft_ids = stages["logits"].argmax(dim=-1)
            target_ids = self.to_target_ids(draft_ids)
            stages.update({"draft_ids": draft_ids, "target_ids": target_ids})
            trace.append(stages)
            if step + 1 < steps:
                ids = batch.next_ids[:, step] if batch.next_ids is not None else target_ids
        return trace
