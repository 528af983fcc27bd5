"""Session-wide store of tiny checkpoints, loaded drafts and traces, shared by every test.

Each case's checkpoint is written once (both formats, same weight bytes), each (implementation,
case, dtype) is loaded once and run once; tests only compare. A checkpoint the implementation's own
loader refuses is remembered as a LoadFailed with a one-line message.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.adapters.base import Trace
from conformance.core.compare import Comparison, compare_traces
from conformance.core.registry import LOAD, known_divergence
from conformance.core.tolerances import DTYPES
from fixtures.cases import DraftCase
from fixtures.checkpoint import write_checkpoints
from fixtures.tiny import make_batch, make_draft_weights
from reference.eagle3 import DraftBatch


class LoadFailed(Exception):
    """The implementation's own loader refused a checkpoint; the message is one line."""


class DraftStore:
    def __init__(self, root: Path, device: str = "cpu"):
        self.root = root
        self.device = device   # where drafts run ("cuda" in the gpu lane); traces come back on the CPU
        self._checkpoints: dict[str, dict[str, Path]] = {}
        self._traces: dict[tuple, Trace | LoadFailed] = {}

    def checkpoint(self, case: DraftCase) -> dict[str, Path]:
        if case.id not in self._checkpoints:
            weights = make_draft_weights(case.config, torch.Generator().manual_seed(case.seed))
            self._checkpoints[case.id] = write_checkpoints(case.config, weights, self.root / case.id)
        return self._checkpoints[case.id]

    def batch(self, case: DraftCase, steps: int = 1, teacher_forced: bool = True) -> DraftBatch:
        batch = make_batch(case.config, case.lengths, torch.Generator().manual_seed(case.seed + 1), steps,
                           positions_from=case.positions_from, teacher_forced=teacher_forced)
        batch.cached_prefix = case.cached_prefix
        return batch

    def trace(self, impl: str, case: DraftCase, dtype: torch.dtype, steps: int = 1, teacher_forced: bool = True) -> Trace:
        """Load `impl` on the case's checkpoint (its own format) and run it; raises LoadFailed."""
        key = (impl, case.id, dtype, steps, teacher_forced)
        if key not in self._traces:
            adapter = ADAPTERS[impl]()
            ckpt = self.checkpoint(case)[adapter.checkpoint_format]
            try:
                loaded = adapter.load(ckpt, dtype, dict(case.sglang_args), device=self.device)
            except Exception as exc:  # the implementation's loader: keep its own words, on one line
                first_line = (str(exc).strip().splitlines() or [""])[0].replace(str(self.root) + "/", "")
                where = ckpt.relative_to(self.root)   # no session temp path: reports stay identical run to run
                self._traces[key] = LoadFailed(f"{impl} could not load {where}: {type(exc).__name__}: {first_line}")
            else:
                self._traces[key] = loaded.run(self.batch(case, steps, teacher_forced), steps).on_cpu()
        result = self._traces[key]
        if isinstance(result, LoadFailed):
            raise result
        return result


# ---------------------------------------------------------------- one conformance check

class KnownDivergenceHit(AssertionError):
    """The registered divergence, at the registered step and stage: what a strict xfail expects."""


def conformance_params(impls, dtype_names, cases, extra_id: str = ""):
    """pytest params impl x dtype x case; a registered divergence makes its param a strict xfail."""
    for impl in impls:
        for dtype_name in dtype_names:
            for case in cases:
                known = known_divergence(impl, case)
                marks = [pytest.mark.xfail(strict=True, raises=KnownDivergenceHit, reason=known.describe())] if known else []
                ids = "-".join(p for p in (impl, dtype_name, extra_id, case.id) if p)
                yield pytest.param(impl, dtype_name, case, id=ids, marks=marks)


def compare_with_reference(drafts: DraftStore, impl: str, case: DraftCase, dtype_name: str, steps: int = 1,
                           teacher_forced: bool = True) -> Comparison:
    """`impl` against the reference in the same dtype (fp64 reference for the noise floor); raises LoadFailed."""
    dtype = DTYPES[dtype_name]
    actual = drafts.trace(impl, case, dtype, steps, teacher_forced)
    expected = drafts.trace("reference", case, dtype, steps, teacher_forced)
    precise = drafts.trace("reference", case, torch.float64, steps, teacher_forced)
    return compare_traces(actual, expected, ADAPTERS[impl].claimed_stages, case.config.num_hidden_layers,
                          case.id, precise=precise)


def assert_conforms(drafts: DraftStore, report, impl: str, case: DraftCase, dtype_name: str, nodeid: str,
                    repro: str, steps: int = 1, teacher_forced: bool = True) -> None:
    """Compare every step and stage, record, and fail with the full message; a registered divergence
    hit exactly (same step and stage) raises KnownDivergenceHit instead."""
    __tracebackhide__ = True
    known = known_divergence(impl, case)
    try:
        comparison = compare_with_reference(drafts, impl, case, dtype_name, steps, teacher_forced)
    except LoadFailed as exc:
        hit = known is not None and known.stage == LOAD
        report.add_load_failure(impl, case.id, dtype_name, nodeid, "known divergence" if hit else "FAIL", str(exc))
        error = KnownDivergenceHit if hit else AssertionError
        raise error(f"{impl} vs reference [{case.id}, {dtype_name}]: first divergence at step 0, stage 'load'\n"
                    f"  {exc}\n  repro: {repro}") from None
    first = comparison.first_divergence
    hit = known is not None and first is not None and (first.step, first.stage) == (known.step, known.stage)
    outcome = "pass" if first is None else ("known divergence" if hit else "FAIL")
    report.add(comparison, nodeid, outcome, known.reason if hit else "")
    if first is None:
        return
    message = comparison.message(repro)
    if hit:
        raise KnownDivergenceHit(f"{message}\n  known: {known.reason}")
    raise AssertionError(message)
