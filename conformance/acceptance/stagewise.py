"""A verify round's draft rows, and where a served draft first parts from the reference on them: the
stage comparison of conformance/core/compare.py, for the acceptance checks' failure messages, the
planted faults and their control.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from conformance.adapters import ADAPTERS, REFERENCE
from conformance.checkpoints.training_data import teacher_forced_ids
from conformance.core.compare import Comparison, compare_traces
from conformance.acceptance.trained_draft import GreedyTarget, TrainedDraft, one_thread
from reference.eagle3 import DraftBatch


def right_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    T = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros(T - len(r))]) for r in rows])


def round_rows(target: GreedyTarget, prompts: list[torch.Tensor],
               aux_ids: tuple[int, ...]) -> tuple[list[torch.Tensor], DraftBatch]:
    """The target's prefill of each prompt x_0..x_{p-1} gives the pending token (its argmax) and the
    draft's input: rows t = 0..p-1 (aux g_t, token x_{t+1}), the last row holding the pending token.
    -> (contexts x_0..x_p, the packed draft batch)."""
    argmax, aux, _ = target.run(right_padded(prompts), aux_ids)
    n = [len(p) for p in prompts]
    pending = torch.stack([argmax[j, n[j] - 1] for j in range(len(prompts))])
    contexts = [torch.cat([p, pending[j:j + 1]]) for j, p in enumerate(prompts)]
    batch = DraftBatch(aux=torch.cat([aux[j, :n[j]] for j in range(len(prompts))]),
                       input_ids=torch.cat([c[1:] for c in contexts]),
                       positions=torch.cat([torch.arange(m) for m in n]),
                       seq_ids=torch.cat([torch.full((m,), j) for j, m in enumerate(n)]))
    return contexts, batch


def probe_batch(trained: TrainedDraft, target: GreedyTarget, aux_ids: tuple[int, ...],
                sequences: int = 3) -> DraftBatch:
    """The first held-out sequences as one packed batch: rows (aux g_t, token x_{t+1})."""
    ids = trained.heldout_ids[:sequences]
    _, aux, _ = target.run(ids, aux_ids)
    T = ids.shape[1] - 1
    return DraftBatch(aux=aux[:, :T].reshape(-1, aux.shape[-1]), input_ids=ids[:, 1:].reshape(-1),
                      positions=torch.arange(T).repeat(ids.shape[0]),
                      seq_ids=torch.arange(ids.shape[0]).repeat_interleave(T))


def round_batch(target: GreedyTarget, prompt: torch.Tensor, aux_ids: tuple[int, ...], chain: torch.Tensor,
                steps: int, serving_decode: bool) -> DraftBatch:
    """One round's rows with steps >= 1 fed the drafted `chain` at the last row, as each kind of
    implementation takes it: a serving DECODE reads next_ids at the last row; a TTT step k embeds
    input_ids[t + k] (speculators core.py:332-338), so the chain is appended as rows after the last
    one (never attended by it: teacher_forced_drafter in conformance/adapters/speculators/adapter.py),
    and the reference reads the same shift (teacher_forced_ids)."""
    _, batch = round_rows(target, [prompt], aux_ids)
    if steps == 1:
        return batch
    fed = chain[:steps - 1]
    if serving_decode:
        next_ids = torch.zeros(batch.input_ids.shape[0], steps - 1, dtype=torch.int64)
        next_ids[-1] = fed
        return replace(batch, next_ids=next_ids)
    n = fed.shape[0]
    ids = torch.cat([batch.input_ids, fed])
    return DraftBatch(aux=torch.cat([batch.aux, batch.aux.new_zeros(n, batch.aux.shape[1])]), input_ids=ids,
                      positions=torch.cat([batch.positions, batch.positions[-1] + 1 + torch.arange(n)]),
                      seq_ids=torch.zeros(ids.shape[0], dtype=torch.int64), next_ids=teacher_forced_ids(ids, steps))


@one_thread()
def compare_on(impl: str, checkpoints: dict[str, Path], batch: DraftBatch, reference_batch: DraftBatch,
               reference_checkpoints: dict[str, Path], steps: int, case_id: str) -> Comparison:
    """`impl` serving `checkpoints` on `batch` against the reference serving `reference_checkpoints` on
    `reference_batch` (fp32, with its fp64 run for the error model). Never the reference against
    itself: a control that compares a thing with itself cannot fail."""
    if impl == REFERENCE:
        raise ValueError("compare_on: the reference against itself compares nothing; name an implementation")
    adapter, reference = ADAPTERS[impl](), ADAPTERS[REFERENCE]()
    actual = adapter.load(checkpoints[adapter.checkpoint_format], torch.float32).run(batch, steps)
    ref_dir = reference_checkpoints[reference.checkpoint_format]
    same = reference.load(ref_dir, torch.float32).run(reference_batch, steps)
    precise = reference.load(ref_dir, torch.float64).run(reference_batch, steps)
    return compare_traces(actual.on_cpu(), same, case_id, precise=precise, same=same)


def first_divergence(trained: TrainedDraft, target: GreedyTarget, impl: str, checkpoints: dict[str, Path],
                     aux_ids: tuple[int, ...], case_id: str) -> Comparison:
    """`impl` serving `checkpoints` (fed `aux_ids`) against the correctly wired reference on the first
    held-out sequences, step 0: the first stage where they part."""
    return compare_on(impl, checkpoints, probe_batch(trained, target, aux_ids),
                      probe_batch(trained, target, tuple(trained.config.aux_layer_ids)), trained.checkpoints, 1,
                      case_id)


def round_divergence(trained: TrainedDraft, target: GreedyTarget, impl: str, checkpoints: dict[str, Path],
                     aux_ids: tuple[int, ...], prompt: torch.Tensor, chain: torch.Tensor, position: int,
                     case_id: str) -> Comparison:
    """The stage comparison of one verify round up to draft step `position` (0-based): `impl` serving
    `checkpoints` fed `aux_ids`, the reference the trained draft as trained, both fed the reference's
    `chain` (equal to `impl`'s before that position)."""
    decode = ADAPTERS[impl].serving_decode
    batch = round_batch(target, prompt, aux_ids, chain, position + 1, decode)
    reference_batch = round_batch(target, prompt, tuple(trained.config.aux_layer_ids), chain, position + 1, decode)
    return compare_on(impl, checkpoints, batch, reference_batch, trained.checkpoints, position + 1, case_id)
