"""Known divergences of the implementations under test from training semantics.

Each entry is demonstrated by a failing comparison in this suite (the test that hits it is a strict
xfail that only counts when the first divergent stage is the one named here; a divergence elsewhere,
or none at all, fails the test). Citations are file:line in the pinned packages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from conformance.stages import stage_names
from fixtures.cases import DraftCase

LOAD = "load"   # the stage name for "the implementation's own loader refused the checkpoint"


@dataclass(frozen=True)
class KnownDivergence:
    impl: str                                 # adapter name
    condition: str                            # the knob values (and server flags) it needs, readable
    applies: Callable[[DraftCase], bool]      # the same condition, evaluated on a case
    stage: str                                # first divergent stage (layers.i. prefix included)
    reason: str                               # why, with file:line
    step: int = 0                             # the draft step where it first shows

    def describe(self) -> str:
        return f"{self.impl} when {self.condition}: first divergence at step {self.step}, '{self.stage}'. {self.reason}"


KNOWN_DIVERGENCES: tuple[KnownDivergence, ...] = (
    KnownDivergence(
        "sglang", "num_aux_hidden_states * target_hidden_size == hidden_size",
        lambda c: c.config.num_aux_hidden_states * c.config.target_hidden_size == c.config.hidden_size, "fc_out",
        "SGLang applies input_norm/fc_norm/fc only when the aux width differs from the embedding width "
        "(sglang/srt/models/llama_eagle3.py:238); training always applies fc (speculators core.py:244)."),
    KnownDivergence(
        "sglang", "norm_before_residual is true",
        lambda c: c.config.norm_before_residual, "layers.0.residual",
        "SGLang always adds the attention output to the raw hidden (llama_eagle3.py:97-99); "
        "speculators uses the normed hidden (model_definitions.py:80-81)."),
    KnownDivergence(
        "sglang", "attention_bias is true",
        lambda c: c.config.attention_bias, "layers.0.q",
        "SGLang's layer-0 qkv_proj is built with bias=False (llama_eagle3.py:67-75) and load_weights skips "
        "the q/k/v bias tensors silently (llama_eagle3.py:371-378)."),
    KnownDivergence(
        "sglang", "mlp_bias is true",
        lambda c: c.config.mlp_bias, "layers.0.mlp_out",
        "SGLang's LlamaMLP is built with bias=False (llama_eagle3.py:82-84, llama.py:85-120) and load_weights "
        "skips the gate/up/down bias tensors silently (llama_eagle3.py:371-378)."),
    KnownDivergence(
        "sglang", "sliding_window is set (and sequences are longer than the window)",
        lambda c: c.config.sliding_window is not None and not dict(c.sglang_args).get("speculative_draft_window_size"),
        "layers.0.attn_core",
        "SGLang's draft never reads the config's sliding_window/layer_types; only the server flag "
        "--speculative-draft-window-size sets a window (llama_eagle3.py:286-299), so it attends to the whole prefix."),
    KnownDivergence(
        "sglang", "sliding_window W and --speculative-draft-window-size W",
        lambda c: c.config.sliding_window is not None
        and dict(c.sglang_args).get("speculative_draft_window_size") == c.config.sliding_window,
        "layers.0.attn_core",
        "SGLang's window is exclusive: a query sees keys k_pos >= q_pos - W, W + 1 of them "
        "(layers/attention/torch_native_backend.py:48), and LlamaForCausalLMEagle3 passes the flag without the "
        "-1 other models apply (llama_eagle3.py:297-299; gpt_oss.py:129-132); training sees W keys including "
        "itself (speculators models/eagle3/attention.py:16-20)."),
    KnownDivergence(
        "sglang", "sliding_window W and --speculative-draft-window-size W - 1",
        lambda c: c.config.sliding_window is not None
        and dict(c.sglang_args).get("speculative_draft_window_size") == c.config.sliding_window - 1,
        "layers.0.attn_core",
        "In serving the window slides with the drafted chain: the DECODE query of step k at position s+k "
        "sees keys from s+k-W+1 on (torch_native_backend.py:48), losing k target-feature keys; training keeps "
        "the step-0 window of W keys at every TTT step plus the diagonal (speculators attention.py:11-34).",
        step=1),
    KnownDivergence(
        "sglang", "num_hidden_layers > 1",
        lambda c: c.config.num_hidden_layers > 1, "layers.1.hidden_norm",
        "SGLang normalises layers >= 1 with hidden_norm (llama_eagle3.py:103-105), which no checkpoint "
        "has for those layers (weight stays ones); training uses input_layernorm (stock HF layer, core.py:91-93)."),
    KnownDivergence(
        "speculators", "target_hidden_size != hidden_size",
        lambda c: c.config.target_hidden_size != c.config.hidden_size, LOAD,
        "speculators builds fc as Linear(A*hidden_size, hidden_size) and ignores target_hidden_size "
        "(speculators/models/eagle3/core.py:76-78), so a draft whose aux width differs cannot be loaded."),
)


def known_divergence(impl: str, case: DraftCase) -> KnownDivergence | None:
    """The entry that decides this (implementation, case) pair: the earliest step and stage wins."""
    hits = [d for d in KNOWN_DIVERGENCES if d.impl == impl and d.applies(case)]
    if not hits:
        return None
    order = {LOAD: -1, **{name: i for i, name in enumerate(stage_names(case.config.num_hidden_layers))}}
    return min(hits, key=lambda d: (d.step, order[d.stage]))
