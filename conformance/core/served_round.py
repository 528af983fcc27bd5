"""A served engine's draft passes and rounds, cut to one request (the engine lanes' unit of comparison,
conformance/engine/check.py): what an engine's capture is turned into, by the engine lane (SGLang's capture,
conformance/engine/served.py) or by an adapter's engine module that cuts its own (vLLM's, adapters/vllm/engine.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Pass:
    """One draft forward pass, cut to one request: per-row stages (one row per token it computed) and
    per-request stages (the row the worker selected: hidden states and logits of LAST capture)."""

    mode: str
    positions: torch.Tensor                 # [n]
    rows: dict[str, torch.Tensor]           # stage -> [n, ...]
    selected: dict[str, torch.Tensor]       # stage -> [1, ...], at positions[-1]
    batch: int                              # requests in the pass
    width: int                              # rows the pass computed for this request

    def trimmed(self, n: int) -> "Pass":
        """The first n rows (a draft extend after verify computes every verify row; the accepted ones
        count), the n-th being the one the worker selects."""
        rows = {k: v[:n] for k, v in self.rows.items()}
        selected = {k: v[n - 1:n] for k, v in self.rows.items() if k in ("logits", "recurrent_hidden")}
        return Pass(self.mode, self.positions[:n], rows, {**self.selected, **selected}, self.batch, self.width)


@dataclass
class ServedRound:
    extend: list[Pass]                      # step 0: this round's new rows, in order
    decode: list[Pass] = field(default_factory=list)   # steps 1..K-1 (topk rows each for a tree)
    tree: dict[str, torch.Tensor] = field(default_factory=dict)   # draft_tokens, parent_list, top_scores_index
    accepted: int = -1                      # drafts verify accepted (SGLang's accept_lens - 1)
