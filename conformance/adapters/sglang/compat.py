"""The differences between the SGLang releases the suite runs against (SGLangAdapter.releases), each
absorbed in one small shim here, so that the rest of the adapter reads as the pinned release.

Each shim feature-detects the release (a signature, an attribute), never compares version strings,
and names in its docstring the releases it serves and the SGLang file:line it follows (in the pinned
release unless said otherwise). conformance/meta/test_sglang_compat.py runs each against the
installed release and checks that the detection picks the branch that release needs.
"""
from __future__ import annotations

import argparse
import functools
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
    0.5.20: no SpawnRanks; `publish(server_args, *, role, hf_config=None)` takes no ranks
    (runtime_context.py:1571 there): a world of one needs nothing more.
    """
    from sglang.srt import runtime_context as rc

    if hasattr(rc, "SpawnRanks"):
        rc.publish(server_args, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
    else:
        rc.publish(server_args, role="scheduler")


def server_arg(server_args, name: str):
    """A ServerArgs field, or None where the release has no such flag (nobody can have asked for it).

    0.5.21-0.5.23: every field the settings check shows exists.
    0.5.20: no `speculative_draft_sink_size` (--speculative-draft-sink-size is new in 0.5.21,
    arg_groups/speculative_hook.py:185 there); its parser refuses the flag, so it is never given.
    """
    return getattr(server_args, name, None)


@functools.cache
def has_server_arg(name: str) -> bool:
    """Whether the installed release's server command line has the flag of ServerArgs field `name`
    (its own parser, ServerArgs.add_cli_args, decides; see server_arg)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return any(action.dest == name for action in parser._actions)


def tree_dispatch_module():
    """The module whose `_is_xpu` flag picks SGLang's Triton tree-build and greedy-verify kernels (the
    engine lane's shim, engine_shims.apply_shims).

    0.5.23: the dispatch sits next to the kernels, kernels/ops/speculative/spec_tree.py:28, 396, 537.
    0.5.20-0.5.22: spec_tree.py holds the kernels only; sglang/srt/speculative/eagle_utils.py dispatches
    (`_is_xpu` at :47 in 0.5.20-0.5.21, :50 in 0.5.22; its tree-build branch at :240 / :244 / :247 and
    greedy-verify branch at :431 / :438 / :441 in 0.5.20 / 0.5.21 / 0.5.22). There the flag also selects
    greedy verification, which a CPU host selects anyway (eagle_utils.py:784 in 0.5.20, :814 in 0.5.21).
    """
    from sglang.kernels.ops.speculative import spec_tree

    if hasattr(spec_tree, "_is_xpu"):
        return spec_tree
    from sglang.srt.speculative import eagle_utils

    return eagle_utils
