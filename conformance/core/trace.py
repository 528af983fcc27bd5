"""What an implementation computed, stage by stage: the one record every check area compares.

Adapters (conformance/adapters/) fill it through their implementation's own code; comparisons
(compare.py) read it. It lives on the ground floor so that nothing above has to know an adapter.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class Trace:
    """What one implementation computed, stage by stage, per draft step."""

    impl: str                                   # adapter name
    dtype: torch.dtype                          # the dtype it ran in
    steps: list[dict[str, torch.Tensor]]        # per step: stage -> tensor, rows = packed tokens
    # per step: stage -> the packed rows it covers, when not all
    rows: list[dict[str, torch.Tensor]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the run was set up, for the report
    # Keyword-only and required: a trace says what it claims and how many layers it has, so no caller
    # of compare_traces has to look them up (a default would silently compare no layer stages).
    claimed_stages: frozenset[str] = field(kw_only=True)  # base stage names (without layers.i.) it exposes
    num_layers: int = field(kw_only=True)                  # decoder layers: the layers.i. stages to walk

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


class Unsupported(ValueError):
    """Raised by a draft's run() when the batch asks for what the implementation cannot express (e.g.
    positions not from 0 in a trainer that numbers every row from 0); the harness skips with its message."""
