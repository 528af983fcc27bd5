"""A loader's `weight_loader` calls observed: the shared piece of SGLang's and vLLM's weight accounting
(conformance/adapters/sglang/weights.py, conformance/adapters/vllm/worker_accounting.py), whose loaders both hand each
checkpoint tensor to the target parameter's `weight_loader` attribute (a shard id for fused ones).

Self-contained (imports nothing): vLLM's worker runs in vLLM's own environment and imports this file by path.
"""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def observed_weight_loaders(params: dict, default_loader, record):
    """Within: every parameter's weight_loader (its own, else `default_loader`) first calls
    record(parameter name, loaded tensor, shard id or None), then loads as before (observation only).
    Restored on exit; an attribute the parameter did not have is removed again."""
    had = {name: "weight_loader" in vars(p) for name, p in params.items()}
    originals = {name: getattr(p, "weight_loader", default_loader) for name, p in params.items()}

    def recording(pname, loader):
        def weight_loader(param, loaded_weight, *args):
            record(pname, loaded_weight, args[0] if args else None)
            return loader(param, loaded_weight, *args)
        return weight_loader

    for name, p in params.items():
        p.weight_loader = recording(name, originals[name])
    try:
        yield
    finally:
        for name, p in params.items():
            if had[name]:
                p.weight_loader = originals[name]
            else:
                del p.weight_loader
