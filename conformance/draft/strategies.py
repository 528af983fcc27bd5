"""Hypothesis strategies over the EAGLE-3 draft config space and its inputs, with labelled draws.

`draw_case(data)` draws one DraftCase: shapes (heads, KV heads, head_dim, widths with the A*Ht == H
coincidence that decides SGLang's shape-conditional fc), vocab and draft vocab, every norm knob,
1-3 layers, RoPE type and parameters, biases, tied embeddings, batch composition and a seed.
Every draw carries a label, so a failing example prints as a readable configuration.
"""
from __future__ import annotations

import hashlib
import json

from hypothesis import strategies as st

from fixtures.cases import DraftCase
from fixtures.tiny import ROPE_SCALINGS

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
