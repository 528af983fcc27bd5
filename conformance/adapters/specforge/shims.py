"""The two runtime adjustments the SpecForge adapter makes, both scoped to one forward call.

1. The loss (SpecForge 0.2.0): `OnlineEagle3Model.forward` computes its KL loss with
   `specforge.core.loss.LogSoftmaxLoss`, a Triton kernel (core/loss.py log_softmax_forward_kernel) that
   cannot launch on CPU tensors. `torch_loss` swaps in the plain-torch formula of the same file
   (`_compute_loss`, core/loss.py:15-21) for the forward's module-level name (algorithms/eagle3/model.py:38,
   used at :74). The loss runs after compute_logits and feeds nothing back into the draft (no backward
   is run here), so no recorded stage can depend on it; conformance/draft/test_specforge.py checks that the draft's
   stages are the same with the shim and with the loss replaced by NaN.
2. torch.compile: SpecForge decorates RMSNorm.forward, the rotary forward, apply_rotary_pos_emb
   (llama3_eagle.py:133, 303, 1561) and the target/loss helpers (model.py:487-510) with @torch.compile.
   On CPU a cold Inductor compile takes minutes (170 s measured) for the same source; `eager` runs them
   as plain Python with torch.compiler's own scoped stance, never a process-wide switch. The trace notes
   say so.
"""
from __future__ import annotations

import contextlib

import torch

LOSS_NOTE = ("SpecForge's Triton KL loss (core/loss.py LogSoftmaxLoss) replaced by the plain-torch formula of the "
             "same file (core/loss.py:15-21 _compute_loss); it runs after the logits and feeds nothing back")
EAGER_NOTE = ("SpecForge's @torch.compile'd functions (RMSNorm, rotary, apply_rotary_pos_emb, target/loss helpers) "
              "run eagerly: torch.compiler.set_stance('force_eager') around the call")


class TorchLogSoftmaxLoss(torch.autograd.Function):
    """The value of SpecForge's LogSoftmaxLoss, by the reference formula of core/loss.py:15-21."""

    @staticmethod
    def forward(ctx, logits, target_p, position_mask):
        out_logp = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(position_mask * (target_p * out_logp), 2).mean()


@contextlib.contextmanager
def torch_loss(loss=TorchLogSoftmaxLoss):
    """SpecForge's forward with `loss` for its Triton loss, restored on exit."""
    import specforge.algorithms.eagle3.model as eagle3_model

    original = eagle3_model.LogSoftmaxLoss
    eagle3_model.LogSoftmaxLoss = loss
    try:
        yield
    finally:
        eagle3_model.LogSoftmaxLoss = original


def eager():
    """SpecForge's compiled functions as plain Python for the scope of one call."""
    return torch.compiler.set_stance("force_eager")
