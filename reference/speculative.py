"""Greedy chain speculative decoding (topk = 1): one verify round, and acceptance statistics.

SGLang's definition (eagle3-semantics.md §4.3): a verify round checks the K drafted tokens against
the target's argmax left to right; the accept length is the number of leading drafts that match,
plus the target's own (bonus) token: 1 <= accept length <= K + 1. The prediction from training
metrics is E[accept length] = 1 + sum_{k<K} full_acc_k, full_acc_k being the fraction of starts
whose first k + 1 drafts are all correct (field-evidence.md §4.1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def accepted_drafts(drafts: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """drafts [R, K]; target_argmax [R, K]: the target's argmax after the pending token and after
    each draft. -> [R] the number of leading drafts equal to the target's choice (0..K)."""
    match = (drafts == target_argmax).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1)


def predicted_accept_length(full_acc: list[float], K: int) -> float:
    """1 + sum_{k<K} full_acc_k (chain drafting, greedy; exact in expectation over starts)."""
    if K > len(full_acc):
        raise ValueError(f"K = {K} needs full_acc for {K} steps, have {len(full_acc)}")
    return 1.0 + sum(full_acc[:K])


@dataclass(frozen=True)
class AcceptStats:
    """Accept-length statistics of R verify rounds drafted with K_max steps, for every K <= K_max.

    Chain drafts for K steps are the first K of the K_max-step chain, so one round per request
    gives every K: accepted(K) = min(accepted(K_max), K).
    """

    accepted: torch.Tensor          # [R] leading drafts accepted with K_max drafts

    @property
    def rounds(self) -> int:
        return int(self.accepted.numel())

    def lengths(self, K: int) -> torch.Tensor:
        return 1 + self.accepted.clamp(max=K).to(torch.float64)

    def accept_length(self, K: int) -> float:
        """Accepted drafts + 1 per verify round, averaged over rounds (SGLang's accept length)."""
        return float(self.lengths(K).mean())

    def std(self, K: int) -> float:
        return float(self.lengths(K).std(unbiased=True)) if self.rounds > 1 else 0.0

    def per_position(self, K: int) -> list[dict]:
        """Per draft position j = 1..K: the cumulative rate (drafts 1..j all accepted) and the
        conditional rate (draft j accepted, given drafts < j were)."""
        rows = []
        for j in range(1, K + 1):
            reached = int((self.accepted >= j - 1).sum())
            accepted = int((self.accepted >= j).sum())
            rows.append({"position": j, "cumulative": accepted / self.rounds,
                         "conditional": accepted / reached if reached else float("nan")})
        return rows
