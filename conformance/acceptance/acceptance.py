"""From training accuracy to accept length: speculators' prediction vs simulated speculative decoding.

Predicted: speculators' own metrics on held-out greedy continuations (heldout_metrics: its training
forward, teacher-forced with the data, scored by compute_metrics), per start row and in sum
(1 + sum_{k<K} full_acc_k). Simulated: greedy chain speculative decoding of the same target with the
draft served by each adapter's own drafting loop (loaded.drafter()), verified against the target's
argmax (accept length = accepted drafts + 1 per round). For speculators the two share its forward,
so neither is checked against the other: the drafts of every implementation against the reference's,
token for token, and speculators' per-row scores against the reference's simulation, row by row.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from conformance.acceptance.faults import FAULT_REQUESTS, Fault, plant, served_aux_ids
from conformance.acceptance.stagewise import first_divergence, right_padded, round_rows
from conformance.adapters import ADAPTERS
from conformance.adapters.base import Drafter
from conformance.core.compare import Comparison
from conformance.acceptance.trained_draft import GreedyTarget, TrainedDraft, one_thread
from reference.eagle3 import DraftBatch
from reference.speculative import AcceptStats, accepted_drafts, predicted_accept_length

K_MAX = 5                   # draft steps simulated (every K <= K_MAX comes from the same rounds)
REQUESTS_PER_SEQUENCE = 8   # verify rounds drawn per held-out sequence (64 sequences: 512 rounds)
CHUNK = 16                  # requests per drafter call
REQUEST_SEED = 11

# ---------------------------------------------------------------- predicted: the trainer's own metrics

@dataclass(frozen=True)
class Prediction:
    full_acc: list[float]     # per TTT step k: fraction of starts whose drafts 0..k are all correct
    cond_acc: list[float]     # per step k: fraction correct among starts correct at steps < k
    starts: int               # held-out starts scored at step 0
    # [sequences, rows, steps]: drafts 0..k all correct at start row t, as compute_accuracy_single_step
    # scored it (False where t + k is past the sequence: not scored)
    correct: torch.Tensor
    # The trainer's own logged accept-length estimate over these rows, where it logs one (NeMo's train_tau_sim:
    # 1 + sum_k prefix hits / valid, core.py:200-222); None where it does not (speculators).
    logged_accept_length: float | None = None

    def accept_length(self, K: int) -> float:
        return predicted_accept_length(self.full_acc, K)

    def scored_steps(self, row: int) -> int:
        """How many draft steps training scored at start row `row` (TTT step k scores rows < T - k)."""
        return min(self.correct.shape[2], self.correct.shape[1] - row)

    def accepted(self, seq: int, row: int) -> int:
        """Leading drafts right at (seq, start row), among the steps scored there."""
        return int(self.correct[seq, row, :self.scored_steps(row)].sum())


@one_thread()
def training_prediction(trained: TrainedDraft, steps: int = K_MAX, target: GreedyTarget | None = None) -> Prediction:
    """The trainer's own training forward with its loss and metrics on every held-out sequence, and what its
    metrics scored at each start row: its adapter's `training.heldout_scores` (speculators: one sequence per
    forward, its compute_metrics; NeMo: its Eagle3TrainerModule's prefix counts)."""
    trainer = ADAPTERS[trained.trainer]
    scores = trainer.training.heldout_scores(trainer, trained, target or trained.target(), steps)
    return Prediction(scores["full_acc"], scores["cond_acc"], scores["starts"], scores["correct"],
                      scores.get("tau_sim"))


# ---------------------------------------------------------------- simulated: one verify round per request

@dataclass(frozen=True)
class Request:
    seq: int          # held-out sequence
    prompt_len: int   # the server's prompt: its first prompt_len tokens; the draft starts at row prompt_len - 1

    @property
    def row(self) -> int:
        return self.prompt_len - 1


@dataclass(frozen=True)
class Simulation:
    drafts: torch.Tensor   # [R, K] target ids drafted per round
    stats: AcceptStats     # accepted drafts per round


def make_requests(trained: TrainedDraft, per_sequence: int = REQUESTS_PER_SEQUENCE,
                  seed: int = REQUEST_SEED) -> list[Request]:
    """Prompt lengths drawn uniformly (with replacement) so that the round's start row is uniform over
    the rows 1..eval_tokens that full_acc_0 scores (row 0 reads a prompt token: no round starts there)."""
    r = trained.recipe
    g = torch.Generator().manual_seed(seed)
    lo, hi = r.prompt_tokens, r.prompt_tokens + r.eval_tokens - 1      # start rows 1 .. eval_tokens
    lengths = torch.randint(lo, hi + 1, (trained.heldout_ids.shape[0], per_sequence), generator=g)
    return [Request(s, int(p)) for s in range(lengths.shape[0]) for p in lengths[s]]


def verify(target: GreedyTarget, contexts: list[torch.Tensor], drafts: torch.Tensor, aux_ids: tuple[int, ...],
           K: int) -> torch.Tensor:
    """The target's check of `drafts` after each context: the accepted drafts per request [n]."""
    argmax, _, _ = target.run(right_padded([torch.cat([c, drafts[j]]) for j, c in enumerate(contexts)]), aux_ids)
    # The target's choice after the pending token (position p) and after each draft.
    choice = torch.stack([argmax[j, len(c) - 1:len(c) - 1 + K] for j, c in enumerate(contexts)])
    return accepted_drafts(drafts, choice)


class TargetMemo:
    """The target's side of a store's verify rounds, computed once and shared by every implementation the store
    simulates: its prefill of a chunk's prompts, and its check of drafts it has checked before. The target is a
    function of its input ids alone, so an implementation drafting the reference's tokens gets the verdict the
    reference's round got, and one drafting others gets the target run on its own. Callers get fresh copies."""

    def __init__(self, target: GreedyTarget):
        self.target = target
        self._rows: dict = {}
        self._checks: dict = {}

    def rows(self, prompts: list[torch.Tensor], aux_ids: tuple[int, ...]):
        key = (tuple(tuple(p.tolist()) for p in prompts), aux_ids)
        if key not in self._rows:
            self._rows[key] = round_rows(self.target, prompts, aux_ids)
        contexts, b = self._rows[key]
        return [c.clone() for c in contexts], DraftBatch(aux=b.aux.clone(), input_ids=b.input_ids.clone(),
                                                         positions=b.positions.clone(), seq_ids=b.seq_ids.clone())

    def accepted(self, contexts: list[torch.Tensor], drafts: torch.Tensor, aux_ids: tuple[int, ...], K: int):
        key = (tuple(tuple(c.tolist()) for c in contexts), drafts.numpy().tobytes(), tuple(drafts.shape), aux_ids)
        if key not in self._checks:
            self._checks[key] = verify(self.target, contexts, drafts, aux_ids, K)
        return self._checks[key].clone()


def draft_and_verify(drafter: Drafter, target: GreedyTarget, prompts: list[torch.Tensor],
                     aux_ids: tuple[int, ...], K: int, memo: TargetMemo | None = None):
    """One greedy verify round for each prompt: the target's prefill gives the pending token and the
    draft's rows (stagewise.round_rows), the draft proposes K tokens, the target checks them; through
    `memo` when given (a store's TargetMemo).
    -> (contexts x_0..x_p with the pending token, drafts [n, K], accepted drafts [n])."""
    contexts, batch = round_rows(target, prompts, aux_ids) if memo is None else memo.rows(prompts, aux_ids)
    drafts = drafter(batch, contexts, K)
    accepted = (verify(target, contexts, drafts, aux_ids, K) if memo is None
                else memo.accepted(contexts, drafts, aux_ids, K))
    return contexts, drafts, accepted


@one_thread()
def simulate(drafter: Drafter, trained: TrainedDraft, target: GreedyTarget, requests: list[Request],
             K: int = K_MAX, aux_layer_ids: tuple[int, ...] | None = None,
             memo: TargetMemo | None = None) -> Simulation:
    """One greedy verify round per request (prompt: a held-out prefix of the request's length).

    `aux_layer_ids`: what the serving side captures (default: what the draft was trained on). `memo`: see
    TargetMemo.
    """
    aux_ids = aux_layer_ids or trained.config.aux_layer_ids
    ids = trained.heldout_ids
    drafts, accepted = [], []
    for i in range(0, len(requests), CHUNK):
        prompts = [ids[r.seq, :r.prompt_len] for r in requests[i:i + CHUNK]]
        _, d, a = draft_and_verify(drafter, target, prompts, aux_ids, K, memo)
        drafts.append(d)
        accepted.append(a)
    return Simulation(torch.cat(drafts), AcceptStats(torch.cat(accepted)))


@one_thread()
def generate(drafter: Drafter, trained: TrainedDraft, target: GreedyTarget, sequences: int, new_tokens: int,
             K: int) -> tuple[torch.Tensor, AcceptStats]:
    """Whole generations: greedy chain speculative decoding of `new_tokens` tokens from the first
    `sequences` held-out prompts, round after round (each round commits the accepted drafts and the
    target's bonus token). -> (the generated sequences, every round's accepted drafts).

    Unlike simulate(), where a round starts here depends on how much the previous rounds accepted.
    """
    P = trained.recipe.prompt_tokens
    seqs = [trained.heldout_ids[i, :P] for i in range(sequences)]
    accepted = []
    while active := [i for i in range(sequences) if len(seqs[i]) - P < new_tokens]:
        contexts, drafts, acc = draft_and_verify(drafter, target, [seqs[i] for i in active],
                                                 trained.config.aux_layer_ids, K)
        for j, i in enumerate(active):
            seqs[i] = torch.cat([contexts[j], drafts[j, :acc[j]]])   # the bonus is the next round's pending token
        accepted.append(acc)
    return torch.stack([s[:P + new_tokens] for s in seqs]), AcceptStats(torch.cat(accepted))


# ---------------------------------------------------------------- drafters (each adapter's own: loaded.drafter())

def oracle_drafter(target: GreedyTarget) -> Drafter:
    """vLLM's oracle check: a 'draft' that is the target's own greedy next-token rule, run through the
    same loop; every draft must be accepted (accept length K + 1)."""
    def draft(batch: DraftBatch, contexts: list[torch.Tensor], K: int) -> torch.Tensor:
        seqs = [c.clone() for c in contexts]
        chain = []
        for _ in range(K):
            argmax, _, _ = target.run(right_padded(seqs), (0,))
            nxt = torch.stack([argmax[j, len(s) - 1] for j, s in enumerate(seqs)])
            chain.append(nxt)
            seqs = [torch.cat([s, nxt[j:j + 1]]) for j, s in enumerate(seqs)]
        return torch.stack(chain, dim=1)
    return draft


def grouped(drafter: Drafter, size: int | None) -> Drafter:
    """`drafter` on groups of `size` requests at a time (None: all at once); the adapter says which
    size is fastest (`draft_group`: attention dense over the whole packed batch is quadratic in its rows)."""
    if size is None:
        return drafter

    def draft(batch: DraftBatch, contexts: list[torch.Tensor], K: int) -> torch.Tensor:
        counts = torch.bincount(batch.seq_ids).tolist()
        out, row = [], 0
        for i in range(0, len(counts), size):
            rows = slice(row, row + sum(counts[i:i + size]))
            sub = DraftBatch(aux=batch.aux[rows], input_ids=batch.input_ids[rows],
                             positions=batch.positions[rows], seq_ids=batch.seq_ids[rows] - i)
            out.append(drafter(sub, contexts[i:i + size], K))
            row = rows.stop
        return torch.cat(out)
    return draft


def make_drafter(impl: str, checkpoints: dict[str, Path]) -> Drafter:
    """The draft in `checkpoints` (format -> directory) loaded through `impl`'s own path, in fp32,
    drafting with its own loop."""
    adapter = ADAPTERS[impl]()
    loaded = adapter.load(checkpoints[adapter.checkpoint_format], torch.float32)
    return grouped(loaded.drafter(), adapter.draft_group)


# ---------------------------------------------------------------- one store per session

class AcceptanceStore:
    """The trained draft's prediction, requests and per-implementation runs, each computed once."""

    def __init__(self, trained: TrainedDraft, root: Path):
        self.trained, self.root = trained, root
        self._target: GreedyTarget | None = None
        self._prediction: Prediction | None = None
        self._runs: dict[str, Simulation] = {}
        self._faulty: dict[str, FaultRun] = {}
        self.requests = make_requests(trained)

    @property
    def target(self) -> GreedyTarget:
        if self._target is None:
            self._target = self.trained.target()
        return self._target

    @cached_property
    def memo(self) -> TargetMemo:
        return TargetMemo(self.target)

    @property
    def prediction(self) -> Prediction:
        if self._prediction is None:
            self._prediction = training_prediction(self.trained, target=self.target)
        return self._prediction

    def simulated(self, impl: str) -> Simulation:
        if impl not in self._runs:
            drafter = make_drafter(impl, self.trained.checkpoints)
            self._runs[impl] = simulate(drafter, self.trained, self.target, self.requests, memo=self.memo)
        return self._runs[impl]

    def faulty(self, fault: Fault) -> "FaultRun":
        """The host with and without `fault` over the same first FAULT_REQUESTS rounds, and the first
        divergence from the reference on the probe rows; computed once per fault."""
        if fault.id not in self._faulty:
            planted = plant(fault, self.trained, self.root)
            aux_ids = served_aux_ids(self.trained, fault)
            run = simulate(make_drafter(fault.host, planted), self.trained, self.target,
                           self.requests[:FAULT_REQUESTS], aux_layer_ids=aux_ids, memo=self.memo)
            clean = self.simulated(fault.host)
            correct = Simulation(clean.drafts[:FAULT_REQUESTS], AcceptStats(clean.stats.accepted[:FAULT_REQUESTS]))
            comparison = first_divergence(self.trained, self.target, fault.host, planted, aux_ids,
                                          f"trained_draft:{fault.id}")
            self._faulty[fault.id] = FaultRun(correct, run, comparison, planted, aux_ids)
        return self._faulty[fault.id]


@dataclass(frozen=True)
class FaultRun:
    correct: Simulation          # the host serving the draft as trained (the same rounds)
    faulty: Simulation           # the host serving the planted copy
    comparison: Comparison       # the planted host against the reference on the probe rows
    checkpoints: dict[str, Path]   # the planted copies
    aux_ids: tuple[int, ...]       # what the server captures with the fault
