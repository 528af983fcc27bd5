"""SpecForge 0.2.0's export (`export/to_sglang.py`, semantics §3.3): a flat LlamaConfig, layer 0 as
`midlayer.*`, no embed_tokens, and SpecForge's own meaning of `norm_output`.

The writer refuses every knob SpecForge cannot train (ConversionError naming it), rather than drop it.
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.errors import ConversionError, Fields
from conformance.checkpoints.formats import sglang
from conformance.checkpoints.formats.flat import parse_flat
from conformance.checkpoints.knobs import ParsedConfig
from conformance.checkpoints.schema import stored_name as _stored_name
from reference.eagle3 import Eagle3Config

NAME = "specforge"
# Knobs SpecForge's EAGLE-3 draft (0.2.0) does not have (semantics §1.2, §3.3): knob -> why. The same table
# decides what the SpecForge adapter skips (conformance/adapters/specforge: `unsupported`).
CANNOT_EXPRESS = {
    "norm_before_fc": "no input norm over the aux states (llama3_eagle.py:1674-1686)",
    "norm_before_residual": "the residual is always the raw hidden (llama3_eagle.py:1625); only P-EAGLE has "
                            "the knob (peagle.py:97-130)",
    "norm_output": "the hidden fed back is always the pre-norm layer output (model.py:397); its own norm_output "
                   "means 'final norm before lm_head' (llama3_eagle.py:1690, 1773)",
    "attention_bias": "q/k/v/o are nn.Linear(bias=False) (llama3_eagle.py:555-566)",
    "mlp_bias": "gate/up/down are nn.Linear(bias=False) (llama3_eagle.py:1513-1515)",
    "num_hidden_layers": "one midlayer only (algorithms/eagle3/providers.py:131 fixed_override_values)",
    "num_aux_hidden_states": "fc is target_hidden_size * 3 wide and project_hidden_states chunks by 3 "
                             "(llama3_eagle.py:1674-1678, 1762-1769)",
    "sliding_window": "its draft attention has no window (llama3_eagle.py:700-760)",
    "tie_word_embeddings": "forced false when the config is read (modeling/auto.py:90-92)",
    "draft_arch": "its draft layer is Llama-shaped, without q_norm/k_norm (llama3_eagle.py:1570-1595)",
    "partial_rotary_factor": "its rotary turns the whole head (llama3_eagle.py:133-142)",
}
# Knobs whose non-default value SpecForge cannot have, with their config.json field.
UNTRAINED = {"draft_arch": ("model_type", "llama"), "partial_rotary_factor": ("partial_rotary_factor", 1)}


def norm_output(f: Fields, problems: list) -> bool:
    """SpecForge's norm_output (default True) means "logits from the normed hidden"; the hidden fed back
    is always the pre-norm one (llama3_eagle.py:1690, 1772-1777; model.py:397): in training semantics
    that is norm_output False, and False means logits without the final norm."""
    if f.has("norm_output") and not f.bool("norm_output"):
        problems.append(("field norm_output", "false: SpecForge then computes logits without the final norm "
                                              "(llama3_eagle.py:1772-1777), which no other implementation can"))
    return False


def untrained_knobs(knobs: dict, problems: list, notes: list) -> None:
    """qwen3 layers or partial rotary in a config SpecForge trained from: it ran neither, so the file
    does not say what was trained (a problem, not a guess)."""
    for knob, (field, default) in UNTRAINED.items():
        if knobs[knob] != default:
            problems.append((f"field {field}", f"{knobs[knob]}: SpecForge did not train it ({CANNOT_EXPRESS[knob]})"))


def parse(raw: dict, file: Path) -> ParsedConfig:
    return parse_flat(raw, file, NAME, norm_output=norm_output, format_checks=untrained_knobs)


def stored_name(name: str) -> str:
    return _stored_name(name, midlayer=True)


def inexpressible(cfg: Eagle3Config) -> dict[str, str]:
    """knob -> why, for every knob of `cfg` SpecForge's draft cannot have (empty: it can express `cfg`)."""
    differs = {"num_hidden_layers": cfg.num_hidden_layers != 1, "num_aux_hidden_states": cfg.num_aux_hidden_states != 3,
               "sliding_window": cfg.sliding_window is not None,
               **{knob: getattr(cfg, knob) != default for knob, (_, default) in UNTRAINED.items()}}
    return {knob: reason for knob, reason in CANNOT_EXPRESS.items() if differs.get(knob, getattr(cfg, knob))}


def config_json(cfg: Eagle3Config) -> dict:
    for knob, reason in inexpressible(cfg).items():
        raise ConversionError(f"specforge format cannot express {knob}={getattr(cfg, knob)!r}: {reason}")
    out = sglang.config_json(cfg)
    # SpecForge itself exports no eagle_config, so custom aux ids are lost at serve time (§3.3, R21);
    # this writer keeps them where SGLang reads them, as a correct export would.
    for key in ("norm_before_fc", "norm_before_residual", "norm_output", "attention_bias", "mlp_bias"):
        out.pop(key, None)
    out.update(use_cache=True, pad_token_id=0)
    if cfg.rope_scaling:   # apply_legacy_rope_scaling (checkpoint_io.py): both representations
        out["rope_parameters"] = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    return out
