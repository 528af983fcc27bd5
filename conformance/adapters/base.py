"""The one small Protocol every implementation is driven through, and the Trace it returns.

An adapter loads a checkpoint directory through the implementation's own loading path and runs the
draft on a packed `DraftBatch` (reference/eagle3.py), returning a Trace: per draft step, the
canonical stages of conformance/stages.py. Implementation layouts are mapped inside the adapter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


class LoadedDraft(Protocol):
    """A draft loaded by one implementation, ready to run."""

    def run(self, batch: DraftBatch, steps: int = 1) -> Trace: ...


class DraftImpl(Protocol):
    """One implementation under test (or the reference)."""

    name: ClassVar[str]                 # "reference" | "speculators" | "sglang"
    checkpoint_format: ClassVar[str]    # which on-disk format it loads: "speculators" | "sglang"
    claimed_stages: ClassVar[frozenset[str]]  # base stage names (without layers.i.) it exposes

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        """Why this implementation cannot even express `cfg`, or None."""
        ...

    def load(self, ckpt_dir: Path, dtype: torch.dtype) -> LoadedDraft: ...
