"""Faults planted into the real implementations by the self-tests, each set on one loaded model in the test
that uses it and nowhere else."""
from __future__ import annotations

import torch


def honouring_norm_before_residual(self, positions, embeds, hidden_states, forward_batch, residual):
    """SGLang's input-layer forward (llama_eagle3.py:96-116), except that attention is added to the
    normed hidden, as speculators does for the knob (model_definitions.py:80-81)."""
    hidden_states = self.hidden_norm(hidden_states)
    residual = hidden_states   # the plant; SGLang keeps the raw hidden here
    embeds = self.input_layernorm(embeds)
    hidden_states = torch.cat([embeds, hidden_states], dim=-1)
    hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states, forward_batch=forward_batch)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    return self.mlp(hidden_states), residual
