"""The tensor schema of an EAGLE-3 draft, written once: canonical names, shapes and kinds per config.

Canonical names are the speculators / SGLang ones (`fc.weight`, `layers.0.self_attn.q_proj.weight`,
`fc_norm.j.weight`, `d2t`); formats that store other names map to them (`to_canonical`, and each
format's `stored_name`). fixtures/tiny.py generates its weights from this schema and the user's
checkpoint is validated against it, so a tensor is declared here or nowhere.
"""
from __future__ import annotations

from reference.eagle3 import Eagle3Config

LEGACY_FC_NORM = ("aux_norm_low", "aux_norm_mid", "aux_norm_high")   # SGLang llama_eagle3.py:337-343
Schema = dict[str, tuple[tuple[int, ...], str]]                     # name -> (shape, kind: float | int64 | bool)


def expected_tensors(cfg: Eagle3Config) -> Schema:
    """Canonical name -> (shape, kind) of every tensor the draft needs, in a fixed order."""
    H, Ht, A, hd = cfg.hidden_size, cfg.target_hidden_size, cfg.num_aux_hidden_states, cfg.head_dim
    nh, nkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    out: Schema = {"embed_tokens.weight": ((cfg.vocab_size, H), "float"), "fc.weight": ((H, A * Ht), "float")}
    if cfg.norm_before_fc:
        out["input_norm.weight"] = ((A * Ht,), "float")
    if cfg.fc_norm:
        out.update({f"fc_norm.{j}.weight": ((Ht,), "float") for j in range(A)})
    for i in range(cfg.num_hidden_layers):
        p, qkv_in = f"layers.{i}", (2 * H if i == 0 else H)
        out[f"{p}.input_layernorm.weight"] = ((H,), "float")
        if i == 0:
            out[f"{p}.hidden_norm.weight"] = ((H,), "float")
        out[f"{p}.post_attention_layernorm.weight"] = ((H,), "float")
        if cfg.draft_arch == "mla":
            out.update(_mla_tensors(cfg, p, qkv_in))
        else:
            for name, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
                out[f"{p}.self_attn.{name}.weight"] = ((rows, qkv_in), "float")
                if cfg.attention_bias:
                    out[f"{p}.self_attn.{name}.bias"] = ((rows,), "float")
            out[f"{p}.self_attn.o_proj.weight"] = ((H, nh * hd), "float")
        if cfg.attention_bias:
            out[f"{p}.self_attn.o_proj.bias"] = ((H,), "float")
        if cfg.draft_arch == "qwen3":   # Qwen3Attention's per-head norms (transformers modeling_qwen3.py)
            out[f"{p}.self_attn.q_norm.weight"] = ((hd,), "float")
            out[f"{p}.self_attn.k_norm.weight"] = ((hd,), "float")
        out[f"{p}.mlp.gate_proj.weight"] = ((inter, H), "float")
        out[f"{p}.mlp.up_proj.weight"] = ((inter, H), "float")
        out[f"{p}.mlp.down_proj.weight"] = ((H, inter), "float")
        if cfg.mlp_bias:
            out.update({f"{p}.mlp.{n}.bias": ((rows,), "float") for n, rows in _mlp_rows(cfg)})
    out["norm.weight"] = ((H,), "float")
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.draft_vocab_size, H), "float")
    if cfg.draft_vocab_size != cfg.vocab_size:
        out["d2t"] = ((cfg.draft_vocab_size,), "int64")
        out["t2d"] = ((cfg.vocab_size,), "bool")
    return out


def _mla_tensors(cfg: Eagle3Config, p: str, d_in: int) -> Schema:
    """An MLA layer's attention (transformers DeepseekV3Attention's names, reference/eagle3.py mla_attention)."""
    m, a = cfg.mla, f"{p}.self_attn"
    nh = m.num_attention_heads
    out: Schema = {}
    if m.q_lora_rank is None:
        out[f"{a}.q_proj.weight"] = ((nh * m.qk_head_dim, d_in), "float")
    else:
        out[f"{a}.q_a_proj.weight"] = ((m.q_lora_rank, d_in), "float")
        out[f"{a}.q_a_layernorm.weight"] = ((m.q_lora_rank,), "float")
        out[f"{a}.q_b_proj.weight"] = ((nh * m.qk_head_dim, m.q_lora_rank), "float")
    out[f"{a}.kv_a_proj_with_mqa.weight"] = ((m.kv_lora_rank + m.qk_rope_head_dim, d_in), "float")
    out[f"{a}.kv_a_layernorm.weight"] = ((m.kv_lora_rank,), "float")
    out[f"{a}.kv_b_proj.weight"] = ((nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), "float")
    out[f"{a}.o_proj.weight"] = ((cfg.hidden_size, nh * m.v_head_dim), "float")
    return out


def _mlp_rows(cfg: Eagle3Config) -> tuple[tuple[str, int], ...]:
    inter, H = cfg.intermediate_size, cfg.hidden_size
    return ("gate_proj", inter), ("up_proj", inter), ("down_proj", H)


def needed_by(name: str, cfg: Eagle3Config) -> str:
    """Why `cfg` needs the tensor `name` (for "missing" errors)."""
    if name == "input_norm.weight":
        return "norm_before_fc is true"
    if name.startswith("fc_norm."):
        return "fc_norm is true"
    if name.endswith(".bias"):
        return "attention_bias is true" if "self_attn" in name else "mlp_bias is true"
    if any(part in name for part in (".q_a_", ".q_b_", ".kv_a_", ".kv_b_")) or (
            cfg.draft_arch == "mla" and name.endswith("self_attn.q_proj.weight")):
        return "draft_arch is mla (DeepSeek's latent attention)"
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return "draft_arch is qwen3 (model_type qwen3)"
    if name == "lm_head.weight":
        return "tie_word_embeddings is false"
    if name in ("d2t", "t2d"):
        return f"draft_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.vocab_size}"
    return "every EAGLE-3 draft"


def undeclared_tensors(cfg: Eagle3Config) -> Schema:
    """Tensors some implementation reads although this config does not declare them.

    They are not malformed input but findings: e.g. a q_proj.bias with attention_bias false is used
    by the reference, refused by speculators' loader and dropped silently by SGLang's.
    """
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    out: Schema = {"fc.bias": ((H,), "float"),                         # SGLang: config `bias` (llama_eagle3.py:166)
                   "verifier_lm_head.weight": ((cfg.draft_vocab_size, H), "float"),   # speculators training-only
                   "verifier_norm.weight": ((H,), "float")}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}"
        if i > 0:
            out[f"{p}.hidden_norm.weight"] = ((H,), "float")          # SGLang uses it for layers >= 1 (:103-105)
        if not cfg.attention_bias and cfg.draft_arch != "mla":
            out.update({f"{p}.self_attn.{n}.bias": ((r,), "float") for n, r in
                        (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd), ("o_proj", H))})
        if not cfg.mlp_bias:
            out.update({f"{p}.mlp.{n}.bias": ((rows,), "float") for n, rows in _mlp_rows(cfg)})
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.draft_vocab_size, H), "float")
    if cfg.draft_vocab_size == cfg.vocab_size:   # identity maps are tolerated (speculators model.py:97-102)
        out["d2t"] = ((cfg.draft_vocab_size,), "int64")
        out["t2d"] = ((cfg.vocab_size,), "bool")
    return out


def to_canonical(name: str) -> str:
    """SGLang's name handling (llama_eagle3.py:325-343): optional `model.` prefix, legacy names."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    for j, legacy in enumerate(LEGACY_FC_NORM):
        if name.startswith(legacy + "."):
            name = f"fc_norm.{j}." + name[len(legacy) + 1:]
    return name


def stored_name(name: str, midlayer: bool = False, legacy_fc_norm: bool = False) -> str:
    """The name a canonical tensor is stored under: `midlayer.*` for layer 0 (SpecForge's and the original
    EAGLE-3's module name), `aux_norm_low/mid/high` for fc_norm (SGLang's legacy names)."""
    if midlayer and name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    if legacy_fc_norm and name.startswith("fc_norm.") and name.split(".")[1] in ("0", "1", "2"):
        j, rest = name[len("fc_norm."):].split(".", 1)
        name = f"{LEGACY_FC_NORM[int(j)]}.{rest}"
    return name
