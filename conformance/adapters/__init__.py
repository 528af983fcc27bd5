"""Registry of the implementations under test: one line per adapter (each imports its implementation
lazily). Everything an area needs to know about an implementation is on its adapter (base.py)."""
import platform
from importlib import metadata
from pathlib import Path

import torch

from conformance.adapters.nemo import NemoAdapter
from conformance.adapters.reference import ReferenceAdapter
from conformance.adapters.sglang import SGLangAdapter
from conformance.adapters.specforge import SpecForgeAdapter
from conformance.adapters.speculators import SpeculatorsAdapter
from conformance.adapters.vllm import VLLMAdapter
from conformance.checkpoints.formats import unwritable
from conformance.core import registry
from conformance.loading.accounting import Accounting

ADAPTERS = {a.name: a for a in (ReferenceAdapter, SpeculatorsAdapter, SGLangAdapter, SpecForgeAdapter, VLLMAdapter,
                                NemoAdapter)}
REFERENCE = ReferenceAdapter.name                                  # what every implementation is compared against
# Every implementation under test, and those of them whose tests run in the default lane (the others run in a
# lane of their own, e.g. `pytest -m vllm`: their adapter's `lane`; loops inside default-lane tests use these).
ALL_IMPLEMENTATIONS = tuple(name for name in ADAPTERS if name != REFERENCE)
IMPLEMENTATIONS = tuple(name for name in ALL_IMPLEMENTATIONS if ADAPTERS[name].lane == "cpu")
# The server a user's draft is checked against by default, whose own machinery (target capture, settings, tree,
# engine) the areas drive in this process; and the trainer whose own training path trains the acceptance
# area's tiny draft. Each is found by its adapter's capability, never by name.
DEFAULT_SERVER = next(name for name, a in ADAPTERS.items() if a.default_server)
# DEFAULT_TRAINER: the first adapter with a training path (ADAPTERS order) trains the draft every area uses; the
# acceptance bridge trains one with each (trained_draft.TRAINERS).
DEFAULT_TRAINER = next(name for name, a in ADAPTERS.items() if a.training is not None)
# The registry's entries hold per implementation and installed version: it learns both from here.
# An engine that runs a build of its own (vLLM's CPU build, in the vLLM engine environment) reads its own version,
# which the registry's engine entries hold against (areas.Area.engine); an in-process engine is its adapter's package.
registry.use_implementations({name: ADAPTERS[name].version for name in ALL_IMPLEMENTATIONS},
                             {name: ADAPTERS[name].engine.version for name in ALL_IMPLEMENTATIONS
                              if getattr(ADAPTERS[name].engine, "version", None) is not None})

def cannot_express(impl: str, cfg) -> str | None:
    """Why `impl` cannot even run a draft of config `cfg` (its adapter's `unsupported`, or no checkpoint of `cfg`
    in the format it loads: conformance/checkpoints/formats `unwritable`), or None. Every skip of a case reads this."""
    adapter = ADAPTERS[impl]()
    return adapter.unsupported(cfg) or unwritable(cfg, adapter.format_for(cfg))


TOOLING = ("transformers", "safetensors", "hypothesis", "pytest")   # besides torch and the implementations


def versions() -> dict[str, str]:
    """Python and the installed version of every package under test, by package name."""
    out = {"python": platform.python_version()}
    for name in ("torch", *(a.package for a in ADAPTERS.values() if a.package), *TOOLING):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    for a in ADAPTERS.values():   # an implementation in an environment of its own (e.g. vLLM) knows its version
        if a.package and out[a.package] == "not installed":
            out[a.package] = a.version() or "not installed"
    for a in ADAPTERS.values():   # an engine that runs a build of its own (vLLM's CPU build): the one that serves
        if (build := getattr(a.engine, "build", None)) and (what := build()):
            out[a.engine.PACKAGE] = what
            if out[a.package] == "not installed":   # the model-level lane's package: only the engine's is here
                del out[a.package]
    return out


def account(impl: str, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
    """Load `ckpt_dir` (in `impl`'s own format) through `impl`'s adapter and account for every tensor
    (each adapter's `account`). `target`: the target's config (hidden_size, vocab_size), when known."""
    return ADAPTERS[impl]().account(Path(ckpt_dir), dtype, target)
