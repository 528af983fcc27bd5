"""The reference as an adapter: reads the speculators-format directory (training semantics)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import ClassVar

import torch

from conformance.core import stages
from conformance.adapters.base import Trace, batch_on
from fixtures.checkpoint import read_speculators_config, read_weights
from reference.eagle3 import DraftBatch, Eagle3Config, Eagle3Reference


class ReferenceAdapter:
    name: ClassVar[str] = "reference"
    checkpoint_format: ClassVar[str] = "speculators"
    claimed_stages: ClassVar[frozenset[str]] = frozenset(stages.PRE + stages.LAYER + stages.POST)

    def unsupported(self, cfg: Eagle3Config) -> str | None:
        return None

    def load(self, ckpt_dir: Path, dtype: torch.dtype, server_args: dict | None = None,
             device: str = "cpu") -> "LoadedReference":
        weights = {k: v.to(device) for k, v in read_weights(ckpt_dir).items()}
        return LoadedReference(Eagle3Reference(read_speculators_config(ckpt_dir), weights, dtype), device)


class LoadedReference:
    def __init__(self, model: Eagle3Reference, device: str = "cpu"):
        self.model = model
        self.device = device

    def run(self, batch: DraftBatch, steps: int = 1) -> Trace:
        # The reference creates its masks and RoPE tables with factory functions (torch.eye, arange):
        # torch's default-device context puts them next to the weights without touching its code
        # (not entered on the CPU, where it would only add a dispatch cost to every op).
        on_cpu = torch.device(self.device).type == "cpu"
        with contextlib.nullcontext() if on_cpu else torch.device(self.device):
            trace = self.model.run(batch_on(batch, self.device), steps)
        return Trace(impl="reference", dtype=self.model.dtype, steps=trace, rows=[{} for _ in range(steps)])
