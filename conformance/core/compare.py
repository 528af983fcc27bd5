"""The stage-wise comparator: one implementation's Trace against the reference's, step by step.

Stages are walked in forward order (conformance/core/stages.py). A stage the reference lacks (a knob that
is off) is skipped; a stage the implementation does not expose is 'absent' (not compared); a stage
it claims but did not produce is 'missing' and counts as a divergence (e.g. SGLang's fc that did not
run). The first stage out of tolerance is the first divergence; the failure message names the pair,
the case, the step, that stage, the max abs/rel error and where, and a one-line repro.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conformance.core import stages as S
from conformance.core.trace import Trace
from conformance.core.tolerances import Tol, allowed_error, dtype_name, tol_for

OK, DIVERGED, MISSING, ABSENT = "ok", "diverged", "missing", "absent"


@dataclass(frozen=True)
class StageResult:
    step: int
    stage: str
    verdict: str                      # ok | diverged | missing | absent
    max_abs: float | None = None
    max_rel: float | None = None
    abs_index: tuple | None = None    # index (in the compared rows) of the max abs error
    rel_index: tuple | None = None
    mismatched: int = 0
    numel: int = 0
    tol: Tol | None = None
    bound: str = ""                   # how the allowed error was made (conformance/core/tolerances.py)
    allowed: float | None = None      # the allowed error at the max abs error's element
    excess: float | None = None       # the largest error / allowed error, and where
    excess_index: tuple | None = None
    detail: str = ""                  # shape mismatch, excused ties, ...

    @property
    def failed(self) -> bool:
        return self.verdict in (DIVERGED, MISSING)


@dataclass
class Comparison:
    impl: str
    against: str
    case_id: str
    dtype: torch.dtype
    results: list[StageResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # the implementation's Trace.notes: how it ran

    @property
    def pair(self) -> str:
        return f"{self.impl} vs {self.against}"

    @property
    def first_divergence(self) -> StageResult | None:
        return next((r for r in self.results if r.failed), None)

    def table(self) -> str:
        lines = [f"  {'step':>4}  {'stage':<28} {'max_abs':>10} {'max_rel':>10} {'err/allowed':>11}  verdict"]
        first = self.first_divergence
        for r in self.results:
            a = "-" if r.max_abs is None else f"{r.max_abs:.3e}"
            m = "-" if r.max_rel is None else f"{r.max_rel:.3e}"
            x = "-" if r.excess is None else f"{r.excess:.3g}"
            mark = "  <- first divergence" if r is first else ""
            lines.append(f"  {r.step:>4}  {r.stage:<28} {a:>10} {m:>10} {x:>11}  {r.verdict}{mark}")
        return "\n".join(lines)

    def message(self, repro: str) -> str:
        first = self.first_divergence
        dtype = dtype_name(self.dtype)
        if first is None:
            return f"{self.pair} [{self.case_id}, {dtype}]: every compared stage within tolerance"
        matched = sum(1 for r in self.results[: self.results.index(first)] if r.verdict == OK)
        head = (f"{self.pair} [{self.case_id}, {dtype}]: first divergence at step {first.step}, "
                f"stage '{first.stage}' ({first.verdict}; {matched} stages matched before it)")
        if first.verdict == MISSING:
            body = f"  {self.impl} claims stage '{first.stage}' but did not produce it. {first.detail}".rstrip()
        elif first.detail and first.max_abs is None:
            body = f"  {first.detail}"
        elif first.allowed is None:   # an id stage: exact
            body = (f"  max abs error: {first.mismatched}/{first.numel} ids differ, the first at {first.abs_index} "
                    f"(max rel error {first.max_rel:.3e}: the share that differs); ids are exact")
            body += f"; {first.detail}" if first.detail else ""
        else:
            body = (f"  max abs error {first.max_abs:.3e} at {first.abs_index} (allowed there {first.allowed:.3e}), "
                    f"max rel error {first.max_rel:.3e} at {first.rel_index}; error/allowed up to {first.excess:.3g} "
                    f"at {first.excess_index}; {first.mismatched}/{first.numel} elements out of tolerance\n"
                    f"  allowed: {first.bound}")
            if first.detail:
                body += f"\n  {first.detail}"
        return f"{head}\n{body}\n{self.table()}\n  repro: {repro}"


def _index(flat_index: int, shape: torch.Size) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape))


def _ties(stage: str, actual: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Positions whose reference logits cannot order the ids within the logits' allowed error: the top two
    are closer than their two allowed errors; for draft_ids (which index the logits) the drafted id must
    itself be that close to the top."""
    logits, allowed = logits.double(), allowed.double()
    top = logits.topk(2, dim=-1)
    room = allowed.gather(-1, top.indices)
    if stage != "draft_ids":
        return (top.values[..., 0] - top.values[..., 1]) <= room[..., 0] + room[..., 1]
    ids = actual.long()
    valid = (ids >= 0) & (ids < logits.shape[-1])
    ids = ids.where(valid, torch.zeros_like(ids)).unsqueeze(-1)
    gap = top.values[..., 0] - logits.gather(-1, ids)[..., 0]
    return valid & (gap <= room[..., 0] + allowed.gather(-1, ids)[..., 0])


def compare_tensors(step: int, stage: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                    expected_logits: torch.Tensor | None = None, precise: torch.Tensor | None = None, *,
                    same: torch.Tensor | None = None, depth: int = 1,
                    logits_allowed: torch.Tensor | None = None) -> StageResult:
    """Compare one stage: |actual - expected| <= the allowed error of conformance/core/tolerances.py, per element.

    `precise` (the stage from the fp64 reference), `same` (from the reference in `dtype`) and `depth` feed
    the error model. For id stages, `expected_logits` (the reference's) and `logits_allowed` (their allowed
    error) excuse ties the dtype cannot resolve.
    """
    kind = S.stage_kind(stage)
    tol = tol_for(kind, dtype)
    if tuple(actual.shape) != tuple(expected.shape):
        return StageResult(step, stage, DIVERGED, tol=tol,
                           detail=f"shape {tuple(actual.shape)}, but the reference has {tuple(expected.shape)}")
    if kind == "ids":
        wrong = actual.cpu() != expected.cpu()
        detail = ""
        if expected_logits is not None and wrong.any():
            if logits_allowed is None:
                logits_allowed = allowed_error(tol_for("logits", dtype), dtype, expected_logits)[0]
            tie = _ties(stage, actual.cpu(), expected_logits.cpu(), logits_allowed)
            excused = int((wrong & tie).sum())
            wrong &= ~tie
            if excused:
                detail = (f"{excused} mismatch(es) excused: the reference's logits cannot order those ids within "
                          "their allowed error")
        n = int(wrong.sum())
        idx = _index(int(wrong.flatten().nonzero()[0]), wrong.shape) if n else None
        return StageResult(step, stage, DIVERGED if n else OK, max_abs=float(n),
                           max_rel=float(n) / max(wrong.numel(), 1), abs_index=idx, rel_index=idx, mismatched=n,
                           numel=wrong.numel(), tol=tol, detail=detail)
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    allowed, bound = allowed_error(tol, dtype, expected, precise, same, depth)
    diff = (a - e).abs()
    diff = torch.where(torch.isnan(a) | torch.isnan(e), torch.full_like(diff, float("inf")), diff)
    bad = ~(diff <= allowed)   # element-wise; NaN never passes
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / e.abs())
    excess = torch.where(diff == 0, torch.zeros_like(diff), diff / allowed)
    n = int(bad.sum())
    ia, ir, ix = (int(t.flatten().argmax()) for t in (diff, rel, excess))
    return StageResult(step, stage, DIVERGED if n else OK, max_abs=float(diff.flatten()[ia]),
                       max_rel=float(rel.flatten()[ir]), abs_index=_index(ia, diff.shape),
                       rel_index=_index(ir, rel.shape), mismatched=n, numel=diff.numel(), tol=tol, bound=bound,
                       allowed=float(allowed.flatten()[ia]), excess=float(excess.flatten()[ix]),
                       excess_index=_index(ix, excess.shape))


def _rows(trace: Trace | None, step: int, stage: str, rows: torch.Tensor | None) -> torch.Tensor | None:
    got = None if trace is None else trace.get(step, stage)
    return None if got is None else (got[0] if rows is None else got[0][rows])


def compare_traces(actual: Trace, expected: Trace, case_id: str, steps: int | None = None,
                   precise: Trace | None = None, same: Trace | None = None) -> Comparison:
    """Walk every (step, stage) of `expected`'s layers in forward order; a stage `actual` lacks is
    missing when its base name is in `actual.claimed_stages`, else absent.

    `expected` is the reference `actual` is compared against (conformance/core/tolerances.py AGAINST);
    `precise`, the reference in fp64, and `same`, the reference in `actual`'s dtype (default: `expected`
    when it is in that dtype), feed the error model; the depth it needs (stages so far in this step) is
    counted here.
    """
    against = expected.impl if expected.dtype == actual.dtype else f"{expected.impl} ({dtype_name(expected.dtype)})"
    cmp = Comparison(impl=actual.impl, against=against, case_id=case_id, dtype=actual.dtype, notes=list(actual.notes))
    if same is None and expected.dtype == actual.dtype:
        same = expected
    for step in range(steps if steps is not None else len(expected.steps)):
        logits_allowed, depth = None, 0
        for stage in S.stage_names(expected.num_layers):
            ref = expected.get(step, stage)
            if ref is None:
                continue
            kind = S.stage_kind(stage)
            depth += kind != "ids"
            if stage == "logits":   # whether or not `actual` has logits: its ids' ties need them
                logits_allowed = allowed_error(tol_for(kind, actual.dtype), actual.dtype, ref[0],
                                               _rows(precise, step, stage, None), _rows(same, step, stage, None),
                                               depth)[0]
            got = actual.get(step, stage)
            base = stage.rsplit(".", 1)[-1]
            if got is None:
                verdict = MISSING if base in actual.claimed_stages else ABSENT
                cmp.results.append(StageResult(step, stage, verdict))
                continue
            tensor, rows = got
            if rows is not None and rows.numel() == 0:   # it computes none of the reference's rows at this step
                cmp.results.append(StageResult(step, stage, ABSENT))
                continue
            ref_tensor = ref[0] if rows is None else ref[0][rows]
            ref_logits = room = None
            if kind == "ids" and stage != "input_ids":
                ref_logits = _rows(expected, step, "logits", rows)
                room = None if logits_allowed is None else (logits_allowed if rows is None else logits_allowed[rows])
            cmp.results.append(compare_tensors(
                step, stage, tensor, ref_tensor, actual.dtype, ref_logits, _rows(precise, step, stage, rows),
                same=_rows(same, step, stage, rows), depth=depth, logits_allowed=room))
    return cmp
