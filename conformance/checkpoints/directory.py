"""A draft checkpoint directory as a whole: open (format, knobs, tensor headers), write, convert.

The user's files are only read: writing or converting into the source directory is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conformance.checkpoints.errors import CheckpointError, ConversionError, load_json
from conformance.checkpoints.formats import config_format, config_json, from_canonical, parse_config, weights_writer
from conformance.checkpoints.knobs import CONFIG_FILE, ParsedConfig
from conformance.checkpoints.weights import WEIGHTS_FILE, TensorInfo, read_weights, save_weights, tensor_index
from reference.eagle3 import Eagle3Config


@dataclass
class DraftCheckpoint:
    """A draft directory as read: its format, what its config says, and its tensors' headers."""

    path: Path
    format: str
    parsed: ParsedConfig
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def config(self) -> Eagle3Config:
        return self.parsed.config(self.path / CONFIG_FILE)


def open_checkpoint(ckpt_dir: Path) -> DraftCheckpoint:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(ckpt_dir, "directory", "does not exist or is not a directory")
    config_path = ckpt_dir / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(ckpt_dir, CONFIG_FILE, "missing: not a draft checkpoint directory")
    raw = load_json(config_path)
    tensors = tensor_index(ckpt_dir)
    fmt = config_format(raw, config_path, [i.stored_name for i in tensors.values()])
    return DraftCheckpoint(ckpt_dir, fmt, parse_config(raw, config_path, fmt), tensors)


def detect_format(ckpt_dir: Path) -> str:
    """The format of a draft directory (raises CheckpointError when it is none)."""
    return open_checkpoint(ckpt_dir).format


def read_config_file(path: Path) -> ParsedConfig:
    """A config.json on its own (no tensors): `midlayer` names cannot be seen, so flat drafts read as sglang."""
    return parse_config(load_json(path), path)


def read_config(ckpt_dir: Path) -> Eagle3Config:
    """The Eagle3Config a draft directory describes (training semantics); problems raise CheckpointError."""
    return open_checkpoint(ckpt_dir).config


def write_draft(cfg: Eagle3Config, weights: dict[str, torch.Tensor], out_dir: Path, fmt: str,
                drop_embed: bool = False) -> Path:
    """Write `out_dir/{config.json, model.safetensors}` in `fmt` (or the weight files `fmt` itself writes, e.g.
    NeMo's shard and index); tensors keep their bytes and dtype.

    `drop_embed` writes what SpecForge's export writes: no embed_tokens (to_sglang.py drops *embed*).
    """
    config = config_json(cfg, fmt)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {from_canonical(k, fmt): v for k, v in sorted(weights.items()) if not (drop_embed and "embed" in k)}
    save_stored(tensors, out_dir, fmt)
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def save_stored(tensors: dict[str, torch.Tensor], out_dir: Path, fmt: str) -> list[Path]:
    """Tensors already under `fmt`'s stored names, written in `fmt`'s file layout."""
    own = weights_writer(fmt)
    return own(tensors, out_dir) if own else [save_weights(tensors, out_dir / WEIGHTS_FILE)]


def convert(src: Path, dst: Path, fmt: str) -> Path:
    """Convert a draft directory into `fmt` (never writes into `src`)."""
    ckpt = open_checkpoint(src)
    if Path(dst).resolve() == Path(src).resolve():
        raise ConversionError("refusing to convert a checkpoint onto itself")
    return write_draft(ckpt.config, read_weights(src), Path(dst), fmt)
