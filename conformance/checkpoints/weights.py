"""Reading and writing a draft's tensors: one safetensors file, an index of shards, or a torch .bin.

Headers are read without loading tensors (`tensor_index`); `read_weights` returns every tensor under
its canonical name (or its stored one), dtype and bytes as stored. Every problem is one line naming
the file and the tensor.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from conformance.checkpoints.errors import CheckpointError, load_json, short
from conformance.checkpoints.schema import to_canonical
from conformance.core.common import first_line

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass
class TensorInfo:
    file: Path
    stored_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def weight_files(ckpt_dir: Path) -> list[Path]:
    """The weight files of a checkpoint directory: one safetensors, an index of shards, or a .bin."""
    single, index, binary = ckpt_dir / WEIGHTS_FILE, ckpt_dir / INDEX_FILE, ckpt_dir / BIN_FILE
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = load_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(index, "field weight_map", "missing or empty")
        for tensor, name in weight_map.items():
            # A shard is a file of this directory, named as transformers' sharding names it.
            if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
                raise CheckpointError(index, f"field weight_map.{tensor}",
                                      f"expected the file name of a shard in {ckpt_dir.name}, got {short(name)}")
        files = [ckpt_dir / name for name in dict.fromkeys(weight_map.values())]
        for path in files:
            if not path.is_file():
                raise CheckpointError(index, "field weight_map", f"names {path.name}, which does not exist")
        return files
    if binary.is_file():
        return [binary]
    raise CheckpointError(ckpt_dir, WEIGHTS_FILE, f"missing (no {WEIGHTS_FILE}, {INDEX_FILE} or {BIN_FILE})")


def tensor_index(ckpt_dir: Path) -> dict[str, TensorInfo]:
    """Canonical name -> where and what each stored tensor is, from file headers only."""
    out: dict[str, TensorInfo] = {}
    for path in weight_files(Path(ckpt_dir)):
        if path.suffix == ".bin":
            infos = {k: (tuple(v.shape), v.dtype) for k, v in _load_bin(path).items()}
        else:
            infos = _safetensors_header(path)
        for stored, (shape, dtype) in infos.items():
            name = to_canonical(stored)
            if name in out:
                raise CheckpointError(path, f"tensor {stored}", f"duplicates {out[name].stored_name} "
                                                                f"(both are {name})")
            out[name] = TensorInfo(path, stored, shape, dtype)
    return out


def _safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if path.stat().st_size == 0:
        raise CheckpointError(path, "file", "empty file")
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise CheckpointError(path, f"tensor {key}", f"unsupported dtype {sl.get_dtype()}")
                out[key] = (tuple(sl.get_shape()), dtype)
            return out
    except SafetensorError as exc:
        raise CheckpointError(path, "file", f"not a readable safetensors file ({first_line(exc)})") from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:   # torch's unpickler: any corruption shows up here
        raise CheckpointError(path, "file", f"not a readable torch checkpoint ({first_line(exc)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(path, "file", "expected a flat dict of tensors")
    return state


def read_tensor(info: TensorInfo) -> torch.Tensor:
    try:
        if info.file.suffix == ".bin":
            return _load_bin(info.file)[info.stored_name]
        with safe_open(str(info.file), framework="pt") as f:
            return f.get_tensor(info.stored_name)
    except SafetensorError as exc:
        raise CheckpointError(info.file, f"tensor {info.stored_name}", f"cannot be read ({first_line(exc)})") from None


def read_weights(ckpt_dir: Path, stored_names: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor under its canonical name (or the name it is stored under), dtype kept."""
    bins: dict[Path, dict] = {}
    out = {}
    for name, info in tensor_index(Path(ckpt_dir)).items():
        key = info.stored_name if stored_names else name
        if info.file.suffix == ".bin":
            bins.setdefault(info.file, _load_bin(info.file))
            out[key] = bins[info.file][info.stored_name]
        else:
            out[key] = read_tensor(info)
    return out


def save_weights(weights: dict[str, torch.Tensor], path: Path) -> Path:
    """One safetensors file; every tensor keeps its dtype and bytes."""
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), metadata={"format": "pt"})
    return path
