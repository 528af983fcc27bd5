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
from conformance.adapters.base import Trace
from conformance.core.tolerances import Tol, dtype_name, tol_for

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
    floor: float = 0.0                # the stage's noise floor (reference in this dtype vs fp64)
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
        lines = [f"  {'step':>4}  {'stage':<28} {'max_abs':>10} {'max_rel':>10}  verdict"]
        first = self.first_divergence
        for r in self.results:
            a = "-" if r.max_abs is None else f"{r.max_abs:.3e}"
            m = "-" if r.max_rel is None else f"{r.max_rel:.3e}"
            mark = "  <- first divergence" if r is first else ""
            lines.append(f"  {r.step:>4}  {r.stage:<28} {a:>10} {m:>10}  {r.verdict}{mark}")
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
        else:
            body = (f"  max abs error {first.max_abs:.3e} at {first.abs_index}, max rel error {first.max_rel:.3e} "
                    f"at {first.rel_index} (allowed: atol={first.tol.atol:g} + rtol={first.tol.rtol:g}*|ref|"
                    f"{f' + {first.tol.noise:g}*noise floor {first.floor:.3e}' if first.tol.noise else ''}); "
                    f"{first.mismatched}/{first.numel} elements out of tolerance")
            if first.detail:
                body += f"\n  {first.detail}"
        return f"{head}\n{body}\n{self.table()}\n  repro: {repro}"


def _index(flat_index: int, shape: torch.Size) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape))


def compare_tensors(step: int, stage: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                    expected_logits: torch.Tensor | None = None, precise: torch.Tensor | None = None) -> StageResult:
    """Compare one stage.

    `expected_logits` (the reference's) lets id stages excuse unresolvable ties; `precise` (the same
    stage from the fp64 reference) sets the noise floor of low-precision dtypes.
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
            top2 = expected_logits.double().topk(2, dim=-1).values
            tie = (top2[..., 0] - top2[..., 1]) <= 2 * tol_for("logits", dtype).atol
            excused = int((wrong & tie).sum())
            wrong &= ~tie
            if excused:
                detail = f"{excused} mismatch(es) excused: reference top-2 logits within 2*atol(logits)"
        n = int(wrong.sum())
        idx = _index(int(wrong.flatten().nonzero()[0]), wrong.shape) if n else None
        return StageResult(step, stage, DIVERGED if n else OK, max_abs=float(n),
                           max_rel=float(n) / max(wrong.numel(), 1), abs_index=idx, rel_index=idx, mismatched=n,
                           numel=wrong.numel(), tol=tol, detail=detail)
    a, e = actual.detach().cpu().double(), expected.detach().cpu().double()
    floor = 0.0
    if tol.noise and precise is not None and precise.shape == expected.shape:
        floor = float((e - precise.detach().cpu().double()).abs().max())
    # The pass mask is torch's own (|a - e| <= atol + rtol*|e|, NaN never close); the errors below only
    # say how far and where.
    bad = ~torch.isclose(a, e, rtol=tol.rtol, atol=tol.atol + tol.noise * floor)
    diff = (a - e).abs()
    diff = torch.where(torch.isnan(a) | torch.isnan(e), torch.full_like(diff, float("inf")), diff)
    rel = diff / e.abs()
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    n = int(bad.sum())
    ia, ir = int(diff.flatten().argmax()), int(rel.flatten().argmax())
    return StageResult(step, stage, DIVERGED if n else OK, max_abs=float(diff.flatten()[ia]),
                       max_rel=float(rel.flatten()[ir]), abs_index=_index(ia, diff.shape),
                       rel_index=_index(ir, rel.shape), mismatched=n, numel=diff.numel(), tol=tol, floor=floor)


def compare_traces(actual: Trace, expected: Trace, case_id: str, steps: int | None = None,
                   precise: Trace | None = None) -> Comparison:
    """Walk every (step, stage) of `expected`'s layers in forward order; a stage `actual` lacks is
    missing when its base name is in `actual.claimed_stages`, else absent.

    `expected` is the reference in `actual`'s dtype; `precise`, the reference in fp64, gives the
    noise floor for dtypes whose tolerance has a noise term.
    """
    cmp = Comparison(impl=actual.impl, against=expected.impl, case_id=case_id, dtype=actual.dtype,
                     notes=list(actual.notes))
    for step in range(steps if steps is not None else len(expected.steps)):
        for stage in S.stage_names(expected.num_layers):
            ref = expected.get(step, stage)
            if ref is None:
                continue
            got = actual.get(step, stage)
            base = stage.rsplit(".", 1)[-1]
            if got is None:
                verdict = MISSING if base in actual.claimed_stages else ABSENT
                cmp.results.append(StageResult(step, stage, verdict))
                continue
            tensor, rows = got
            ref_tensor = ref[0] if rows is None else ref[0][rows]
            exact = precise.get(step, stage) if precise is not None else None
            exact_tensor = None if exact is None else (exact[0] if rows is None else exact[0][rows])
            ref_logits = None
            if S.stage_kind(stage) == "ids" and stage != "input_ids":
                logits = expected.get(step, "logits")
                ref_logits = None if logits is None else (logits[0] if rows is None else logits[0][rows])
            cmp.results.append(compare_tensors(step, stage, tensor, ref_tensor, actual.dtype, ref_logits, exact_tensor))
    return cmp
