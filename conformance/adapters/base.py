"""The one small Protocol every implementation is driven through, and the Trace it returns.

An adapter loads a checkpoint directory through the implementation's own loading path and runs the
draft on a packed `DraftBatch` (reference/eagle3.py), returning a Trace: per draft step, the
canonical stages of conformance/core/stages.py. Implementation layouts are mapped inside the adapter.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from reference.eagle3 import DraftBatch, Eagle3Config


@dataclass
class Trace:
    """What one implementation computed, stage by stage, per draft step."""

    impl: str                                   # adapter name
    dtype: torch.dtype                          # the dtype it ran in
    steps: list[dict[str, torch.Tensor]]        # per step: stage -> tensor, rows = packed tokens
    rows: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per step: stage -> packed rows it covers, when not all
    notes: list[str] = field(default_factory=list)  # how the run was set up, for the report

    def get(self, step: int, stage: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(tensor, rows or None for all rows), or None when the stage is absent at that step."""
        if step >= len(self.steps) or stage not in self.steps[step]:
            return None
        rows = self.rows[step].get(stage) if step < len(self.rows) else None
        return self.steps[step][stage], rows

    def on_cpu(self) -> "Trace":
        """The same trace with every tensor on the CPU, where comparisons run (no copies on a CPU run)."""
        def cpu(d):
            return {k: v.cpu() for k, v in d.items()}
        return replace(self, steps=[cpu(s) for s in self.steps], rows=[cpu(r) for r in self.rows])


def batch_on(batch: DraftBatch, device: str | torch.device) -> DraftBatch:
    """The batch with its tensors on `device` (the same object when it is the CPU)."""
    if torch.device(device).type == "cpu":
        return batch
    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)


class LoadedDraft(Protocol):
    """A draft loaded by one implementation, ready to run."""

    def run(self, batch: DraftBatch, steps: int = 1) -> Trace:
        """Trace tensors stay on the device the draft was loaded on (Trace.on_cpu moves them)."""
        ...


class DraftImpl(Protocol):
    """One implementation under test (or the reference)."""

    name: ClassVar[str]                 # "reference" | "speculators" | "sglang"
    checkpoint_format: ClassVar[str]    # which on-disk format it loads: "speculators" | "sglang"
    claimed_stages: ClassVar[frozenset[str]]  # base stage names (without layers.i.) it exposes

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        """Why this implementation cannot even express `cfg`, or None."""
        ...

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> LoadedDraft:
        """Load through the implementation's own path. `server_args` are serving-engine flags
        (SGLang ServerArgs field names); implementations that are not servers ignore them.
        `device`: "cpu" or "cuda", where the weights live and the draft runs."""
        ...
