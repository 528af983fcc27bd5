"""Training samples as draft inputs: the JSONL schema, hidden-state dumps, and a tiny target.

A JSONL line is one sample (the columns speculators' preprocessing writes, plus their bookkeeping):
  {"input_ids": [...], "loss_mask": [0/1 ...], "seq_len": L, "n_prompt_tokens": P,
   "n_response_tokens": R, "source": "..."}
with len(input_ids) == len(loss_mask) == seq_len == P + R, and the loss mask 0 on the prompt and 1
on the response. A hidden-state dump is speculators' data-generation layout: `hs_{i}.safetensors`
for line i, holding `hidden_states` [L, A+1, Ht] (the aux layers, then the last) and `token_ids` [L]
(speculators/train/data.py:309-333). Without a dump, a tiny random target (transformers'
LlamaForCausalLM) generates them for tiny drafts; bigger drafts get seeded random aux states.
The draft sees pair t as (aux g_t, token x_{t+1}) (speculators shift_batch, data.py:28-29).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from conformance.checkpoints.formats import CheckpointError
from fixtures.tiny import teacher_forced_ids
from reference.eagle3 import DraftBatch, Eagle3Config

REQUIRED = ("input_ids", "loss_mask", "seq_len", "n_prompt_tokens", "n_response_tokens", "source")
MAX_SEQUENCES = 4          # samples used as one packed conformance batch
MAX_TOKENS = 32            # tokens per sample used (the rest of a long sample adds nothing at step 0)
TINY_TARGET_MAX = 2_000_000   # vocab * target width up to which the tiny target generates aux states


@dataclass(frozen=True)
class Sample:
    line: int                      # 1-based line number in the file
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    n_prompt_tokens: int
    source: str


def _err(path: Path, line: int, field: str, problem: str) -> CheckpointError:
    return CheckpointError(path, f"line {line}", f"{field}: {problem}" if field else problem)


def load_samples(path: Path, vocab_size: int | None = None) -> list[Sample]:
    """Every sample of a JSONL file, validated; the first problem raises a one-line CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "file", "missing")
    text = path.read_text(errors="replace")
    if not text.strip():
        raise CheckpointError(path, "file", "empty file (no samples)")
    samples = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _err(path, n, "", f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise _err(path, n, "", f"expected a JSON object, got {type(row).__name__}")
        missing = [k for k in REQUIRED if k not in row]
        if missing:
            raise _err(path, n, "", f"missing field {missing[0]} (found: {', '.join(row) or 'nothing'})")
        samples.append(_sample(path, n, row, vocab_size))
    return samples


def _int_list(path, n, row, key) -> list[int]:
    value = row[key]
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):   # bools are ints: a 0/1 mask
        raise _err(path, n, key, f"expected a list of integers, got {_short(value)}")
    return [int(v) for v in value]


def _count(path, n, row, key) -> int:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _err(path, n, key, f"expected a non-negative integer, got {_short(value)}")
    return value


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _sample(path: Path, n: int, row: dict, vocab_size: int | None) -> Sample:
    ids = _int_list(path, n, row, "input_ids")
    mask = _int_list(path, n, row, "loss_mask")
    if any(v not in (0, 1) for v in mask):
        raise _err(path, n, "loss_mask", f"expected only 0 and 1, got {next(v for v in mask if v not in (0, 1))}")
    seq_len, p, r = (_count(path, n, row, k) for k in ("seq_len", "n_prompt_tokens", "n_response_tokens"))
    if not isinstance(row["source"], str):
        raise _err(path, n, "source", f"expected a string, got {_short(row['source'])}")
    if len(ids) != seq_len:
        raise _err(path, n, "seq_len", f"{seq_len}, but input_ids has {len(ids)} tokens")
    if len(mask) != seq_len:
        raise _err(path, n, "loss_mask", f"has {len(mask)} entries, but seq_len is {seq_len}")
    if p + r != seq_len:
        raise _err(path, n, "n_response_tokens", f"n_prompt_tokens {p} + n_response_tokens {r} != seq_len {seq_len}")
    if seq_len < 2:
        raise _err(path, n, "seq_len", f"{seq_len}: a sample needs at least 2 tokens (one aux state, one next token)")
    if any(mask[:p]):
        raise _err(path, n, "loss_mask", f"is 1 inside the prompt (index {mask.index(1)} < n_prompt_tokens {p})")
    if not all(mask[p:]):
        raise _err(path, n, "loss_mask", f"does not cover the response: 0 at index {p + mask[p:].index(0)} "
                                         f"(response is {p}..{seq_len - 1})")
    if min(ids) < 0:
        raise _err(path, n, "input_ids", f"negative token id {min(ids)}")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise _err(path, n, "input_ids", f"token id {max(ids)} >= the draft's vocab_size {vocab_size}")
    return Sample(n, tuple(ids), tuple(mask), p, row["source"])


def write_samples(path: Path, samples: list[list[int]], n_prompt: list[int], source: str = "fixture") -> Path:
    """A JSONL file in the schema above (for fixtures and tests)."""
    lines = []
    for ids, p in zip(samples, n_prompt):
        lines.append(json.dumps({"input_ids": ids, "loss_mask": [0] * p + [1] * (len(ids) - p), "seq_len": len(ids),
                                 "n_prompt_tokens": p, "n_response_tokens": len(ids) - p, "source": source}))
    path.write_text("\n".join(lines) + "\n")
    return path


def make_samples(cfg: Eagle3Config, lengths: tuple[int, ...], generator: torch.Generator) -> list[list[int]]:
    return [torch.randint(0, cfg.vocab_size, (n,), generator=generator).tolist() for n in lengths]


# ---------------------------------------------------------------- aux hidden states

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
                        raise CheckpointError(path, f"tensor {key}", f"missing (found: {', '.join(sorted(keys)) or 'nothing'})")
                hs, tokens = f.get_tensor("hidden_states"), f.get_tensor("token_ids")
        except SafetensorError as exc:
            raise CheckpointError(path, "file", f"not a readable safetensors file ({str(exc).splitlines()[0]})") from None
        L = len(sample.input_ids)
        if tuple(hs.shape) != (L, A + 1, Ht):
            raise CheckpointError(path, "tensor hidden_states", f"shape {tuple(hs.shape)}, expected ({L}, {A + 1}, {Ht}): "
                                                                "[seq_len, aux layers + last, target_hidden_size]")
        if tokens.tolist() != list(sample.input_ids):
            raise CheckpointError(path, "tensor token_ids", f"differs from input_ids of line {sample.line}")
        if not bool(torch.isfinite(hs).all()):
            raise CheckpointError(path, "tensor hidden_states", "contains NaN or inf")
        out.append(hs[:-1, :A].flatten(1).to(torch.float64))   # g_0 .. g_{L-2}
    return out


def make_data_batch(cfg: Eagle3Config, samples: list[Sample], aux: list[torch.Tensor], steps: int = 1,
                    teacher_forced: bool = True) -> DraftBatch:
    """A packed batch: sequence s is (g_t, x_{t+1}) for t < L_s - 1, positions from 0 (SGLang's extend)."""
    ids = torch.cat([torch.tensor(s.input_ids[1:]) for s in samples])
    lengths = [len(s.input_ids) - 1 for s in samples]
    positions = torch.cat([torch.arange(n) for n in lengths])
    seq_ids = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
    return DraftBatch(aux=torch.cat(aux), input_ids=ids, positions=positions, seq_ids=seq_ids,
                      next_ids=teacher_forced_ids(ids, steps) if teacher_forced else None)


def first_samples(samples: list[Sample]) -> list[Sample]:
    """The samples a conformance batch uses: the first MAX_SEQUENCES, each cut to MAX_TOKENS + 1 tokens."""
    out = []
    for s in samples[:MAX_SEQUENCES]:
        keep = MAX_TOKENS + 1
        out.append(Sample(s.line, s.input_ids[:keep], s.loss_mask[:keep], min(s.n_prompt_tokens, keep), s.source))
    return out
