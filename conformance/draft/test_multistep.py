"""Multi-step drafting: SGLang's EXTEND + DECODE passes and speculators' TTT steps vs the reference.

K = 7 draft steps per run, every step compared stage by stage (so K = 1..7 are all covered). Two
modes: teacher-forced (steps >= 1 embed the data tokens, as training does; speculators shifts its
input_ids left by the step over the packed row, core.py:332-338, and every side is fed those ids)
and free-running (each step embeds the draft's own d2t-mapped argmax, as serving does). speculators
has no free-running mode, so that mode runs the servers only (SGLang, vLLM), in fp32: with bf16 near-ties two correct
implementations may pick different tokens and then legitimately draft different chains.
SGLang's DECODE passes run on each request's last token; its rows are compared to the reference's.
"""
from __future__ import annotations

import dataclasses

import pytest

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS
from conformance.core.trace import Trace
from conformance.core.compare import compare_traces
from conformance.session.harness import assert_conforms, conformance_params
from conformance.core.tolerances import DTYPES
from fixtures.cases import CASES_BY_ID, DEFAULT_CASES, DEFAULT_STEPS, MULTISTEP_CASES

STEPS = 7
SERVING = [impl for impl in ALL_IMPLEMENTATIONS if ADAPTERS[impl].serving_decode]   # they draft freely


@pytest.mark.cpu
@pytest.mark.parametrize("impl,dtype_name,case",
                         list(conformance_params(ALL_IMPLEMENTATIONS, DTYPES, MULTISTEP_CASES, extra_id="teacher")))
def test_multistep_teacher_forced_matches_reference(impl, dtype_name, case, drafts, report, request, repro):
    assert_conforms(drafts, report, impl, case, dtype_name, request.node.nodeid, repro, steps=STEPS)


@pytest.mark.cpu
@pytest.mark.parametrize("impl,dtype_name,case",
                         list(conformance_params(SERVING, ["fp32"], MULTISTEP_CASES, extra_id="free")))
def test_multistep_free_running_matches_reference(impl, dtype_name, case, drafts, report, request, repro):
    assert_conforms(drafts, report, impl, case, dtype_name, request.node.nodeid, repro, steps=STEPS,
                    teacher_forced=False)


# Each trainer's default draft (fixtures/cases.py DEFAULT_CASES) at K = DEFAULT_STEPS in both modes, in fp32 (exact;
# bf16 runs its step 0, test_step0.py): report.md's verdict on each reads these and its step-0 runs.
@pytest.mark.cpu
@pytest.mark.parametrize("impl,dtype_name,case", list(conformance_params(
    ALL_IMPLEMENTATIONS, ["fp32"], DEFAULT_CASES, extra_id=f"teacher-k{DEFAULT_STEPS}", steps=DEFAULT_STEPS)))
def test_default_draft_teacher_forced_matches_reference(impl, dtype_name, case, drafts, report, request, repro):
    assert_conforms(drafts, report, impl, case, dtype_name, request.node.nodeid, repro, steps=DEFAULT_STEPS)


@pytest.mark.cpu
@pytest.mark.parametrize("impl,dtype_name,case", list(conformance_params(
    SERVING, ["fp32"], DEFAULT_CASES, extra_id=f"free-k{DEFAULT_STEPS}", steps=DEFAULT_STEPS)))
def test_default_draft_free_running_matches_reference(impl, dtype_name, case, drafts, report, request, repro):
    assert_conforms(drafts, report, impl, case, dtype_name, request.node.nodeid, repro, steps=DEFAULT_STEPS,
                    teacher_forced=False)


ROTATED = frozenset({"q_rot", "k_rot"})   # absolute rotations: the only stages a position offset may change
ROPE_CASES = ("ms_gqa", "ms_rope_yarn")


@pytest.mark.cpu
@pytest.mark.parametrize("case_id", ROPE_CASES)
def test_multistep_training_position_offset_is_harmless(case_id, drafts, report, request, repro):
    """speculators drafts at its training positions (1, 2, ...; data.py:35), SGLang serves from 0
    (eagle_worker_v2.py:979-1002). RoPE is relative for these rope types, so speculators at +1 must
    match the reference at +0 at every stage but the absolute rotations, at every step."""
    case = CASES_BY_ID[case_id]
    at_training_positions = dataclasses.replace(case, id=f"{case.id}_from_1", positions_from=1)
    actual = drafts.trace("speculators", at_training_positions, DTYPES["fp32"], STEPS)
    actual = Trace(actual.impl, actual.dtype, [{k: v for k, v in s.items() if k.rsplit(".", 1)[-1] not in ROTATED}
                                               for s in actual.steps], actual.rows, actual.notes,
                   claimed_stages=actual.claimed_stages - ROTATED, num_layers=actual.num_layers)
    expected = drafts.trace("reference", case, DTYPES["fp32"], STEPS)
    comparison = compare_traces(actual, expected, at_training_positions.id)
    first = comparison.first_divergence
    report.add(comparison, request.node.nodeid, "pass" if first is None else "FAIL")
    assert first is None, comparison.message(repro)
