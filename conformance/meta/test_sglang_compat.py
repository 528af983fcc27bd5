"""The SGLang release shims (conformance/adapters/sglang/compat.py): each picks the call the release in
front of it takes. Every shim is run against both shapes of SGLang's function, planted in place of the
installed one, and against the installed release itself; the version matrix (conformance/versions) runs
the whole lane on each release under test."""
from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace

import pytest

from conformance.adapters.sglang import SGLangAdapter, compat

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


def test_forward_context_passes_the_batch_only_to_a_release_that_takes_it(monkeypatch):
    from sglang.srt.model_executor import forward_context as fc

    calls = []

    @contextlib.contextmanager
    def before_0_5_23(ctx):                      # 0.5.20-0.5.22
        calls.append(("ctx only", ctx))
        yield

    @contextlib.contextmanager
    def since_0_5_23(ctx, *, forward_batch=None):
        calls.append(("with batch", ctx, forward_batch))
        yield

    for planted in (before_0_5_23, since_0_5_23):
        monkeypatch.setattr(fc, "forward_context", planted)
        with compat.forward_context("ctx", "batch"):
            pass
    assert calls == [("ctx only", "ctx"), ("with batch", "ctx", "batch")]


def test_forward_context_on_the_installed_release_publishes_the_backend():
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context, get_forward_context

    backend = object()
    batch = SimpleNamespace(moe_num_token_non_padded=None)   # the one field 0.5.23 reads from the batch
    with compat.forward_context(ForwardContext(attn_backend=backend), batch):
        assert get_forward_context().attn_backend is backend
    # What the installed release's signature says decides the branch, not its version string.
    assert compat.takes_forward_batch(forward_context) == (
        "forward_batch" in inspect.signature(forward_context).parameters)


def test_publish_gives_ranks_only_to_a_release_that_has_them(monkeypatch):
    from sglang.srt import runtime_context as rc

    calls = []
    monkeypatch.setattr(rc, "publish", lambda server_args, **kw: calls.append((server_args, kw)))
    if not hasattr(rc, "SpawnRanks"):
        monkeypatch.setattr(rc, "SpawnRanks", lambda world_rank: ("ranks", world_rank), raising=False)
    compat.publish_scheduler("args")                    # 0.5.21-0.5.23: SpawnRanks exists
    monkeypatch.delattr(rc, "SpawnRanks")
    compat.publish_scheduler("args")                    # 0.5.20: no SpawnRanks
    first, second = calls
    assert first[0] == second[0] == "args"
    assert first[1]["role"] == second[1]["role"] == "scheduler"
    assert getattr(first[1]["ranks"], "world_rank", None) == 0 or first[1]["ranks"] == ("ranks", 0)
    assert "ranks" not in second[1]


def test_the_installed_release_is_one_under_test():
    """The lane runs on the releases the adapter claims; another one is the packaging's refusal, not a pass."""
    assert SGLangAdapter.version() in SGLangAdapter.releases


def test_the_tree_kernels_are_dispatched_where_the_release_dispatches_them(monkeypatch):
    from sglang.kernels.ops.speculative import spec_tree

    # On the installed release: the module returned holds the flag and branches on it to the Triton port.
    module = compat.tree_dispatch_module()
    source = inspect.getsource(module)
    assert hasattr(module, "_is_xpu") and "elif _is_xpu:" in source and "verify_tree_greedy_triton(" in source
    # Both shapes, planted: the flag on spec_tree (0.5.23), or not (0.5.20-0.5.22: eagle_utils dispatches).
    monkeypatch.setattr(spec_tree, "_is_xpu", False, raising=False)
    assert compat.tree_dispatch_module() is spec_tree
    monkeypatch.delattr(spec_tree, "_is_xpu")
    assert compat.tree_dispatch_module().__name__ == "sglang.srt.speculative.eagle_utils"


def test_a_flag_the_release_lacks_reads_as_not_given():
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy")
    assert compat.has_server_arg("speculative_draft_window_size")
    assert not compat.has_server_arg("speculative_no_such_flag")
    assert compat.server_arg(args, "speculative_no_such_flag") is None
    assert compat.server_arg(args, "speculative_draft_window_size") == args.speculative_draft_window_size
