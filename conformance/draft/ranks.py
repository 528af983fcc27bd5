"""Do the tensor-parallel ranks agree? Per rank: its effective weights, the aux states it received, every
stage and its drafted tokens, compared across ranks and with TP 1, and the ranks' gathered forward against
the reference. A disagreement is named by rank, round, step and stage.

The runs come from the default server's `tensor_parallel` capability (one process per rank, its own
distributed code over gloo). What each rank holds:
- replicated weights and stages (fc, norms, the residual stream, logits after the all-gather, drafted
  ids) must be bitwise equal on every rank: one rank that differs there ran a different drafter;
- sharded weights are that rank's block: they must be what SGLang's loader gave it (a rank whose draft
  later took another tensor, e.g. the target's embedding, is named), and the vocabulary-parallel
  embedding, lm_head rows and d2t map gathered over the ranks must equal TP 1's;
- head-sharded stages (q, k, v, attention core) are each rank's heads: gathered in rank order they are
  TP 1's, compared with the reference in the fp32 tolerance (the all-reduce sums partial products in
  another order, so TP 2 is not bitwise TP 1; the drafted tokens must be identical).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.core import stages as S

VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Disagreement:
    rank: int | None      # None: every rank at once (what an all-reduce spreads), named by the check
    round: int | None     # None: a weight (before any round)
    step: int | None
    stage: str            # a stage, or `weight NAME`
    detail: str

    def line(self) -> str:
        where = ", ".join(p for p in (
            "all ranks" if self.rank is None else f"rank {self.rank}",
            None if self.round is None else f"round {self.round}",
            None if self.step is None else f"step {self.step}") if p)
        return f"{where}, stage `{self.stage}`: {self.detail}"


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:12]


def _sharded(stage: str, head_sharded) -> bool:
    return stage.rsplit(".", 1)[-1] in head_sharded


def weight_disagreements(ranks: list, tp1, digest=_digest) -> list[Disagreement]:
    """Each rank's effective weights: as SGLang's loader gave them, replicated ones equal to TP 1's, the
    vocabulary-parallel rows gathered equal to TP 1's."""
    out = []
    for run in ranks:
        for name, w in run.weights.items():
            if digest(w) != run.as_loaded[name]:
                out.append(Disagreement(run.rank, None, None, f"weight {name}",
                                        f"effective {digest(w)}, SGLang's loader gave this rank "
                                        f"{run.as_loaded[name]} (replaced after loading)"))
            elif run.shard_dims[name] is None and digest(w) != digest(tp1.weights[name]):
                out.append(Disagreement(run.rank, None, None, f"weight {name}",
                                        f"replicated, {digest(w)} here, {digest(tp1.weights[name])} at TP 1"))
    for name in VOCAB_PARALLEL:
        full = tp1.weights[name]
        gathered = torch.cat([run.weights[name] for run in ranks])[:full.shape[0]]
        if not torch.equal(gathered, full):
            bad = sorted({next(r.rank for r in ranks if row < sum(x.weights[name].shape[0] for x in ranks
                                                                   if x.rank <= r.rank))
                          for row in (gathered != full).any(-1).nonzero().flatten().tolist()})
            out += [Disagreement(r, None, None, f"weight {name}", "vocabulary-parallel rows gathered over the "
                                 "ranks differ from TP 1's rows") for r in bad]
    return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)


def stage_disagreements(ranks: list, head_sharded) -> list[Disagreement]:
    """Across ranks, per round, step and stage in forward order: the aux states received, every stage
    that is not head-sharded, the drafted tokens; each rank against rank 0."""
    out = []
    first = ranks[0]
    order = S.stage_names(first.rounds[0].trace.num_layers)
    for r, base_round in enumerate(first.rounds):
        for run in ranks[1:]:
            mine = run.rounds[r]
            if not torch.equal(mine.aux, base_round.aux):
                out.append(Disagreement(run.rank, r, 0, "aux states received",
                                        f"{_digest(mine.aux)} here, {_digest(base_round.aux)} on rank {first.rank}"))
            # The first stage of the round where this rank parts from rank 0 (what follows it inherits it).
            differ = [(k, stage) for k, step in enumerate(base_round.trace.steps)
                      for stage in order if stage in step and not _sharded(stage, head_sharded)
                      and not _equal(mine.trace.steps[k][stage], step[stage])]
            if differ:
                k, stage = differ[0]
                a, b = mine.trace.steps[k][stage], base_round.trace.steps[k][stage]
                out.append(Disagreement(run.rank, r, k, stage, f"{_digest(a)} here, {_digest(b)} on rank "
                                        f"{first.rank}; {len(differ) - 1} later stages of the round differ too"))
            if mine.drafted != base_round.drafted:
                out.append(Disagreement(run.rank, r, None, "drafted tokens",
                                        f"{mine.drafted} here, {base_round.drafted} on rank {first.rank}"))
    return out


def drafted_disagreements(ranks: list, tp1) -> list[Disagreement]:
    """The drafted tokens of every round identical to TP 1's (greedy fp32: exact)."""
    return [Disagreement(run.rank, r, None, "drafted tokens", f"{mine.drafted} at TP {run.tp_size}, "
                         f"{theirs.drafted} at TP 1 (context of {len(theirs.context)} tokens)")
            for run in ranks for r, (mine, theirs) in enumerate(zip(run.rounds, tp1.rounds))
            if mine.drafted != theirs.drafted]


def report(ranks: list, tp1, head_sharded, forward) -> list[str]:
    """Every disagreement, weights first, then the ranks against each other, the drafted tokens against
    TP 1 and the gathered forward against the reference (`forward(round) -> Comparison or None`)."""
    lines = [d.line() for d in weight_disagreements(ranks, tp1)]
    lines += [d.line() for d in stage_disagreements(ranks, head_sharded)]
    lines += [d.line() for d in drafted_disagreements(ranks, tp1)]
    for r in range(len(tp1.rounds)):
        cmp = forward(r)
        if cmp is not None and cmp.first_divergence is not None:
            first = cmp.first_divergence
            lines.append(Disagreement(None, r, first.step, first.stage,
                                      f"the ranks' gathered forward leaves the reference ({first.verdict}, max abs "
                                      f"{first.max_abs if first.max_abs is None else f'{first.max_abs:.3e}'})")
                         .line())
    return lines
