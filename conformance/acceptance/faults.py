"""Planted wiring faults for the acceptance check: each a copy of the trained draft (or of what the
server captures) with one wiring mistake, and where the comparator first sees it.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from conformance.adapters import DEFAULT_SERVER, DEFAULT_TRAINER
from conformance.acceptance.trained_draft import TrainedDraft
from fixtures.checkpoint import edited_copy


def _fc_passes_first_chunk(w: dict) -> None:
    H = w["fc.weight"].shape[0]
    w["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, w["fc.weight"].shape[1] - H)], dim=1)


def _d2t_read_one_off(w: dict) -> None:
    w["d2t"] = torch.roll(w["d2t"], 1)   # draft id i maps to target id i + d2t[i - 1]


def _residual_after_norm(config: dict) -> None:
    config["norm_before_residual"] = True


@dataclass(frozen=True)
class Fault:
    """One wiring mistake planted into a copy of the trained draft (or into what the server captures)."""

    id: str
    summary: str
    host: str                        # the implementation that serves the faulty draft (never the reference:
                                     # the fault-free control compares the host with the reference)
    stage: str                       # the first stage where it must show
    weights: Callable[[dict], None] | None = None   # edits the checkpoint tensors (both formats)
    config: Callable[[dict], None] | None = None    # edits the speculators-format config.json
    served_aux: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None   # trained ids -> captured ids
    # Whether its accept-length drop exceeds the sampling bound at every K over FAULT_REQUESTS rounds.
    # False where this draft cannot show it: the tiny target's layers each add little (layer outputs
    # x 0.25), so its aux states are alike and the draft leans on the token embedding; serving every
    # aux chunk from the embeddings costs it about 0.05 at K = 1 of 512 rounds, within chance. Such a
    # fault is caught by the exact drafts check alone (test_planted_fault_moves_accept_length).
    costs_acceptance: bool = True


FAULTS: tuple[Fault, ...] = (
    Fault("aux_layers_shifted", "the served capture list starts at the embedding output, each chunk the one "
          "before it: (0, 2, 5) for (2, 5, 7), the [embed, layer3, layer31] for [layer3, layer31, layer59] "
          "class (field-evidence.md §0)", DEFAULT_SERVER, "aux_in", served_aux=lambda ids: (0, *ids[:-1]),
          costs_acceptance=False),
    Fault("fc_skipped", "fc passes the first aux chunk through: layer 0 reads a raw target state, as when "
          "SGLang skips fc (models/llama_eagle3.py:238)", DEFAULT_SERVER, "fc_out", weights=_fc_passes_first_chunk),
    # Served by the trainer (speculators), which honours the knob (SGLang has no such path): its residual is a
    # local variable (NOT_OBSERVABLE in its adapter), so the first stage that carries it is post_attn.
    Fault("residual_after_norm", "layer 0 adds attention to the normed hidden (norm_before_residual set; "
          "trained without)", DEFAULT_TRAINER, "layers.0.post_attn", config=_residual_after_norm,
          costs_acceptance=False),
    Fault("d2t_off_by_one", "d2t read one entry off: each draft id maps to its neighbour's target id + 1",
          DEFAULT_SERVER, "target_ids", weights=_d2t_read_one_off),
)
FAULT_REQUESTS = 128   # verify rounds per fault (the first ones of the correct run: a paired comparison)


def plant(fault: Fault, trained: TrainedDraft, root: Path) -> dict[str, Path]:
    """Copies of every checkpoint directory with the fault applied; the trained draft is untouched. The fault
    edits the tensors under their canonical names, stored back under each format's own names and files
    (SpecForge's midlayer.*, NeMo's model.* in its shard + index: fixtures.checkpoint.edited_copy)."""
    out = {}
    for fmt, src in trained.checkpoints.items():
        dst = root / fault.id / fmt
        if fault.weights:
            edited_copy(src, dst, fault.weights)
        else:
            shutil.copytree(src, dst)
        if fault.config and fmt == "speculators":
            raw = json.loads((dst / "config.json").read_text())
            fault.config(raw)
            (dst / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        out[fmt] = dst
    return out


def served_aux_ids(trained: TrainedDraft, fault: Fault | None = None) -> tuple[int, ...]:
    """The target layers the server captures (training convention: input of layer i)."""
    ids = tuple(trained.config.aux_layer_ids)
    return fault.served_aux(ids) if fault and fault.served_aux else ids
