"""Self-tests of the known-divergence registry (conformance/core/known_divergences.toml).

Every entry must match a case and still diverge exactly where it says (so removing it turns those
cases into failures naming the stage); a bogus or malformed entry must be caught.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.core.harness import LoadFailed, compare_with_reference
from conformance.core.registry import (KNOWN_DIVERGENCES, LOAD, KnownDivergence, RegistryError,
                                           load_registry)
from fixtures.cases import ALL_CASES

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


def registry_problems(registry: tuple[KnownDivergence, ...], drafts) -> list[str]:
    """What is wrong with each entry: it matches no case, or its first case no longer diverges there."""
    problems = []
    for entry in registry:
        cases = [c for c in ALL_CASES if entry.applies(c)]
        if not cases:
            problems.append(f"{entry.id}: matches no case (its xfail would never run)")
            continue
        case = cases[0]
        try:
            first = compare_with_reference(drafts, entry.impl, case, "fp32", steps=entry.step + 1).first_divergence
            where = None if first is None else (first.step, first.stage)
        except LoadFailed:
            where = (0, LOAD)
        if where != (entry.step, entry.stage):
            problems.append(f"{entry.id}: case {case.id} diverges at {where or 'no stage'}, "
                            f"not at step {entry.step} '{entry.stage}'")
    return problems


def test_every_registry_entry_matches_a_case_and_still_diverges_there(drafts):
    problems = registry_problems(KNOWN_DIVERGENCES, drafts)
    assert not problems, "stale known divergences:\n  " + "\n  ".join(problems)


BOGUS = [
    KnownDivergence("bogus-no-case", "sglang", ">=0", "hidden_size == 12345", 0, "fc_out", "nothing"),
    KnownDivergence("bogus-wrong-stage", "sglang", ">=0", "norm_output", 0, "fc_out", "norm_output conforms"),
    KnownDivergence("bogus-other-version", "sglang", "<0.1", "norm_before_residual", 0, "layers.0.residual", "x"),
]


@pytest.mark.parametrize("entry", BOGUS, ids=[e.id for e in BOGUS])
def test_a_bogus_entry_is_caught(entry, drafts):
    problems = registry_problems((entry,), drafts)
    assert problems and problems[0].startswith(entry.id), f"bogus entry not caught: {entry}"


@pytest.mark.parametrize("text,field", [
    ('[[divergence]]\nid="x"\nimpl="sglang"\nversions="==0.5.23"\nwhen="no_such_knob"\nstep=0\nstage="fc_out"\nreason="r"\n', "no_such_knob"),
    ('[[divergence]]\nid="x"\nimpl="sglang"\nversions="==0.5.23"\nwhen="__import__(1)"\nstep=0\nstage="fc_out"\nreason="r"\n', "Call"),
    ('[[divergence]]\nid="x"\nimpl="vllm"\nversions="==1"\nwhen="mlp_bias"\nstep=0\nstage="fc_out"\nreason="r"\n', "impl"),
    ('[[divergence]]\nid="x"\nimpl="sglang"\nversions="==0.5.23"\nwhen="mlp_bias"\nstep=0\nstage="fc"\nreason="r"\n', "stage"),
    ('[[divergence]]\nid="x"\nimpl="sglang"\nwhen="mlp_bias"\nstep=0\nstage="fc_out"\nreason="r"\n', "versions"),
    ('[[divergence]]\nid="x"\nimpl="sglang"\nversions="not a range"\nwhen="mlp_bias"\nstep=0\nstage="fc_out"\nreason="r"\n', "divergence #1"),
    ('[[divergence]\n', "not valid TOML"),
], ids=["unknown_knob", "call", "unknown_impl", "unknown_stage", "missing_field", "bad_range", "bad_toml"])
def test_a_malformed_registry_is_a_one_line_error(text, field, tmp_path: Path):
    path = tmp_path / "known_divergences.toml"
    path.write_text(text)
    with pytest.raises(RegistryError) as info:
        load_registry(path)
    message = str(info.value)
    assert "\n" not in message and path.name in message and field in message, message


def test_readme_support_matrix_is_current():
    from conformance.core.support_matrix import README, readme_block

    assert readme_block() in README.read_text(), "README's support matrix is stale: run `make support-matrix`"


def test_an_uninstalled_implementation_has_no_known_divergence(monkeypatch):
    """A host without SGLang (e.g. a GPU box running only speculators) must collect, and SGLang's
    tests there must fail on the import rather than pass as expected failures."""
    import conformance.core.registry as kd

    entry = next(e for e in KNOWN_DIVERGENCES if e.impl == "sglang")
    case = next(c for c in ALL_CASES if entry.applies(c))
    monkeypatch.setitem(kd.PACKAGES, "sglang", "sglang-not-installed-here")
    kd.installed_version.cache_clear()
    try:
        assert kd.installed_version("sglang") is None
        assert not entry.applies(case), f"{entry.id} still applies to {case.id} without SGLang installed"
    finally:
        monkeypatch.undo()
        kd.installed_version.cache_clear()
    assert entry.applies(case)
