"""Session-wide store of tiny checkpoints, loaded drafts and traces, shared by every test.

Each case's checkpoint is written once (both formats, same weight bytes), each (implementation,
case, dtype) is loaded once and run once; tests only compare. A checkpoint the implementation's own
loader refuses is remembered as a LoadFailed with a one-line message.
"""
from __future__ import annotations

from pathlib import Path

import torch

from conformance.adapters import ADAPTERS
from conformance.adapters.base import Trace
from fixtures.cases import DraftCase
from fixtures.checkpoint import write_checkpoints
from fixtures.tiny import make_batch, make_draft_weights
from reference.eagle3 import DraftBatch


class LoadFailed(Exception):
    """The implementation's own loader refused a checkpoint; the message is one line."""


class DraftStore:
    def __init__(self, root: Path):
        self.root = root
        self._checkpoints: dict[str, dict[str, Path]] = {}
        self._traces: dict[tuple, Trace | LoadFailed] = {}

    def checkpoint(self, case: DraftCase) -> dict[str, Path]:
        if case.id not in self._checkpoints:
            weights = make_draft_weights(case.config, torch.Generator().manual_seed(case.seed))
            self._checkpoints[case.id] = write_checkpoints(case.config, weights, self.root / case.id)
        return self._checkpoints[case.id]

    def batch(self, case: DraftCase, steps: int = 1) -> DraftBatch:
        return make_batch(case.config, case.lengths, torch.Generator().manual_seed(case.seed + 1), steps)

    def trace(self, impl: str, case: DraftCase, dtype: torch.dtype, steps: int = 1) -> Trace:
        """Load `impl` on the case's checkpoint (its own format) and run it; raises LoadFailed."""
        key = (impl, case.id, dtype, steps)
        if key not in self._traces:
            adapter = ADAPTERS[impl]()
            ckpt = self.checkpoint(case)[adapter.checkpoint_format]
            try:
                loaded = adapter.load(ckpt, dtype)
            except Exception as exc:  # the implementation's loader: keep its own words, on one line
                first_line = (str(exc).strip().splitlines() or [""])[0].replace(str(self.root) + "/", "")
                where = ckpt.relative_to(self.root)   # no session temp path: reports stay identical run to run
                self._traces[key] = LoadFailed(f"{impl} could not load {where}: {type(exc).__name__}: {first_line}")
            else:
                self._traces[key] = loaded.run(self.batch(case, steps), steps)
        result = self._traces[key]
        if isinstance(result, LoadFailed):
            raise result
        return result
