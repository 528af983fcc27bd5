"""The differences between the SGLang releases the suite runs against (SGLangAdapter.releases), each
absorbed in one small shim here, so that the rest of the adapter reads as the pinned release.

Each shim feature-detects the release (a signature, an attribute), never compares version strings,
and names in its docstring the releases it serves and the SGLang file:line it follows (in the pinned
release unless said otherwise). conformance/meta/test_sglang_compat.py runs each against the
installed release and checks that the detection picks the branch that release needs.
"""
from __future__ import annotations

import inspect


def forward_context(ctx, fb):
    """SGLang's per-pass forward context around one forward of `fb`.

    0.5.23: `forward_context(ctx, *, forward_batch=None)` copies the batch's
    moe_num_token_non_padded into the context (model_executor/forward_context.py:85-99); the model
    runner passes the batch (model_runner.py, `forward_context(..., forward_batch=forward_batch)`).
    0.5.20-0.5.22: `forward_context(ctx)` takes the context alone (forward_context.py:78-84 there);
    the context has no MoE field, so nothing else differs for a dense draft or target.
    """
    from sglang.srt.model_executor import forward_context as fc

    if takes_forward_batch(fc.forward_context):
        return fc.forward_context(ctx, forward_batch=fb)
    return fc.forward_context(ctx)


def takes_forward_batch(forward_context_fn) -> bool:
    return "forward_batch" in inspect.signature(forward_context_fn).parameters


def publish_scheduler(server_args) -> None:
    """Publish `server_args` as a scheduler process of rank 0 of a world of one.

    0.5.21-0.5.23: `publish(..., ranks=SpawnRanks(world_rank=0))`: the launcher hands the ranks
    to publish (runtime_context.py:230-242, 1489-1495).
    0.5.20: no SpawnRanks, `publish(server_args, *, role, hf_config=None)` (runtime_context.py:1571
    there); the ranks come from the model-parallel groups initialised afterwards, as in its launcher.
    """
    from sglang.srt import runtime_context as rc

    if hasattr(rc, "SpawnRanks"):
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    else:
        rc.publish(server_args, role="scheduler")
