"""The original EAGLE-3 trainer's config (SafeAILab/EAGLE `traineagle3/config.json`, semantics §3.4):
a flat LlamaConfig with `architectures: [LlamaForCausalLM]` and `draft_vocab_size`; layer 0 as
`midlayer.*`. Read only: this suite never writes it.
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.formats.flat import parse_flat
from conformance.checkpoints.knobs import ParsedConfig
from conformance.checkpoints.schema import stored_name as _stored_name

NAME = "eagle"
# What the original trainer's draft cannot have (ea:cnets.py): knob -> (config field, why).
UNTRAINED = {"draft_arch": ("model_type", "its draft layer is Llama-shaped, without q_norm/k_norm (cnets.py)"),
             "partial_rotary_factor": ("partial_rotary_factor", "its RoPE turns the whole head (cnets.py:207-209)")}
DEFAULTS = {"draft_arch": "llama", "partial_rotary_factor": 1}


def format_checks(knobs: dict, problems: list, notes: list) -> None:
    for knob, (field, why) in UNTRAINED.items():
        if knobs[knob] != DEFAULTS[knob]:
            problems.append((f"field {field}", f"{knobs[knob]}: the original EAGLE-3 trainer did not train it ({why})"))
    H, nh = knobs["hidden_size"], knobs["num_attention_heads"]
    if knobs["head_dim"] * nh != H or knobs["rope_theta"] != 10000 or knobs["rope_scaling"]:
        notes.append("the original EAGLE-3 trainer ignores head_dim, rope_theta and llama3 scaling (H // heads, "
                     "base 10000; ea:cnets.py:191, 207-209); the config values are used here")


def parse(raw: dict, file: Path) -> ParsedConfig:
    return parse_flat(raw, file, NAME, format_checks=format_checks)


def stored_name(name: str) -> str:
    return _stored_name(name, midlayer=True)
