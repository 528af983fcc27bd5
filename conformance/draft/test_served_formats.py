"""The same draft in another config format a server also reads (its adapter's `other_formats`): step 0
against the reference, as test_step0.py runs it in the adapter's own format, on the same weights.

A draft moves between trainers and servers in either format, and a server's readers of the two differ. What
a server does differently in a format is declared here, each as a Known with its exact place (a format is
not a registry name, as tree shapes are not: test_tree.py); the param is a strict xfail that only counts
at that place. These run in the server's own lane when it has one (vLLM: make vllm).
"""
from __future__ import annotations

import pytest
import torch

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS
from conformance.core.common import first_line
from conformance.core.compare import compare_traces
from conformance.core.matching import known_param, match_forward, match_load, settle
from conformance.core.registry import Known
from fixtures.cases import STEP0_CASES

pytestmark = pytest.mark.cpu

VLLM_SGLANG_FORMAT = (
    Known("draft", "vllm-sglang-format-tied-lm-head-taken-from-target", "vllm", "==0.33.0", "tie_word_embeddings",
          "as in the speculators format (registry vllm-tied-lm-head-taken-from-target): without an lm_head tensor "
          "the proposer serves the target's (v1/spec_decode/llm_base_proposer.py:1510-1523)",
          step=0, stage="logits"),
    Known("draft", "vllm-sglang-format-window-needs-layer-types", "vllm", "==0.33.0", "sliding_window != None",
          "vLLM's Llama attention takes a window only from config.layer_types (model_executor/models/llama.py:"
          "185-204); the SGLang-format config says sliding_window / use_sliding_window without layer_types, so "
          "the draft attends to every key (the speculators format's transformer_layer_config carries layer_types)",
          step=0, stage="layers.0.attn_core"),
    Known("load", "vllm-sglang-format-qwen3-built-as-llama", "vllm", "==0.33.0", "draft_arch == 'qwen3'",
          "architectures LlamaForCausalLMEagle3 resolves to Eagle3LlamaForCausalLM whatever the model_type "
          "(model_executor/models/registry.py:702), which has no q_norm/k_norm, so its loader refuses the "
          "tensors; the speculators format's translator picks Eagle3Qwen3ForCausalLM from model_type "
          "(transformers_utils/configs/speculators/algos.py:39-46)",
          error="ValueError", message=r"There is no module or parameter named 'layers\.0\.self_attn\.[qk]_norm'"),
)
KNOWN = {("vllm", "sglang"): VLLM_SGLANG_FORMAT}


def known_for(impl: str, fmt: str, case) -> tuple[Known, ...]:
    from conformance.core.registry import case_names

    return tuple(e for e in KNOWN.get((impl, fmt), ()) if e.applies(case_names(case)))


def params():
    for impl in ALL_IMPLEMENTATIONS:
        for fmt in ADAPTERS[impl].other_formats:
            for case in STEP0_CASES:
                yield known_param(impl, fmt, case, id=f"{impl}-{fmt}-{case.id}", known=known_for(impl, fmt, case))


@pytest.mark.parametrize("impl,fmt,case", list(params()))
def test_other_format_step0_matches_reference(impl, fmt, case, drafts, repro):
    known = known_for(impl, fmt, case)
    try:
        loaded = ADAPTERS[impl]().load(drafts.checkpoint(case)[fmt], torch.float32)
    except Exception as exc:   # the server's loader refused the format: its own words, one line
        settle(f"{impl} [{fmt} format] could not load {case.id}: {type(exc).__name__}: {first_line(exc)}\n"
               f"  repro: {repro}", match_load(known, type(exc).__name__, first_line(exc)))
    actual = loaded.run(drafts.batch(case), 1).on_cpu()
    comparison = compare_traces(actual, drafts.trace("reference", case, torch.float32), f"{case.id} ({fmt} format)")
    first = comparison.first_divergence
    if first is not None:
        settle(comparison.message(repro), match_forward(known, first, case.config.num_hidden_layers))
