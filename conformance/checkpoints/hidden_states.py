"""Aux hidden states for a draft's inputs: speculators' hidden-state dumps, or a tiny random target.

A dump is speculators' data-generation layout: `hs_{i}.safetensors` for training-data line i,
holding `hidden_states` [L, A+1, Ht] (the aux layers, then the last) and `token_ids` [L]
(speculators/train/data.py:309-333). Without a dump, a tiny random target (transformers'
LlamaForCausalLM) generates them for tiny drafts; bigger drafts get seeded random aux states.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from conformance.checkpoints.errors import CheckpointError
from conformance.checkpoints.training_data import Sample
from conformance.core.common import first_line
from reference.eagle3 import Eagle3Config

TINY_TARGET_MAX = 2_000_000   # vocab * target width up to which the tiny target generates aux states
# What a dump's tensors may hold: the floats a target computes in, and integer token ids.
DUMP_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DUMP_IDS = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """speculators' default capture layers [2, N//2, N-3], input-of-layer convention (models/utils.py:110-111)."""
    return (2, num_layers // 2, num_layers - 3)


class TinyTarget:
    """A transformers LlamaForCausalLM with seeded random weights, as wide as the draft's target.

    hidden_states(ids) is speculators' datagen layout [L, A+1, Ht]: HF hidden_states[i] (the input of
    layer i, 0 = embeddings) for each aux id, then the last one.
    """

    def __init__(self, cfg: Eagle3Config, generator: torch.Generator):
        from transformers import LlamaConfig, LlamaForCausalLM

        ids = cfg.aux_layer_ids or default_aux_layer_ids(8)
        self.aux_layer_ids = tuple(ids)
        layers = max(8, max(ids) + 1)    # N >= 7 keeps the default list free of collisions (semantics §2.1)
        Ht = cfg.target_hidden_size
        heads = next(h for h in (4, 2, 1) if Ht % h == 0 and (Ht // h) % 2 == 0)
        config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=Ht, intermediate_size=2 * Ht,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                             max_position_embeddings=4096, tie_word_embeddings=False)
        config._attn_implementation = "eager"
        self.model = LlamaForCausalLM(config).eval()
        with torch.no_grad():   # every weight from the explicit generator (HF init uses the global RNG)
            for name, p in self.model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) / max(p.shape[-1], 1) ** 0.5)

    @torch.no_grad()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        hs = out.hidden_states
        return torch.stack([hs[i][0] for i in self.aux_layer_ids] + [hs[-1][0]], dim=1).contiguous()


def uses_tiny_target(cfg: Eagle3Config) -> bool:
    return cfg.vocab_size * cfg.target_hidden_size <= TINY_TARGET_MAX


def write_dump(directory: Path, samples: list[Sample], hidden_states: list[torch.Tensor]) -> Path:
    """speculators' datagen layout: one hs_{i}.safetensors per sample (i = 0-based line index of samples)."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, (sample, hs) in enumerate(zip(samples, hidden_states)):
        save_file({"hidden_states": hs.contiguous(), "token_ids": torch.tensor(sample.input_ids)},
                  str(directory / f"hs_{i}.safetensors"))
    return directory


def read_dump(directory: Path, samples: list[Sample], cfg: Eagle3Config) -> list[torch.Tensor]:
    """The aux states [L-1, A*Ht] of each sample (whole, as in the file) from a hidden-state dump,
    validated one file at a time."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(directory, "directory", "does not exist or is not a directory")
    A, Ht = cfg.num_aux_hidden_states, cfg.target_hidden_size
    out = []
    for i, sample in enumerate(samples):
        path = directory / f"hs_{i}.safetensors"
        if not path.is_file():
            raise CheckpointError(path, "file", f"missing: the hidden states of training-data line {sample.line}")
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                for key in ("hidden_states", "token_ids"):
                    if key not in keys:
                        found = ", ".join(sorted(keys)) or "nothing"
                        raise CheckpointError(path, f"tensor {key}", f"missing (found: {found})")
                hs, tokens = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        except SafetensorError as exc:
            raise CheckpointError(path, "file", f"not a readable safetensors file ({first_line(exc)})") from None
        L = len(sample.input_ids)
        if hs.dtype not in DUMP_FLOATS:
            raise CheckpointError(path, "tensor hidden_states", f"dtype {str(hs.dtype).removeprefix('torch.')}, "
                                                                "expected a float dtype (fp32, bf16, fp16)")
        if tokens.dtype not in DUMP_IDS or tokens.dim() != 1:
            raise CheckpointError(path, "tensor token_ids", f"{str(tokens.dtype).removeprefix('torch.')} of shape "
                                                            f"{tuple(tokens.shape)}, expected integer ids [seq_len]")
        if tuple(hs.shape) != (L, A + 1, Ht):
            raise CheckpointError(path, "tensor hidden_states", f"shape {tuple(hs.shape)}, expected ({L}, {A + 1}, "
                                                                f"{Ht}): "
                                                                "[seq_len, aux layers + last, target_hidden_size]")
        if tokens.tolist() != list(sample.input_ids):
            raise CheckpointError(path, "tensor token_ids", f"differs from input_ids of line {sample.line}")
        if not bool(torch.isfinite(hs).all()):
            raise CheckpointError(path, "tensor hidden_states", "contains NaN or inf")
        out.append(hs[:-1, :A].flatten(1).to(torch.float64))   # g_0 .. g_{L-2}
    return out
