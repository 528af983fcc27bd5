"""speculators runs its training attention in the CPU lane: flex attention over its own block masks.

Eager flex attention (CPU) evaluates the block mask's mask_mod over every (query, key) pair; the block
indices (create_block_mask, extend_mask_for_draft_tokens) only steer the compiled kernels of the GPU
lane. So what the CPU lane newly runs is speculators' mask_mod at TTT steps >= 1, whose keys lie beyond
the packed length (create_combined_mask_mod, models/eagle3/attention.py:11-34: `kv_idx % total_seq_len`),
and its flex attention call. The plant is a mask_mod that drops every key of steps >= 1 (the TTT
diagonal): the suite must name step 1's attention. The sdpa lane used before built steps >= 1 with
extend_dense_mask_for_draft_tokens instead and never evaluated the mask_mod there.
"""
from __future__ import annotations

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.core.compare import compare_traces
from conformance.meta.test_harness import assert_names_stage
from fixtures.cases import CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
CASE = CASES_BY_ID["ms_gqa"]
STEPS = 2


def run_speculators(drafts):
    loaded = ADAPTERS["speculators"]().load(drafts.checkpoint(CASE)["speculators"], torch.float32)
    return loaded.run(drafts.batch(CASE, STEPS), STEPS)


def test_speculators_runs_flex_attention_over_its_block_masks(drafts, monkeypatch):
    from speculators.models.eagle3 import core

    calls = []
    original = core.extend_mask_for_draft_tokens

    def counted(block_mask):
        calls.append(type(block_mask).__name__)
        return original(block_mask)

    monkeypatch.setattr(core, "extend_mask_for_draft_tokens", counted)
    trace = run_speculators(drafts)
    assert calls == ["BlockMask"] * STEPS, f"speculators extended its block mask {calls}, expected {STEPS} times"
    assert any("simple_flex_attention" in note for note in trace.notes), trace.notes


def test_a_mask_without_the_ttt_diagonal_is_named_at_step_1(drafts, monkeypatch):
    from speculators.models.eagle3 import core

    original = core.create_combined_mask_mod

    def planted(document_ids, total_seq_len, sliding_window=None):
        mask_mod = original(document_ids, total_seq_len, sliding_window)
        return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx) & (kv_idx < total_seq_len)

    expected = drafts.trace("reference", CASE, torch.float32, STEPS)
    clean = compare_traces(run_speculators(drafts), expected, CASE.id)
    assert clean.first_divergence is None, clean.message("(control, no plant)")

    monkeypatch.setattr(core, "create_combined_mask_mod", planted)
    comparison = compare_traces(run_speculators(drafts), expected, CASE.id)
    assert_names_stage(comparison, "layers.0.attn_core", step=1)
