"""Hypothesis strategies over the EAGLE-3 draft config space and its inputs, with labelled draws.

`draw_case(data)` draws one DraftCase: shapes (heads, KV heads, head_dim, widths with the A*Ht == H
coincidence that decides SGLang's shape-conditional fc), vocab and draft vocab, every norm knob,
1-3 layers, RoPE type and parameters, biases, tied embeddings, batch composition and a seed.
Every draw carries a label, so a failing example prints as a readable configuration.

`draw_example(data)` adds whether the example is to be clean, and `variants(case, clean)` turns the draw
into the configurations to run: "clean" comes from the registry (each applicable entry's `neutral` knobs or
`neutral_weights`, conformance/core/registry.py `neutralised`), never from a list of knobs kept here.
"""
from __future__ import annotations

import hashlib
import json

from hypothesis import strategies as st

from conformance.adapters import IMPLEMENTATIONS
from conformance.core.registry import Neutralised, for_case, neutralised
from fixtures.cases import DraftCase
from fixtures.tiny import ROPE_SCALINGS
from reference.eagle3 import Eagle3Config

# Two clean draws in three: the drawn knobs rarely avoid every registered divergence on their own (SGLang's
# alone: about 1 in 40).
CLEAN = st.sampled_from([True, True, False])
FLAGS = ("tie_word_embeddings", "norm_before_fc", "fc_norm", "norm_before_residual", "norm_output", "attention_bias",
         "mlp_bias")


def draw_case(data) -> DraftCase:
    d = data.draw
    heads = d(st.sampled_from([1, 2, 4]), label="num_attention_heads")
    kv_heads = d(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]), label="num_key_value_heads")
    head_dim = d(st.sampled_from([4, 8, 12]), label="head_dim")
    aux = d(st.integers(1, 5), label="num_aux_hidden_states")
    widths = d(st.sampled_from(["same", "different", "fc_widths_coincide"]), label="widths")
    if widths == "fc_widths_coincide":        # A * Ht == H: SGLang never runs fc (llama_eagle3.py:238)
        target_hidden = d(st.sampled_from([8, 12, 16]), label="target_hidden_size")
        hidden = aux * target_hidden
    else:
        hidden = d(st.sampled_from([16, 24, 40]), label="hidden_size")
        target_hidden = hidden if widths == "same" else d(
            st.sampled_from([w for w in (20, 32, 56) if w * aux != hidden]), label="target_hidden_size")
    vocab = d(st.integers(40, 120), label="vocab_size")
    tied = d(st.booleans(), label="tie_word_embeddings")
    draft_vocab = vocab if tied else d(st.sampled_from([vocab, vocab // 2, 17]), label="draft_vocab_size")
    fc_input_norm = d(st.sampled_from(["none", "norm_before_fc", "fc_norm"]), label="fc input norm")
    rope = d(st.sampled_from(sorted(ROPE_SCALINGS)), label="rope_type")
    overrides = {
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_aux_hidden_states": aux, "hidden_size": hidden, "target_hidden_size": target_hidden,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "tie_word_embeddings": tied,
        "norm_before_fc": fc_input_norm == "norm_before_fc", "fc_norm": fc_input_norm == "fc_norm",
        "norm_before_residual": d(st.booleans(), label="norm_before_residual"),
        "norm_output": d(st.booleans(), label="norm_output"),
        "num_hidden_layers": d(st.integers(1, 3), label="num_hidden_layers"),
        "intermediate_size": d(st.sampled_from([24, 37]), label="intermediate_size"),
        "rope_theta": d(st.sampled_from([10000.0, 500000.0]), label="rope_theta"),
        "rope_scaling": ROPE_SCALINGS[rope],
        "attention_bias": d(st.booleans(), label="attention_bias"),
        "mlp_bias": d(st.booleans(), label="mlp_bias"),
        "aux_layer_ids": tuple(range(1, 1 + aux)),
    }
    lengths = tuple(d(st.lists(st.integers(1, 9), min_size=1, max_size=3), label="sequence lengths"))
    seed = d(st.integers(0, 2**16), label="seed")
    key = json.dumps([overrides, lengths, seed], sort_keys=True, default=str)
    case_id = "hyp_" + hashlib.sha256(key.encode()).hexdigest()[:10]
    return DraftCase(case_id, tuple(sorted(overrides.items())), lengths=lengths, seed=seed,
                     summary="hypothesis example")


def draw_example(data) -> tuple[DraftCase, bool]:
    """A drawn case and whether the example is to be run clean (no registered divergence of any implementation)."""
    case = draw_case(data)
    return case, data.draw(CLEAN, label="clean (every registered divergence neutralised)")


def variants(case: DraftCase, clean: bool) -> list[Neutralised]:
    """The configurations an example runs: a clean example only its neutralised case; any other the case as
    drawn and, when an implementation has registered behaviour on it, the neutralised case too, so the rest
    of the draft is compared past the first registered divergence. The case as drawn is a Neutralised of nothing."""
    neutral, drawn = neutralised(case, IMPLEMENTATIONS), Neutralised(case, (), ())
    return [drawn] if not neutral.entries else [neutral] if clean else [drawn, neutral]


def label(variant: Neutralised, drawn: DraftCase) -> str:
    """What a variant is, for the report: as drawn, or which knobs / weights neutralised which entries."""
    if not variant.entries:
        clean = not any(for_case(impl, drawn) for impl in IMPLEMENTATIONS)
        return "as drawn" + (" (no registered divergence)" if clean else "")
    before = dict(drawn.overrides + drawn.sglang_args)
    changed = [f"{k}={v}" for k, v in variant.case.overrides + variant.case.sglang_args if before.get(k, ...) != v]
    changed += [f"/{p}/ = 1" for p in variant.unit_weights]
    return f"neutralised {', '.join(changed)} ({', '.join(e.id for e in variant.entries)})"


def describe(config: Eagle3Config) -> str:
    """A one-line summary of a drawn configuration, for the report."""
    c = config
    rope = (c.rope_scaling or {}).get("rope_type", "default")
    flags = [f for f in FLAGS if getattr(c, f)] + ([f"rope {rope}"] if rope != "default" else [])
    return (f"{c.num_hidden_layers} layer(s), H {c.hidden_size}, aux {c.num_aux_hidden_states}x{c.target_hidden_size}, "
            f"heads {c.num_attention_heads}/{c.num_key_value_heads}x{c.head_dim}, vocab {c.vocab_size}/"
            f"{c.draft_vocab_size}" + "".join(f", {f}" for f in flags))
