"""Property-based conformance: drawn draft configs and batches, every implementation vs the reference.

Each example writes its own tiny checkpoints and runs speculators and SGLang for two draft steps
(teacher-forced) in the drawn dtype. Where the registry (conformance/core/registry.toml) has an entry for
a configuration, the observation must be exactly that entry's: a load refusal with its exception class and
message pattern, or its first divergent step and stage; otherwise every stage must conform.

Drawn knobs alone would almost always meet a registered SGLang divergence, after which nothing is
compared. So two examples in three are drawn clean: every applicable SGLang entry's `neutral` overrides
are applied (strategies.variants), and the rest must conform stage by stage. Every other example runs as
drawn and, when SGLang has entries on it, neutralised as well. Each run is a row of the report's
"property examples". Profiles (conformance/plugin.py): `ci` (default, derandomized), `dev`, `nightly`.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from conformance.adapters import ADAPTERS, IMPLEMENTATIONS
from conformance.session.harness import LoadFailed, compare_with_reference
from conformance.core.matching import match_forward, match_load
from conformance.core.areas import deciding
from conformance.core.registry import Known, Neutralised, for_case
from conformance.session.report import Report
from conformance.core.sections import Section
from conformance.core.tolerances import DTYPES
from conformance.draft.strategies import describe, draw_example, label, variants
from conformance.session.harness import NeutralStore
from fixtures.cases import CASES_BY_ID, DraftCase
from fixtures.checkpoint import edited_copy

STEPS = 2


def registered(impl: str, variant: Neutralised) -> list[Known]:
    """The entries that decide `impl` on a variant: those that apply, but for the ones it neutralised."""
    return [e for e in for_case(impl, variant.case, STEPS) if e not in variant.entries]


def expected(impl: str, variant: Neutralised) -> str:
    entry = deciding(registered(impl, variant), variant.case.config.num_hidden_layers)
    if entry is None:
        return "conforms"
    return f"load refused ({entry.id})" if entry.area == "load" else f"step {entry.step} `{entry.stage}` ({entry.id})"


def check(drafts: NeutralStore, impl: str, variant: Neutralised, dtype_name: str,
          repro: str) -> tuple[str, str | None]:
    """(what `impl` showed on the variant, the failure message when that is not exactly what the registry says)."""
    case, known, want = drafts.use(variant), registered(impl, variant), expected(impl, variant)
    try:
        comparison = compare_with_reference(drafts, impl, case, dtype_name, steps=STEPS)
    except LoadFailed as exc:
        failure = (f"{impl} vs reference [{case.id}, {dtype_name}]: first divergence at step 0, stage 'load' "
                   f"(registry expects: {want})\n  {exc}\n  repro: {repro}")
        return f"load refused: {exc.error}", None if match_load(known, exc.error, exc.detail) else failure
    first = comparison.first_divergence
    if first is None:
        as_registered = deciding(known, case.config.num_hidden_layers) is None
    else:
        as_registered = match_forward(known, first, case.config.num_hidden_layers) is not None
    seen = "conforms" if first is None else f"step {first.step} `{first.stage}`"
    return seen, None if as_registered else f"registry expects: {want}\n" + comparison.message(repro)


def run_variant(drafts: NeutralStore, report: Report, variant: Neutralised, drawn: DraftCase, clean: bool,
                dtype_name: str, repro: str, impls=IMPLEMENTATIONS) -> list[str]:
    """Every implementation on one variant of an example: one report row, and the failure messages."""
    case = variant.case
    row = {"case": case.id, "dtype": dtype_name, "config": describe(case.config), "drawn clean": clean,
           "variant": label(variant, drawn)}
    failures = []
    for impl in impls:
        if ADAPTERS[impl]().unsupported(case.config):   # it cannot express the drawn config: nothing to run
            row |= {f"{impl}: expected": "not expressible", f"{impl}: observed": "not run"}
            continue
        seen, failure = check(drafts, impl, variant, dtype_name, repro)
        row |= {f"{impl}: expected": expected(impl, variant), f"{impl}: observed": seen}
        failures += [failure] if failure else []
    report.add_row(Section.PROPERTY_EXAMPLES, row)
    return failures


@pytest.mark.cpu
@given(data=st.data())
def test_property_every_implementation_conforms_or_diverges_as_registered(data, tmp_path_factory, report, request):
    case, clean = draw_example(data)
    dtype_name = data.draw(st.sampled_from(sorted(DTYPES)), label="dtype")
    note(f"config: {json.dumps(dict(case.overrides), default=str)}; lengths {case.lengths}; seed {case.seed}")
    drafts = NeutralStore(tmp_path_factory.mktemp(case.id))   # one store per example: nothing accumulates
    repro = (f"python -m pytest '{request.node.nodeid}' (the failing example is printed above; the ci profile "
             "replays it)")
    failures = []
    for variant in variants(case, clean):
        failures += run_variant(drafts, report, variant, case, clean, dtype_name, repro)
    assert not failures, "\n\n".join(failures)


# ---------------------------------------------------------------- self-test

class PlantedStore(NeutralStore):
    """SGLang reads a checkpoint whose last layer's down_proj is scaled by 1.01: a fault at its `mlp_out`."""

    def checkpoint(self, case: DraftCase):
        paths = super().checkpoint(case)
        planted = self.root / f"{case.id}-planted-sglang"
        name = f"layers.{case.config.num_hidden_layers - 1}.mlp.down_proj.weight"

        def edit(w):
            w[name] = w[name] * 1.01
        return {**paths, "sglang": planted if planted.exists() else edited_copy(paths["sglang"], planted, edit)}


@pytest.mark.cpu
@pytest.mark.meta
@pytest.mark.parametrize("case_id,stage", [("norm_before_residual", "layers.0.mlp_out"),
                                           ("two_layers", "layers.1.mlp_out")])
def test_a_fault_past_a_registered_divergence_is_caught_on_the_neutralised_variant(case_id, stage, tmp_path, repro):
    """A planted SGLang fault behind the registered first divergence passes as registered on the case as drawn;
    its neutralised variant, which every such example also runs (and a clean example runs alone), fails naming
    the planted stage: by a knob (norm_before_residual) or by unit weights (two layers: layer 1 compared)."""
    case = CASES_BY_ID[case_id]
    drawn, neutral = variants(case, clean=False)
    assert drawn.case is case and variants(case, clean=True) == [neutral] and not registered("sglang", neutral)
    drafts, report = PlantedStore(tmp_path), Report()
    assert not run_variant(drafts, report, drawn, case, False, "fp32", repro, ["sglang"])
    failures = run_variant(drafts, report, neutral, case, False, "fp32", repro, ["sglang"])
    assert failures and f"stage '{stage}'" in failures[0] and repro in failures[0], failures
    assert not run_variant(NeutralStore(tmp_path / "unplanted"), report, neutral, case, True, "fp32", repro)
