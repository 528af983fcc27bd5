"""The one small Protocol every implementation is driven through, and the Trace it returns.

An adapter loads a checkpoint directory through the implementation's own loading path and runs the
draft on a packed `DraftBatch` (reference/eagle3.py), returning a Trace: per draft step, the
canonical stages of conformance/core/stages.py. Implementation layouts are mapped inside the adapter,
and so is everything else the check areas need to know about an implementation (its package, its
timed pass, its weight accounting, its drafting loop): no area branches on an adapter's name.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from importlib import metadata
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Callable, ClassVar, ContextManager, Mapping, Protocol

import torch
from packaging.version import Version

from conformance.core.trace import Trace
from reference.eagle3 import DraftBatch, Eagle3Config

if TYPE_CHECKING:
    from conformance.loading.accounting import Accounting


@dataclass
class ServedBatch(DraftBatch):
    """A DraftBatch as a server is fed it. `cached_prefix`: per sequence, the leading tokens the server
    already holds in its KV cache, so it extends them first and the rest over them (chunked prefill).
    The draft's math is the same either way: the reference and the trainers take it as the DraftBatch it is."""

    cached_prefix: tuple[int, ...] | None = None


def cached_prefix(batch: DraftBatch) -> tuple[int, ...] | None:
    """What a server holds of each sequence before this batch: nothing for a plain DraftBatch."""
    return batch.cached_prefix if isinstance(batch, ServedBatch) else None


def batch_on(batch: DraftBatch, device: str | torch.device) -> DraftBatch:
    """The batch with its tensors on `device` (the same object when it is the CPU)."""
    if torch.device(device).type == "cpu":
        return batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


def installed_version(package: str | None) -> str | None:
    """The installed version of `package`, or None (not installed, or no package: the reference)."""
    if package is None:
        return None
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def supported_range(adapter) -> str:
    """The PEP 440 range of the releases `adapter` is tested against, e.g. ">=0.5.20,<=0.5.23" ("" when it
    has none: the reference). The releases in between that are not listed are not claimed either way."""
    releases = sorted(adapter.releases, key=Version)
    if not releases:
        return ""
    return f"=={releases[0]}" if len(releases) == 1 else f">={releases[0]},<={releases[-1]}"


# ---------------------------------------------------------------- what the areas drive

# The acceptance simulation's drafter: (draft rows of n requests, their token contexts x_0..x_p, K)
# -> [n, K] drafted target ids, each request's greedy chain from its last row.
Drafter = Callable[[DraftBatch, list[torch.Tensor], int], torch.Tensor]


@dataclass(frozen=True)
class TimedPass:
    """What a benchmark times: the bare pass (no stage hooks), ready to call repeatedly."""

    call: Callable[[], object]   # one pass; the caller synchronises the device
    runs: tuple[int, ...]        # the draft steps one call computes: (step,) alone, or (0, ..., step)
    what: str                    # what the call is, for the benchmark's record
    # What the benchmark reads time from: this process's wall clock, or the seconds the call measured where it
    # ran (an adapter whose pass runs in another process: its pipe and files are not the pass).
    clock: Callable[[], float] = time.perf_counter


def last_rows(batch: DraftBatch) -> torch.Tensor:
    """The packed row of each sequence's last token."""
    return torch.bincount(batch.seq_ids).cumsum(0) - 1


def chain_drafter(loaded: "LoadedDraft") -> Drafter:
    """For drafts that draft freely (each step embeds the previous step's d2t-mapped argmax): one
    unrecorded run of K steps, the chain read at each request's last row."""
    def draft(batch: DraftBatch, contexts: list[torch.Tensor], K: int) -> torch.Tensor:
        trace = loaded.run(batch, K, record=False)
        last = last_rows(batch)
        chain = []
        for k in range(K):
            ids, rows = trace.get(k, "target_ids")
            chain.append(ids[last] if rows is None else ids)
        return torch.stack(chain, dim=1)
    return draft


class LoadedDraft(Protocol):
    """A draft loaded by one implementation, ready to run."""

    def run(self, batch: DraftBatch, steps: int = 1, record: bool = True) -> Trace:
        """Every canonical stage it exposes, per step. `record=False`: no stage hooks (nothing cloned);
        the trace then holds at least draft_ids and target_ids. Tensors stay on the device the draft
        was loaded on (Trace.on_cpu moves them)."""
        ...

    def timed_pass(self, batch: DraftBatch, step: int) -> ContextManager[TimedPass]:
        """The scope in which the benchmark times draft step `step` (0: the EXTEND pass or TTT step 0;
        1: SGLang's DECODE pass or TTT step 1) on `batch`, which holds teacher-forced ids for step 1."""
        ...

    def drafter(self) -> Drafter:
        """Its own greedy drafting loop, for the acceptance simulation."""
        ...


class DraftAdapter(Protocol):
    """One implementation under test (or the reference). Registered in conformance/adapters/__init__.py;
    derive AdapterBase, which gives every capability its default."""

    name: ClassVar[str]                       # the adapter name: test ids, the registry, the report
    package: ClassVar[str | None]             # the distribution its version comes from (None: the reference)
    checkpoint_format: ClassVar[str]          # the on-disk checkpoint format it loads (conformance/checkpoints)
    claimed_stages: ClassVar[frozenset[str]]  # base stage names (without layers.i.) it exposes
    draft_group: ClassVar[int | None]         # requests per drafter call in the acceptance simulation
    silent_drop: ClassVar[str | None]         # where its loader skips a tensor it has no parameter for, without a word
                                              # (None: a whole chunk at once)
    serving_decode: ClassVar[bool]            # steps >= 1 query each request's last token only (a serving
                                              # DECODE over the cached keys), not every packed row (a TTT step)
    releases: ClassVar[tuple[str, ...]]       # the releases of `package` the suite is tested against, oldest
                                              # first (the version matrix, README "Releases under test")

    # ------------------------------------------------------------ capabilities (defaults: AdapterBase)
    # Its role: what the areas do with it (a trainer's draft is what a user brings; a server's is what is
    # served). The reference is neither.
    is_server: ClassVar[bool]                 # default False: it serves drafts (the user's --serve-with, the
                                              # support matrix's server columns, the wiring and settings areas)
    is_trainer: ClassVar[bool]                # default False: it trains drafts (the checkpoints users bring)
    default_server: ClassVar[bool]            # default False: the one server a user's draft is checked against
                                              # unless --serve-with says otherwise, and whose own machinery
                                              # (target capture, settings, tree, engine) the areas drive in-process
    lane: ClassVar[str]                       # default "cpu": the pytest lane (marker) its tests run in, or a lane
                                              # of its own (e.g. "vllm": its own environment, `make vllm`)
    runners: ClassVar[tuple[str, ...]]        # default (): a server's model runners that read the draft config
                                              # each their own way, the one a server picks first (vLLM: V2, V1)
    other_formats: ClassVar[tuple[str, ...]]  # default (): checkpoint formats it also serves besides its own
                                              # (conformance/draft/test_served_formats.py)
    # default None: a server whose target boundaries the wiring area reads in this process, from its
    # `target_capture`. Otherwise its own code answers, in its own environment: served_boundaries(draft_dir,
    # target_config, num_layers, runner) -> {"read", "served", "error", "observed", ...} (adapters/vllm/wiring.py).
    served_boundaries: ClassVar[Callable[..., dict] | None]
    # Its machinery the areas drive in this process (default None: it has none here). Modules of its own
    # package, imported without importing the implementation (each imports it lazily).
    target_capture: ClassVar[ModuleType | None]    # its real target classes with EAGLE-3 aux capture: the wiring
                                                   # area and the user's wiring check (adapters/sglang/target.py)
    server_settings: ClassVar[ModuleType | None]   # how it resolves its command-line server settings: the
                                                   # settings area and the user's check (adapters/sglang/settings.py)
    engine: ClassVar[ModuleType | None]            # its serving engine end to end: the engine lane
                                                   # (adapters/sglang/engine.py, its shims engine_shims.py)
    engine_cuda: ClassVar[ModuleType | None]       # the same engine on a CUDA runner (make engine-gpu,
                                                   # adapters/sglang/engine_cuda.py)
    training: ClassVar[ModuleType | None]          # its own training path: the acceptance area trains its tiny
                                                   # draft with it and predicts from its metrics; the module has
                                                   # train_draft(recipe, target, target_dir, train_ids) and
                                                   # heldout_scores(adapter, trained, target, steps)
                                                   # (adapters/speculators/training.py, adapters/nemo/training.py)
    training_capture: ClassVar[ModuleType | None]  # a trainer's own capture of the target's aux states (its
                                                   # target backends): the wiring area runs it on the suite's targets
                                                   # against its convention in wiring/cases.py TRAINERS
                                                   # (adapters/nemo/wiring.py)
    # default None: a trainer's own save path (its recipe's checkpointer): (its config.json as a dict, the tensors
    # under its format's stored names, a run directory) -> the draft directory it wrote there, as its users get
    # it; the example generator writes the trainer's format with it (adapters/nemo/checkpoint.py save_with_nemo)
    save_checkpoint: ClassVar[Callable[..., Path] | None]
    # default empty: a trainer's own helper that prepares the directory its save path wrote for a server, per server
    # adapter name: (that directory) -> the directory the server is given, rewritten in place as the helper does;
    # the example generator runs it (adapters/nemo/checkpoint.py prepare_for_sglang, NeMo's serve_sglang)
    prepare_for_server: ClassVar[Mapping[str, Callable[[Path], Path]]]
    tensor_parallel: ClassVar[ModuleType | None]   # its target and draft sharded over ranks, a process each: the
                                                   # draft area's TP check (adapters/sglang/tensor_parallel.py)
    mla: ClassVar[ModuleType | None]               # its MLA draft class (DeepSeek latent attention): loaded, accounted
                                                   # and run for a user's MLA draft (adapters/sglang/mla.py)
    mla_checks: ClassVar[ModuleType | None]        # its MLA draft's config reading and weight loading, checked where
                                                   # its forward cannot run (adapters/vllm/mla.py, forward_not_run)
    # default empty: (batch, context) shapes of the benchmark whose timed pass does not compile on a CPU host,
    # each with why (left out of the CPU sweep; not the implementation's maths)
    cpu_compile_fails: ClassVar[Mapping[tuple[int, int], str]]

    @classmethod
    def missing(cls) -> str | None:
        """Why this adapter's environment is missing here, so its lane cannot run (one line); default None:
        it runs in the project's environment."""
        ...

    @classmethod
    def version(cls) -> str | None:
        """The installed version of `package` (None when it is not installed)."""
        ...

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        """Why this implementation cannot even express `cfg`, or None (the default)."""
        ...

    def forward_not_run(self, cfg: Eagle3Config) -> str | None:
        """Why a draft of `cfg` is read and accounted for (its `mla_checks`) but never run, or None (the default);
        its `unsupported` then says so too, and the support matrix's cell reads "config + weights checked; forward
        not run: <why>"."""
        ...

    def fc_runs(self, cfg: Eagle3Config) -> bool:
        """Whether fc runs at step 0 for this config (the benchmarks' byte count)."""
        ...

    def dense_attention(self, device: str) -> bool:
        """Whether its attention on `device` builds a dense mask and score matrix over the whole packed
        batch (cost and memory grow with the square of the packed tokens)."""
        ...

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> LoadedDraft:
        """Load through the implementation's own path. `server_args` are serving-engine flags
        (SGLang ServerArgs field names); implementations that are not servers ignore them.
        `device`: "cpu" or "cuda", where the weights live and the draft runs."""
        ...

    def account(self, ckpt_dir: Path, dtype: torch.dtype = torch.float32, target: dict | None = None) -> Accounting:
        """Load `ckpt_dir` and account for every checkpoint tensor (conformance/loading/accounting.py).
        `target`: the target's config (hidden_size, vocab_size), when known."""
        ...


class AdapterBase:
    """Every capability's default, given once (DraftAdapter says what each means). An adapter derives this,
    declares what is its own (name, package, format, stages, releases, ...) and overrides what differs."""

    is_server: ClassVar[bool] = False
    is_trainer: ClassVar[bool] = False
    default_server: ClassVar[bool] = False
    lane: ClassVar[str] = "cpu"   # in-process in the project's environment
    runners: ClassVar[tuple[str, ...]] = ()
    other_formats: ClassVar[tuple[str, ...]] = ()
    served_boundaries: ClassVar[Callable[..., dict] | None] = None
    target_capture: ClassVar[ModuleType | None] = None
    server_settings: ClassVar[ModuleType | None] = None
    engine: ClassVar[ModuleType | None] = None
    engine_cuda: ClassVar[ModuleType | None] = None
    training: ClassVar[ModuleType | None] = None
    training_capture: ClassVar[ModuleType | None] = None
    save_checkpoint: ClassVar[Callable[..., Path] | None] = None
    prepare_for_server: ClassVar[Mapping[str, Callable[[Path], Path]]] = MappingProxyType({})
    tensor_parallel: ClassVar[ModuleType | None] = None
    mla: ClassVar[ModuleType | None] = None
    mla_checks: ClassVar[ModuleType | None] = None
    cpu_compile_fails: ClassVar[Mapping[tuple[int, int], str]] = MappingProxyType({})

    @classmethod
    def missing(cls) -> str | None:
        return None

    @classmethod
    def version(cls) -> str | None:
        return installed_version(cls.package)

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        return None

    def forward_not_run(self, cfg: Eagle3Config) -> str | None:
        return None

    def format_for(self, cfg: Eagle3Config) -> str:
        """The checkpoint format it loads a draft of `cfg` from (its own, unless a class of it needs another)."""
        return self.checkpoint_format
