"""Training samples as draft inputs: the JSONL schema, and the packed batch a draft sees.

A JSONL line is one sample (the columns speculators' preprocessing writes, plus their bookkeeping):
  {"input_ids": [...], "loss_mask": [0/1 ...], "seq_len": L, "n_prompt_tokens": P,
   "n_response_tokens": R, "source": "..."}
with len(input_ids) == len(loss_mask) == seq_len == P + R, and the loss mask 0 on the prompt and 1
on the response. The draft sees pair t as (aux g_t, token x_{t+1}) (speculators shift_batch,
data.py:28-29); the aux states come from conformance/checkpoints/hidden_states.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from conformance.checkpoints.errors import CheckpointError, parse_json, short
from reference.eagle3 import DraftBatch, Eagle3Config

REQUIRED = ("input_ids", "loss_mask", "seq_len", "n_prompt_tokens", "n_response_tokens", "source")
MAX_SEQUENCES = 4          # samples used as one packed conformance batch
MAX_TOKENS = 32            # tokens per sample used (the rest of a long sample adds nothing at step 0)


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
        row = parse_json(line, path, line=n)
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
        raise _err(path, n, key, f"expected a list of integers, got {short(value)}")
    return [int(v) for v in value]


def _count(path, n, row, key) -> int:
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _err(path, n, key, f"expected a non-negative integer, got {short(value)}")
    return value


def _sample(path: Path, n: int, row: dict, vocab_size: int | None) -> Sample:
    ids = _int_list(path, n, row, "input_ids")
    mask = _int_list(path, n, row, "loss_mask")
    if any(v not in (0, 1) for v in mask):
        raise _err(path, n, "loss_mask", f"expected only 0 and 1, got {next(v for v in mask if v not in (0, 1))}")
    seq_len, p, r = (_count(path, n, row, k) for k in ("seq_len", "n_prompt_tokens", "n_response_tokens"))
    if not isinstance(row["source"], str):
        raise _err(path, n, "source", f"expected a string, got {short(row['source'])}")
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


# ---------------------------------------------------------------- the packed batch

def teacher_forced_ids(input_ids: torch.Tensor, steps: int) -> torch.Tensor | None:
    """[T, steps-1]: the ids speculators feeds at steps >= 1, its input_ids shifted left by k and
    0-padded over the whole packed row (core.py:332-338; the shift crosses sequence boundaries)."""
    if steps <= 1:
        return None
    T = input_ids.shape[0]
    return torch.stack([torch.cat([input_ids[k:], input_ids.new_zeros(min(k, T))])[:T] for k in range(1, steps)], dim=1)


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
