"""Reference EAGLE tree drafting (topk > 1) in exact tree semantics, on the reference draft.

Step 0 is the reference's step 0 over the packed prefix. A tree node at depth d >= 1 embeds its own
token at position last + d, is fed its parent's recurrent hidden (depth 1: the step-0 output at the
sequence's last token) and attends to its sequence's prefix, its ancestors and itself. Each expanded
node proposes its topk children by log-probability; of a depth's children, the topk with the best
cumulative log-probability are expanded. This is EAGLE's tree drafting (SafeAILab/EAGLE,
eagle/model/cnets.py, Model.topK_genrate: `cu_scores = topk_p + scores`, `topk_cs_index // top_k`
picks the parent's hidden, `tree_mask[:, :, out_ids]` carries each parent's ancestors to its child).
"""
from __future__ import annotations

from typing import Callable

import torch

from reference.eagle3 import DraftBatch, Eagle3Reference

# Which earlier tree nodes the rows of the next depth attend to (besides the prefix and themselves), from
# `nodes` [N, earlier + N] (what each row of this depth attended to, then the rows themselves) and `parent`
# [N] (the row of this depth each next row expands).
Attends = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def ancestors(nodes: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """The exact tree (EAGLE's tree mask): a node attends to its parent's ancestors and its parent."""
    return nodes[parent]


@torch.no_grad()
def draft_tree(ref: Eagle3Reference, batch: DraftBatch, steps: int, topk: int, num_draft_tokens: int,
               attends: Attends = ancestors) -> list[dict[str, torch.Tensor]]:
    """One dict per draft step, as Eagle3Reference.run: step 0 the packed prefix, step k >= 1 the
    depth-k nodes in rows b*topk + r (r-th best of sequence b). Each step also holds its rows'
    children: `candidate_ids` [B, n] (target ids; n = topk at step 0, else topk*topk, children of row r
    at r*topk..), `candidate_scores` (cumulative log-probabilities) and `selected` [B, topk] (which
    candidates are expanded, best first). The last step holds the tree handed to verification:
    `tree_index` (the num_draft_tokens - 1 best candidates over all depths, as ids into the
    depth-by-depth concatenation of the candidates, ascending), `tree_tokens`, and `tree_parents`
    (root -1, then the ids of the expanded nodes of depths 1..steps-1: a candidate's parent).
    `attends` is the tree's attention rule; a test replaces it to show what another rule computes.
    """
    cfg = ref.cfg
    if cfg.sliding_window is not None:
        raise NotImplementedError("tree drafting of a sliding-window draft is not in the reference")
    candidates = topk + (steps - 1) * topk * topk
    if not 2 <= num_draft_tokens <= candidates + 1:
        raise ValueError(f"num_draft_tokens must be in 2..{candidates + 1} for topk {topk}, {steps} steps")

    trace = ref.run(batch, 1)
    seq_order = list(dict.fromkeys(batch.seq_ids.tolist()))
    B, N = len(seq_order), len(seq_order) * topk
    last = torch.stack([(batch.seq_ids == s).nonzero().max() for s in seq_order])
    seq_of_key = torch.tensor([seq_order.index(s) for s in batch.seq_ids.tolist()])
    row_seq = torch.arange(B).repeat_interleave(topk)
    prefix_visible = seq_of_key[None, :] == row_seq[:, None]            # [N, T]: the whole prefix, own sequence
    cache = [([trace[0][f"layers.{i}.k_rot"]], [trace[0][f"layers.{i}.v"]]) for i in range(cfg.num_hidden_layers)]
    seen = torch.zeros(N, 0, dtype=torch.bool)                           # earlier tree nodes each row attends to

    # Depth 1: the root's children; all of them are expanded.
    logp, ids = trace[0]["logits"][last].log_softmax(-1).topk(topk, dim=-1)
    tokens = ref.to_target_ids(ids)
    trace[0].update({"candidate_ids": tokens, "candidate_scores": logp,
                     "selected": torch.arange(topk).expand(B, topk)})
    selected, all_ids, all_scores = [], [tokens], [logp]
    scores, tokens = logp.reshape(N), tokens.reshape(N)
    hidden = trace[0]["recurrent_hidden"][last].repeat_interleave(topk, dim=0)
    positions = batch.positions[last].repeat_interleave(topk)
    for depth in range(1, steps):
        visible = torch.cat([prefix_visible, seen, torch.eye(N, dtype=torch.bool)], dim=1)
        out, pass_stages = ref.draft_pass(hidden, tokens, positions + depth, cache, visible)
        stages = {"hidden_in": hidden, **pass_stages}
        logits = stages["logits"]

        # Children: cumulative score of each node's topk children; the topk best are expanded.
        child_logp, child_ids = logits.log_softmax(-1).topk(topk, dim=-1)  # [N, topk]
        cand_scores = (scores[:, None] + child_logp).reshape(B, topk * topk)
        cand_ids = ref.to_target_ids(child_ids).reshape(B, topk * topk)
        best, pick = cand_scores.topk(topk, dim=-1)                         # [B, topk], best first
        stages.update({"candidate_ids": cand_ids, "candidate_scores": cand_scores, "selected": pick})
        trace.append(stages)
        all_ids.append(cand_ids)
        all_scores.append(cand_scores)
        selected.append(pick + topk + topk * topk * (depth - 1))          # ids into the concatenation

        parent = row_seq * topk + torch.div(pick, topk, rounding_mode="floor").reshape(N)   # its parent's row
        scores, tokens, hidden = best.reshape(N), cand_ids.gather(1, pick).reshape(N), out[parent]
        nodes = torch.cat([seen, torch.eye(N, dtype=torch.bool)], dim=1)  # what this depth's rows saw, and themselves
        seen = attends(nodes, parent)

    index = torch.cat(all_scores, dim=1).topk(num_draft_tokens - 1, dim=-1).indices.sort(dim=-1).values
    root_and_depth1 = torch.arange(-1, topk).expand(B, topk + 1)
    trace[-1].update({"tree_index": index, "tree_tokens": torch.cat(all_ids, dim=1).gather(1, index),
                      "tree_parents": torch.cat([root_and_depth1, *selected[:-1]], dim=1)})
    return trace
