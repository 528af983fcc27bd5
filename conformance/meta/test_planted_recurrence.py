"""Planted recurrence bugs (draft steps >= 1) are caught at step 1, at the stage where they act.

Each plant is a deliberate mutation of one run, made here and nowhere else: SGLang feeding the
post-norm hidden back although the checkpoint says pre-norm (norm_output false), and a residual taken
after hidden_norm from step 1 on.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.core.trace import Trace
from conformance.core.compare import compare_traces
from conformance.meta.test_harness import assert_names_stage
from fixtures.cases import CASES_BY_ID
from reference.eagle3 import Eagle3Reference

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
CASE = CASES_BY_ID["ms_gqa"]
STEPS = 3


def test_sglang_feeding_post_norm_hidden_fails_at_step_1(drafts):
    assert not CASE.config.norm_output
    loaded = ADAPTERS["sglang"]().load(drafts.checkpoint(CASE)["sglang"], torch.float32)
    inner = loaded.model.model
    forward = inner.forward

    def planted(input_ids, positions, forward_batch, *args, **kwargs):
        # The plant: DECODE passes return the normed hidden as the one to feed back.
        inner.norm_output = forward_batch.forward_mode.is_decode()
        return forward(input_ids, positions, forward_batch, *args, **kwargs)

    inner.forward = planted
    actual = loaded.run(drafts.batch(CASE, STEPS), STEPS)
    expected = drafts.trace("reference", CASE, torch.float32, STEPS)
    comparison = compare_traces(actual, expected, CASE.id)
    assert_names_stage(comparison, "recurrent_hidden", step=1)


class ResidualAfterNormFromStep1(Eagle3Reference):
    """The plant: from step 1 on, layer 0 adds attention to the normed hidden instead of the raw one."""

    def layer(self, i, h, embeds, cos, sin, cache, visible):
        step = len(cache[i][0])   # steps already cached in this layer
        if i == 0 and step >= 1:
            planted = dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, norm_before_residual=True))
            return Eagle3Reference.layer(planted, i, h, embeds, cos, sin, cache, visible)
        return super().layer(i, h, embeds, cos, sin, cache, visible)


def test_residual_after_norm_from_step_1_fails_at_step_1(drafts):
    from conformance.checkpoints import read_weights

    weights = read_weights(drafts.checkpoint(CASE)["speculators"])
    planted = ResidualAfterNormFromStep1(CASE.config, weights, torch.float32)
    expected = drafts.trace("reference", CASE, torch.float32, STEPS)
    actual = Trace("planted", torch.float32, planted.run(drafts.batch(CASE, STEPS), STEPS), [{}] * STEPS,
                   claimed_stages=expected.claimed_stages, num_layers=expected.num_layers)
    comparison = compare_traces(actual, expected, CASE.id)
    assert_names_stage(comparison, "layers.0.residual", step=1)
