"""Session-wide store of tiny checkpoints, loaded drafts and traces, shared by every test.

Each case's checkpoint is written once (both formats, same weight bytes), each (implementation,
case, dtype) is loaded once and run once; tests only compare. A checkpoint the implementation's own
loader refuses is remembered as a LoadFailed with a one-line message.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import torch

import pytest

from conformance.adapters import ADAPTERS, REFERENCE, cannot_express
from conformance.adapters.base import ServedBatch
from conformance.core.trace import Trace, Unsupported
from conformance.core.compare import Comparison, compare_traces
from conformance.core.common import first_line, remembered
from conformance.core.matching import KnownDivergenceHit  # noqa: F401  (tests import it from here)
from conformance.core.areas import Divergence, Match, Refusal
from conformance.core.matching import judge, known_param, settle
from conformance.core.registry import Known, Neutralised, RegistryError, for_case
from conformance.core.tolerances import AGAINST, DTYPES
from fixtures.cases import DraftCase
from fixtures.checkpoint import edited_copy, write_checkpoints
from fixtures.tiny import make_batch, make_draft_weights
from reference.eagle3 import DraftBatch


class LoadFailed(Exception):
    """The implementation's own loader refused a checkpoint; the message is one line. `error` is the
    exception class the loader raised and `detail` its first line: what a registry load entry matches."""

    def __init__(self, message: str, error: str = "", detail: str = ""):
        super().__init__(message)
        self.error, self.detail = error, detail


class DraftStore:
    # The reference the error model takes as exact (a user's large draft: fp32, conformance/user/plan.py).
    precise: torch.dtype = torch.float64

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

    def directory(self, impl: str, case: DraftCase) -> Path:
        """The directory `impl` loads `case` from: its checkpoint in the implementation's own format."""
        return self.checkpoint(case)[ADAPTERS[impl]().format_for(case.config)]

    def batch(self, case: DraftCase, steps: int = 1, teacher_forced: bool = True) -> DraftBatch:
        batch = make_batch(case.config, case.lengths, torch.Generator().manual_seed(case.seed + 1), steps,
                           positions_from=case.positions_from, teacher_forced=teacher_forced)
        if case.cached_prefix:   # a serving notion: only the servers read it
            batch = ServedBatch(**vars(batch), cached_prefix=case.cached_prefix)
        return batch

    def trace(self, impl: str, case: DraftCase, dtype: torch.dtype, steps: int = 1,
              teacher_forced: bool = True) -> Trace:
        """Load `impl` on the case's checkpoint (its own format) and run it, once per key; raises LoadFailed."""
        key = (impl, case.id, dtype, steps, teacher_forced)
        try:
            return remembered(self._traces, key, lambda: self._run(impl, case, dtype, steps, teacher_forced),
                              (LoadFailed, Unsupported))
        except Unsupported as exc:   # the batch asks for what the implementation cannot express
            pytest.skip(f"{impl} [{case.id}]: {exc}")

    def _run(self, impl: str, case: DraftCase, dtype: torch.dtype, steps: int, teacher_forced: bool) -> Trace:
        adapter = ADAPTERS[impl]()
        ckpt = self.directory(impl, case)
        try:
            loaded = adapter.load(ckpt, dtype, dict(case.sglang_args), device=self.device)
        except Exception as exc:  # the implementation's loader: keep its own words, on one line
            line = first_line(exc).replace(str(self.root) + "/", "")
            where = ckpt.relative_to(self.root)   # no session temp path: reports stay identical run to run
            error = type(exc).__name__
            raise LoadFailed(f"{impl} could not load {where}: {error}: {line}", error, line) from None
        return loaded.run(self.batch(case, steps, teacher_forced), steps).on_cpu()


# ---------------------------------------------------------------- one conformance check

def conformance_params(impls, dtype_names, cases, extra_id: str = "", steps: int | None = None):
    """pytest params impl x dtype x case; a registered load failure or divergence makes its param a strict
    xfail, unless it is registered at a step beyond the `steps` the test compares; a case the
    implementation cannot express (its adapter's `unsupported`, or no checkpoint of it in the format the
    implementation loads) is a skip with the adapter's or the format's reason."""
    for impl in impls:
        for dtype_name in dtype_names:
            for case in cases:
                ids = "-".join(p for p in (impl, dtype_name, extra_id, case.id) if p)
                why = cannot_express(impl, case.config)
                if why:   # the implementation cannot even express the case: a skip naming why
                    yield pytest.param(impl, dtype_name, case, id=ids, marks=pytest.mark.skip(reason=why))
                else:
                    yield known_param(impl, dtype_name, case, id=ids, known=for_case(impl, case, steps))


def compare_with_reference(drafts: DraftStore, impl: str, case: DraftCase, dtype_name: str, steps: int = 1,
                           teacher_forced: bool = True) -> Comparison:
    """`impl` against the reference in the dtype tolerances.AGAINST names for it (bf16: the store's precise
    reference, fp64), with the precise reference and the reference in `impl`'s dtype for the error model;
    raises LoadFailed."""
    dtype = DTYPES[dtype_name]
    actual = drafts.trace(impl, case, dtype, steps, teacher_forced)
    same = drafts.trace(REFERENCE, case, dtype, steps, teacher_forced)
    precise = drafts.trace(REFERENCE, case, drafts.precise, steps, teacher_forced)
    expected = precise if AGAINST[dtype] == torch.float64 else same
    return compare_traces(actual, expected, case.id, precise=precise, same=same)


@dataclass
class ForwardCheck:
    """One forward check, observed and judged: what the built-in matrix settles and the user's verdict reads."""

    known: tuple[Known, ...]             # the load and draft entries that apply
    comparison: Comparison | None        # None: the loader refused (failure)
    failure: LoadFailed | None
    match: Match                         # the entries the observation is exactly, and what none explains
    message: str                         # the full failure message with its repro line ("" when it conforms)

    @property
    def conforms(self) -> bool:
        return self.failure is None and self.comparison.first_divergence is None


def check_forward(drafts: DraftStore, impl: str, case: DraftCase, dtype_name: str, repro: str, steps: int = 1,
                  teacher_forced: bool = True) -> ForwardCheck:
    """The one runner of a forward check, for the built-in matrix and the user's draft alike: compare every
    step and stage against the reference and judge the observation (a refusal, or the first divergence)
    against the registry."""
    known = for_case(impl, case, steps)
    try:
        comparison = compare_with_reference(drafts, impl, case, dtype_name, steps, teacher_forced)
    except LoadFailed as exc:
        return ForwardCheck(known, None, exc, judge("load", known, Refusal(exc.error, exc.detail)),
                            f"{impl} vs reference [{case.id}, {dtype_name}]: first divergence at step 0, stage 'load'"
                            f"\n  {exc}\n  repro: {repro}")
    first = comparison.first_divergence
    match = judge("draft", known, Divergence(first, case.config.num_hidden_layers))
    return ForwardCheck(known, comparison, None, match, "" if first is None else comparison.message(repro))


def assert_conforms(drafts: DraftStore, report, impl: str, case: DraftCase, dtype_name: str, nodeid: str,
                    repro: str, steps: int = 1, teacher_forced: bool = True) -> None:
    """Compare every step and stage, record, and fail with the full message. KnownDivergenceHit instead
    only when the observation is exactly a registered one: a load refusal with the entry's exception
    class and message pattern, or the deciding entry's first divergent step and stage."""
    __tracebackhide__ = True
    check = check_forward(drafts, impl, case, dtype_name, repro, steps, teacher_forced)
    hit = check.match.hits[0] if check.match.hits else None
    if check.failure is not None:
        report.add_load_failure(impl, case.id, dtype_name, nodeid, "known divergence" if hit else "FAIL",
                                str(check.failure), hit.id if hit else "")
        settle(check.message, hit)
    outcome = "pass" if check.conforms else ("known divergence" if hit else "FAIL")
    report.add(check.comparison, nodeid, outcome, hit.reason if hit else "", hit.id if hit else "")
    if not check.conforms:
        settle(check.message, hit)


class NeutralStore(DraftStore):
    """A DraftStore whose checkpoints of a neutralised case have its `neutral_weights` tensors set to ones, in
    every format: the same draft for every implementation and the reference."""

    def __init__(self, root: Path, device: str = "cpu"):
        super().__init__(root, device)
        self.unit_weights: dict[str, tuple[str, ...]] = {}

    def use(self, variant: Neutralised) -> DraftCase:
        self.unit_weights[variant.case.id] = variant.unit_weights
        return variant.case

    def checkpoint(self, case: DraftCase) -> dict[str, Path]:
        paths, patterns = super().checkpoint(case), self.unit_weights.get(case.id)
        if not patterns:
            return paths
        out = {}
        for fmt, path in paths.items():
            out[fmt] = self.root / f"{case.id}-unit-weights" / fmt
            if not out[fmt].exists():
                edited_copy(path, out[fmt], functools.partial(set_ones, patterns=patterns, where=f"{case.id} ({fmt})"))
        return out


def set_ones(weights: dict, patterns: tuple[str, ...], where: str) -> None:
    for pattern in patterns:
        names = [n for n in weights if re.search(pattern, n)]
        if not names:
            raise RegistryError(f"neutral_weights /{pattern}/ names no tensor of the checkpoint of {where}")
        weights.update({n: torch.ones_like(weights[n]) for n in names})
