"""The reference side of the engine lane: the same requests, drafted by the reference draft.

Chains: the suite's own greedy simulation, round after round, `draft_and_verify` with the reference
drafter (conformance/acceptance/acceptance.py), each round's reference trace kept for the stage
comparison. Trees: the reference tree (reference/tree.py) on the context SGLang served each round,
verified greedily against the target.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.acceptance.acceptance import draft_and_verify
from conformance.core.trace import Trace
from conformance.acceptance.trained_draft import GreedyTarget, one_thread
from reference.eagle3 import DraftBatch
from reference.tree import Attends, ancestors, draft_tree


@dataclass
class ReferenceRound:
    context: torch.Tensor     # x_0..x_p: the committed tokens and the pending one
    trace: Trace              # the reference draft's K steps over rows t = 0..p-1 (row t: aux g_t, token x_{t+1})
    drafts: torch.Tensor      # [K] drafted target ids (chain), or the tree's tokens
    accepted: int             # drafts the target accepts

    @property
    def last_row(self) -> int:
        return len(self.context) - 2


@one_thread()
def chain_rounds(loaded, target: GreedyTarget, prompt: torch.Tensor, K: int, new_tokens: int,
                 aux_ids: tuple[int, ...]) -> list[ReferenceRound]:
    """Greedy chain speculative decoding of one request with SGLang's stop rule: it stops once its
    committed tokens, the bonus included, reach `new_tokens`."""
    traces: list[Trace] = []

    def drafter(batch: DraftBatch, contexts: list[torch.Tensor], k: int) -> torch.Tensor:
        trace = loaded.run(batch, k)
        traces.append(trace)
        last = batch.input_ids.shape[0] - 1
        return torch.stack([trace.steps[s]["target_ids"][last] for s in range(k)])[None]

    seq, rounds = prompt, []
    while len(seq) - len(prompt) + 1 < new_tokens or not rounds:
        contexts, drafts, accepted = draft_and_verify(drafter, target, [seq], aux_ids, K)
        rounds.append(ReferenceRound(contexts[0], traces[-1], drafts[0], int(accepted[0])))
        seq = torch.cat([contexts[0], drafts[0, :int(accepted[0])]])
    return rounds


def draft_batch(target: GreedyTarget, context: torch.Tensor, aux_ids: tuple[int, ...]) -> DraftBatch:
    """The draft's rows for a context x_0..x_p in the training convention, as draft_and_verify builds them."""
    _, aux, _ = target.run(context[None, :-1], aux_ids)
    p = len(context) - 1
    return DraftBatch(aux=aux[0], input_ids=context[1:], positions=torch.arange(p),
                      seq_ids=torch.zeros(p, dtype=torch.long))


def tree_parent_nodes(index: torch.Tensor, parents: torch.Tensor, topk: int) -> list[int]:
    """Per tree node (candidate index[j]), its parent node, -1 the root: candidate c's parent is the
    expanded candidate parents[c // topk] (SGLang's build_tree and reference/tree.py share this layout)."""
    node_of = {int(c): j for j, c in enumerate(index.tolist())}
    return [node_of.get(int(parents[int(c) // topk]), -2) if int(parents[int(c) // topk]) >= 0 else -1
            for c in index.tolist()]


def tree_accepted(target: GreedyTarget, context: torch.Tensor, tokens: torch.Tensor, parent_nodes: list[int]) -> int:
    """Greedy tree verification: from the root, follow the child whose token is the target's argmax."""
    seq, node, accepted = context, -1, 0
    while True:
        argmax, _, _ = target.run(seq[None], (0,))
        nxt = int(argmax[0, -1])
        child = [j for j, p in enumerate(parent_nodes) if p == node and int(tokens[j]) == nxt]
        if not child:
            return accepted
        node, accepted, seq = child[0], accepted + 1, torch.cat([seq, tokens[child[0]:child[0] + 1]])


@one_thread()
def tree_round(ref, target: GreedyTarget, context: torch.Tensor, aux_ids: tuple[int, ...], steps: int, topk: int,
               num_draft_tokens: int, attends: Attends) -> ReferenceRound:
    """The reference tree (attends: `ancestors` the exact tree; row_slot_kv SGLang's KV columns) drafted on
    `context`, and what greedy verification accepts of it."""
    from conformance.adapters import ADAPTERS, REFERENCE

    trace = draft_tree(ref, draft_batch(target, context, aux_ids), steps, topk, num_draft_tokens, attends)
    last = trace[-1]
    tokens, index, parents = last["tree_tokens"][0], last["tree_index"][0], last["tree_parents"][0]
    accepted = tree_accepted(target, context, tokens, tree_parent_nodes(index, parents, topk))
    name = "reference tree" if attends is ancestors else "reference tree with SGLang's row-slot KV"
    return ReferenceRound(context, Trace(impl=name, dtype=ref.dtype, steps=trace, rows=[{} for _ in trace],
                                         claimed_stages=ADAPTERS[REFERENCE].claimed_stages,
                                         num_layers=ref.cfg.num_hidden_layers), tokens, accepted)


def tree_rounds(ref, target: GreedyTarget, prompt: list[int], greedy: list[int], aux_ids: tuple[int, ...],
                steps: int, topk: int, num_draft_tokens: int, new_tokens: int,
                attends: Attends) -> list[ReferenceRound]:
    """Greedy tree speculative decoding of one request with SGLang's stop rule. Every accepted token is
    the target's greedy token, so round r's context is the prompt and the first tokens of `greedy`."""
    rounds, committed = [], 1     # the prefill commits the first token
    while not rounds or committed < new_tokens:
        context = torch.tensor(prompt + greedy[:committed])
        rounds.append(tree_round(ref, target, context, aux_ids, steps, topk, num_draft_tokens, attends))
        committed += rounds[-1].accepted + 1
    return rounds
