"""The reference as an adapter: reads the speculators-format directory (training semantics)."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from conformance import stages
from conformance.adapters.base import Trace
from fixtures.checkpoint import read_speculators_config, read_weights
from reference.eagle3 import DraftBatch, Eagle3Config, Eagle3Reference


class ReferenceAdapter:
    name: ClassVar[str] = "reference"
    checkpoint_format: ClassVar[str] = "speculators"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST)

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        return None

    def load(self, ckpt_dir: Path, dtype: torch.dtype) -> "LoadedReference":
        return LoadedReference(Eagle3Reference(read_speculators_config(ckpt_dir), read_weights(ckpt_dir), dtype))


class LoadedReference:
    def __init__(self, model: Eagle3Reference):
        self.model = model

    def run(self, batch: DraftBatch, steps: int = 1) -> Trace:
        return Trace(impl="reference", dtype=self.model.dtype, steps=self.model.run(batch, steps),
                     rows=[{} for _ in range(steps)])
