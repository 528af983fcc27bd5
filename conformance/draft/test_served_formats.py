"""The same draft in another config format a server also reads (its adapter's `other_formats`): step 0
against the reference, as test_step0.py runs it in the adapter's own format, on the same weights.

A draft moves between trainers and servers in either format, and a server's readers of the two differ. What
a server reads differently in a format is the registry's `reading` entries for that format (conformance/core/
registry.toml), each with the exact place its comparison shows it (step and stage, or the loader's exception
and message); the param is a strict xfail that only counts at that place. These run in the server's own lane
when it has one (vLLM: make vllm).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS, cannot_express
from conformance.checkpoints.formats import unwritable
from conformance.core.common import first_line
from conformance.core.compare import compare_traces
from conformance.core.matching import known_param, match_forward, match_load, settle
from conformance.core.registry import Known, applicable, case_names
from fixtures.cases import STEP0_CASES

pytestmark = pytest.mark.cpu


def known_for(impl: str, fmt: str, case) -> tuple[Known, ...]:
    """The registered readings of `impl` in this format that apply to the case, as the forward or load
    behaviour its comparison shows (a file the suite writes states every key: nothing absent or overruled)."""
    names = {**case_names(case), "format": fmt, "absent": (), "overruled": ()}
    return tuple(dataclasses.replace(e, area="load" if e.error else "draft")
                 for e in applicable("reading", impl, names) if e.stage or e.error)


def params():
    for impl in ALL_IMPLEMENTATIONS:
        for fmt in ADAPTERS[impl].other_formats:
            for case in STEP0_CASES:
                if cannot_express(impl, case.config) or unwritable(case.config, fmt):
                    continue   # no draft of it in that format, or none the implementation runs
                yield known_param(impl, fmt, case, id=f"{impl}-{fmt}-{case.id}", known=known_for(impl, fmt, case))


@pytest.mark.parametrize("impl,fmt,case", list(params()))
def test_other_format_step0_matches_reference(impl, fmt, case, drafts, repro):
    known = known_for(impl, fmt, case)
    try:
        loaded = ADAPTERS[impl]().load(drafts.checkpoint(case)[fmt], torch.float32)
    except Exception as exc:   # the server's loader refused the format: its own words, one line
        settle(f"{impl} [{fmt} format] could not load {case.id}: {type(exc).__name__}: {first_line(exc)}\n"
               f"  repro: {repro}", match_load(known, type(exc).__name__, first_line(exc)))
    actual = loaded.run(drafts.batch(case), 1).on_cpu()
    comparison = compare_traces(actual, drafts.trace("reference", case, torch.float32), f"{case.id} ({fmt} format)")
    first = comparison.first_divergence
    if first is not None:
        settle(comparison.message(repro), match_forward(known, first, case.config.num_hidden_layers))
