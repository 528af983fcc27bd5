"""The flat config.json every format but speculators' uses: one LlamaConfig plus EAGLE-3 keys.

sglang, sglang-legacy, specforge and eagle all read through `parse_flat`; each format module passes
what differs (the meaning of `norm_output`, its own problems and notes). Aux ids in `eagle_config`
are SGLang's convention (output of layer i) and come back in the training one (input of layer i + 1).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from conformance.checkpoints.errors import Fields
from conformance.checkpoints.knobs import SGLANG_PARTIAL_ROTARY, ParsedConfig, check_contradictions, layer_knobs

# (fields, problems) -> norm_output in training semantics
NormOutput = Callable[[Fields, list], bool]


def plain_norm_output(f: Fields, problems: list) -> bool:
    return f.bool("norm_output")


def parse_flat(raw: dict, file: Path, fmt: str, norm_output: NormOutput = plain_norm_output,
               format_checks: Callable[[dict, list, list], None] | None = None) -> ParsedConfig:
    """`format_checks(knobs, problems, notes)` adds what only this format says, before the shared checks."""
    f = Fields(raw, file)
    problems, notes = [], []
    knobs = layer_knobs(f, problems, notes)
    V = knobs["vocab_size"]
    if f.has("target_vocab_size"):   # inverted naming (speculators research Eagle3Deepspeed configs)
        Vd, V = V, f.int("target_vocab_size")
        knobs["vocab_size"] = V
        notes.append("vocab_size is the draft vocabulary here; target_vocab_size the target's")
    elif f.has("draft_vocab_size"):
        Vd = f.int("draft_vocab_size")
    else:
        Vd = V
        notes.append("no draft_vocab_size: SGLang loads lm_head from the target (llama_eagle3.py:306-308)")
    eagle = f.sub("eagle_config")
    # SGLang's convention: output of layer i, so -1 is the embeddings (training id 0).
    ids = eagle.ids("eagle_aux_hidden_state_layer_ids", minimum=-1) if eagle else None
    top_ids = f.ids("eagle_aux_hidden_state_layer_ids")
    if ids is not None:
        ids = [i + 1 for i in ids]          # SGLang: output of layer i -> training: input of layer i + 1
        if top_ids is not None and top_ids != ids:
            problems.append(("field eagle_aux_hidden_state_layer_ids", f"{top_ids} contradicts eagle_config ids "
                                                                       f"{[i - 1 for i in ids]} (output-of-layer)"))
    elif top_ids is not None:
        ids = top_ids
        notes.append("aux ids only at the top level: SGLang ignores them and captures its default layers "
                     "(spec_aux_hidden_state.py:185-196)")
    A = f.int("num_aux_hidden_states", len(ids) if ids else 3)
    block = f.sub("eagle3")           # speculators research onlineEagle3: {"concat_factor", "fc_in_dim", "fc_out_dim"}
    if block is not None:
        A = block.int("concat_factor", A)
    Ht = f.int("target_hidden_size", knobs["hidden_size"])
    if block is not None and block.has("fc_in_dim") and block.int("fc_in_dim") != A * Ht:
        problems.append(("field eagle3.fc_in_dim", f"{block.raw['fc_in_dim']} != concat_factor {A} * hidden {Ht}"))
    if block is not None and block.has("fc_out_dim") and block.int("fc_out_dim") != knobs["hidden_size"]:
        problems.append(("field eagle3.fc_out_dim", f"{block.raw['fc_out_dim']} != hidden_size {knobs['hidden_size']}"))
    norm_before_fc = eagle.bool("norm_before_fc", f.bool("norm_before_fc")) if eagle else f.bool("norm_before_fc")
    knobs["norm_output"] = norm_output(f, problems)
    if f.bool("bias"):
        problems.append(("field bias", "true adds an fc and o_proj bias in SGLang only (llama_eagle3.py:166, "
                                       "llama.py:339-341); training has none"))
    knobs.update(
        vocab_size=V,
        draft_vocab_size=Vd,
        target_hidden_size=Ht,
        num_aux_hidden_states=A,
        norm_before_fc=bool(norm_before_fc),
        fc_norm=f.bool("fc_norm") or f.bool("use_aux_norm"),
        norm_before_residual=f.bool("norm_before_residual"),
        tie_word_embeddings=f.bool("tie_word_embeddings"),
        aux_layer_ids=tuple(ids) if ids else None,
    )
    top_partial = raw.get("partial_rotary_factor", 1)
    if top_partial != knobs["partial_rotary_factor"]:
        notes.append(f"partial_rotary_factor {knobs['partial_rotary_factor']} is read from the RoPE block; SGLang "
                     f"reads only the top-level key ({SGLANG_PARTIAL_ROTARY}), which gives {top_partial}")
    if format_checks is not None:
        format_checks(knobs, problems, notes)
    if raw.get("target_model_type"):
        notes.append(f"target_model_type {raw['target_model_type']}")
    check_contradictions(knobs, problems)
    return ParsedConfig(fmt, knobs, tuple(problems), tuple(notes))
