"""What the engine's capture recorded (conformance/adapters/sglang/engine_shims.py), per request and round.

A round is what the reference's `draft_and_verify` calls one round: the draft's step 0 over the
request's new rows (the prefill's draft extend, in one pass or in chunks, or the draft extend that
followed the previous verify), its decode passes (steps 1..K-1), the drafted tokens, and what verify
accepted. SGLang's worker interleaves them across calls: a decode call drafts, verifies, and then
runs the draft extend that opens the request's next round.
"""
from __future__ import annotations

import torch

# The served pass and round types live on the core floor, so that an adapter's engine (vLLM's, which cuts its own
# capture into rounds: adapters/vllm/engine.py) builds them without importing this area.
from conformance.core.served_round import Pass, ServedRound

__all__ = ["EXTEND_MODES", "Pass", "ServedRound", "served_rounds"]

EXTEND_MODES = ("EXTEND", "DRAFT_EXTEND_V2")


def _cut(meta: dict, tensors: dict[str, torch.Tensor], topk: int) -> dict[str, Pass]:
    """Split one draft pass into its requests' parts, by the batch's own layout."""
    mode, rids, B = meta["mode"], meta["rids"], meta["batch_size"]
    stages = {k[len("stage:"):]: v for k, v in tensors.items() if k.startswith("stage:")}
    positions = tensors["positions"]
    N = positions.shape[0]
    if mode in EXTEND_MODES:
        lens = tensors["extend_seq_lens"].tolist()
        starts = torch.tensor([0] + lens).cumsum(0).tolist()
        spans = [(starts[i], starts[i + 1]) for i in range(B)]
    else:   # DECODE: topk rows per request (b * topk + r)
        spans = [(i * topk, (i + 1) * topk) for i in range(B)]
    parts = {}
    for i, rid in enumerate(rids):
        a, b = spans[i]
        rows, selected = {}, {}
        for name, value in stages.items():
            if value.shape[0] == N:
                rows[name] = value[a:b]
            if value.shape[0] == B:   # (with one row per request, N == B: both)
                selected[name] = value[i:i + 1]
            if value.shape[0] not in (N, B):
                raise ValueError(f"{mode} pass: stage {name} has {value.shape[0]} rows, "
                                 f"neither {N} tokens nor {B} requests")
        parts[rid] = Pass(mode, positions[a:b], rows, selected, B, b - a)
    return parts


def served_rounds(events: list[tuple[dict, dict]], topk: int) -> dict[str, list[ServedRound]]:
    """rid -> its rounds, in order (a request's last round ends with its last verify)."""
    rounds: dict[str, list[ServedRound]] = {}
    opening: dict[str, list[Pass]] = {}       # step-0 passes of each request's next round
    after_verify: dict[str, Pass] = {}        # the draft extend of the current decode call
    current: dict[str, ServedRound] = {}
    for meta, tensors in events:
        kind, rids = meta["kind"], meta["rids"]
        if kind == "draft pass":
            parts = _cut(meta, tensors, topk)
            for rid, part in parts.items():
                if part.mode == "EXTEND":
                    opening.setdefault(rid, []).append(part)
                elif part.mode == "DRAFT_EXTEND_V2":
                    after_verify[rid] = part
                else:
                    current.setdefault(rid, ServedRound(opening.get(rid, []))).decode.append(part)
        elif kind == "tree":
            for i, rid in enumerate(rids):
                current.setdefault(rid, ServedRound(opening.get(rid, []))).tree = {
                    k: v[i] for k, v in tensors.items()}
        elif kind == "round" and meta["mode"] != "EXTEND":
            accept_lens = tensors["accept_lens"].tolist()
            for i, rid in enumerate(rids):
                r = current.pop(rid, None) or ServedRound(opening.get(rid, []))
                r.accepted = accept_lens[i] - 1
                rounds.setdefault(rid, []).append(r)
                opening[rid] = [after_verify.pop(rid).trimmed(accept_lens[i])] if rid in after_verify else []
    return rounds


def gathered_rounds(per_rank: list[dict[str, list[ServedRound]]], head_sharded: dict[str, int]) -> dict:
    """Rank 0's rounds with every head-sharded stage (base name -> its head dim) gathered over the ranks' captures
    in rank order: under tensor parallelism each rank's draft computes its own heads, together TP 1's."""
    import dataclasses

    def gather(passes: list[list[Pass]]) -> list[Pass]:
        out = []
        for parts in zip(*passes):
            rows = {name: (torch.cat([p.rows[name] for p in parts], dim=head_sharded[name.rsplit(".", 1)[-1]])
                           if name.rsplit(".", 1)[-1] in head_sharded else value)
                    for name, value in parts[0].rows.items()}
            out.append(dataclasses.replace(parts[0], rows=rows))
        return out

    gathered = {}
    for rid, rounds in per_rank[0].items():
        ranks = [rank.get(rid, []) for rank in per_rank]
        gathered[rid] = [dataclasses.replace(r, extend=gather([x[i].extend for x in ranks]),
                                             decode=gather([x[i].decode for x in ranks]))
                         for i, r in enumerate(rounds) if all(len(x) > i for x in ranks)]
    return gathered
