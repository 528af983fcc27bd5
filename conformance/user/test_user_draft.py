"""Bring your own draft: the --draft-checkpoint draft (without it, a fixture draft in SpecForge's export
layout) as SGLang will serve it, against training semantics (the reference) on its training samples.

In order: SGLang reads the directory as written (else that is the first problem, and the rest is
judged on this suite's conversion, which is checked); step 0 and teacher-forced multi-step per
implementation and dtype (conformance/user/plan.py: what a large draft runs); weight accounting per
implementation. The serving side (wiring, server flags) and the untouched files: test_user_serving.py.
Every check that finds something fails and adds a problem to the verdict (conformance/user/verdict.py):
a registered divergence that applies to this draft is the answer the user came for, never an xfail.
"""
from __future__ import annotations

import dataclasses

import pytest

from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS
from conformance.core import registry
from conformance.session.harness import check_forward as run_forward
from conformance.core.sections import Section
from conformance.loading.accounting import knob_rows
from conformance.user import mla
from conformance.user.plan import FULL, STEPS, plan_for
from conformance.user.problems import accounting_problems, forward_problem, load_problem, report_outcome
from conformance.user.readings import reading_problems
from conformance.user.serving import served_with
from conformance.user.servable import conversion_findings, conversion_problem, directory_problem
from conformance.user.trainer import FORMAT_TRAINER, other_trainers
from conformance.user.user_draft import FIXTURE_FORMAT, INPUTS_KEY
from conformance.user.verdict import not_applicable
from conformance.core.findings import Problem, plain

pytestmark = [pytest.mark.cpu, pytest.mark.user]


def pytest_generate_tests(metafunc):
    name = metafunc.function.__name__
    if name in ("test_user_draft_step0_matches_reference", "test_user_draft_multistep_matches_reference"):
        inputs = metafunc.config.stash.get(INPUTS_KEY, None)   # the plan decides the dtypes (plan.py)
        plan = plan_for(inputs.checkpoint.tensors) if inputs is not None else FULL
        metafunc.parametrize("impl,dtype_name", [pytest.param(impl, d, id=f"{impl}-{d}-user_draft")
                                                 for impl in user_implementations(inputs, metafunc.config)
                                                 for d in plan.dtypes])
    elif name == "test_user_draft_weight_accounting":
        inputs = metafunc.config.stash.get(INPUTS_KEY, None)
        metafunc.parametrize("impl", ["reference", *user_implementations(inputs, metafunc.config)])


def user_implementations(inputs, config=None) -> list[str]:
    """The implementations a user's draft runs: its own trainer's (conformance/user/trainer.py) and the servers
    --serve-with names (conformance/user/serving.py)."""
    chosen = served_with(config)
    others = other_trainers(inputs.trainer) if inputs else other_trainers(None, FORMAT_TRAINER[FIXTURE_FORMAT])
    return [impl for impl in ALL_IMPLEMENTATIONS if impl not in others
            and (not ADAPTERS[impl].is_server or impl in chosen)]


def report_once(store, report, verdict) -> None:
    """The inputs, the effective knobs and the weight map of the user's draft, once per session."""
    if store.reported:
        return
    store.reported = True
    verdict.context.update(store.context())
    for row in store.report_rows():
        report.add_row(Section.USER_DRAFT, row)
    accounts = store.accounts()
    for row in knob_rows(store.case.id, list(accounts.values()), only_disagreements=False):
        report.add_row(Section.EFFECTIVE_KNOBS, row)
    # Where SGLang's loader put each tensor (fused shards, legacy names); the reference and speculators
    # load by name, which their accounting rows confirm.
    for tensor, where in accounts["sglang"].landed:
        report.add_row(Section.WEIGHT_MAP, {"draft": store.case.id, "tensor": tensor, "landed in": where})


def fail(problem: Problem, verdict, nodeid: str, message: str, repro: str = ""):
    """Record the problem and fail the check. On a user's draft the verdict block ends the run with the problem's
    where, evidence, cause and fix: the failure says which problem, and how to run this check alone."""
    __tracebackhide__ = True
    kept = verdict.add(problem, nodeid)
    again = f"\n  repro: {repro}" if repro else ""
    if verdict.printed:
        pytest.fail(f"{plain(kept.what, (kept.known,))} (in the verdict below){again}", pytrace=False)
    again = again if repro not in message else ""   # a comparison's message ends with it already
    pytest.fail(f"{message}\n  cause: {kept.cause}\n  fix: {kept.fix}{again}", pytrace=False)


def test_user_draft_sglang_reads_the_directory(user_draft, report, verdict, request, repro):
    """SGLang's own config reader on the directory as the user has it (never written to)."""
    report_once(user_draft, report, verdict)
    ckpt = user_draft.inputs.checkpoint
    problem = directory_problem(ckpt.path, ckpt.format, ckpt.path.name, user_draft.convert_args(),
                                mla=mla.is_mla(user_draft.inputs))
    if problem is not None:
        fail(problem, verdict, request.node.nodeid, f"{problem.what}: {problem.evidence}", repro)


def test_user_draft_conversion_keeps_the_draft(user_draft, report, verdict, request, repro):
    """The conversion SGLang is given instead: every tensor bit-exact, the aux ids SGLang will read, the
    norms and vocabulary SGLang builds from it."""
    if not user_draft.converted:
        not_applicable("SGLang reads the directory as written: there is no conversion to check")
    report_once(user_draft, report, verdict)
    inputs = user_draft.inputs
    served = user_draft.checkpoint(user_draft.case)["sglang"]
    findings = conversion_findings(inputs.checkpoint.path, served, user_draft.eagle_ids, user_draft.accounts())
    problem = conversion_problem(findings, inputs.checkpoint.format)
    if problem is not None:
        fail(problem, verdict, request.node.nodeid, f"{problem.what}: {problem.where}", repro)


def test_user_draft_implementations_read_the_file_alike(user_draft, report, verdict, request):
    """Each implementation's reading of the keys two can read differently (a tie flag with a pruned vocabulary,
    a key left to each reader's default, a window), observed on the model it loaded, against training's."""
    report_once(user_draft, report, verdict)
    accounts = {**user_draft.accounts(), **{impl: user_draft.account_of(impl) for impl in served_with(request.config)
                                            if impl in user_implementations(user_draft.inputs, request.config)}}
    problems = reading_problems(user_draft, accounts)
    for problem in problems[1:]:
        verdict.add(problem, request.node.nodeid)
    if problems:
        fail(problems[0], verdict, request.node.nodeid, f"{problems[0].what}: {problems[0].evidence}")
    if mla.is_mla(user_draft.inputs) and (keys := mla.unobserved_readings(user_draft, accounts)):
        pytest.skip(f"SGLang's MLA draft's reading of {', '.join(keys)} (its MLA layer has no stage recorder here)")


def check_forward(store, report, verdict, impl: str, dtype_name: str, nodeid: str, repro: str, steps: int):
    """The built-in matrix's forward runner (session/harness.py check_forward) on the user's draft; what it
    finds is a problem of the verdict, a registered divergence included."""
    __tracebackhide__ = True
    case = store.case if steps == 1 else dataclasses.replace(store.case, id=f"{store.case.id}_{steps}_steps")
    cfg = store.inputs.config
    if why := ADAPTERS[impl]().unsupported(cfg):
        pytest.skip(why)
    check = run_forward(store, impl, case, dtype_name, repro, steps)
    if check.failure is not None:
        problem = load_problem(impl, cfg, check.known, str(check.failure))
        report.add_load_failure(impl, case.id, dtype_name, nodeid, report_outcome(problem), str(check.failure))
        fail(problem, verdict, nodeid, check.message, repro)
    problem = forward_problem(impl, cfg, check.known, check.comparison, steps)
    report.add(check.comparison, nodeid, report_outcome(problem), "" if problem is None else problem.cause)
    if problem is not None:
        fail(problem, verdict, nodeid, check.message, repro)


def check_mla_forward(store, report, verdict, dtype_name: str, nodeid: str, repro: str, steps: int):
    """SGLang's MLA draft (conformance/user/mla.py): every stage its MLA column claims against the reference."""
    __tracebackhide__ = True
    cfg = store.inputs.config
    try:
        comparison = mla.forward_comparison(store, dtype_name, steps)
    except mla.LoadRefused as exc:   # SGLang refused the draft: its own words, matched against its MLA load entries
        message = str(exc)
        problem = load_problem(mla.IMPL, cfg, mla.known(store.case), message)
        fail(problem, verdict, nodeid, message, repro)
    problem = forward_problem(mla.IMPL, cfg, mla.known(store.case, "draft"), comparison, steps)
    report.add(comparison, nodeid, report_outcome(problem), "" if problem is None else problem.cause)
    if problem is not None:
        fail(problem, verdict, nodeid, comparison.message(repro), repro)


def forward(store, report, verdict, impl: str, dtype_name: str, nodeid: str, repro: str, steps: int):
    __tracebackhide__ = True
    if impl == mla.IMPL and mla.is_mla(store.inputs):
        check_mla_forward(store, report, verdict, dtype_name, nodeid, repro, steps)
    else:
        check_forward(store, report, verdict, impl, dtype_name, nodeid, repro, steps)


def test_user_draft_step0_matches_reference(impl, dtype_name, user_draft, report, verdict, request, repro):
    report_once(user_draft, report, verdict)
    forward(user_draft, report, verdict, impl, dtype_name, request.node.nodeid, repro, steps=1)


def test_user_draft_multistep_matches_reference(impl, dtype_name, user_draft, report, verdict, request, repro):
    report_once(user_draft, report, verdict)
    forward(user_draft, report, verdict, impl, dtype_name, request.node.nodeid, repro, steps=STEPS)


def test_user_draft_weight_accounting(impl, user_draft, report, verdict, request, repro):
    """Every tensor landed bit-exact, no parameter left unloaded, nothing dropped silently."""
    report_once(user_draft, report, verdict)
    if why := ADAPTERS[impl]().unsupported(user_draft.inputs.config):
        pytest.skip(why)
    acct = user_draft.account_of(impl)
    report.add_row(Section.WEIGHT_ACCOUNTING, acct.row(user_draft.case.id))
    if not acct.problems:
        return
    known = mla.known(user_draft.case) if impl == mla.IMPL and mla.is_mla(user_draft.inputs) else \
        registry.for_accounting(impl, user_draft.case)
    problems = accounting_problems(impl, user_draft.inputs.config, known, acct)
    assert problems, f"{impl} weight accounting: {acct.problems} but no problem recorded"
    for problem in problems[1:]:
        verdict.add(problem, request.node.nodeid)
    fail(problems[0], verdict, request.node.nodeid,
         f"{impl} weight accounting [{user_draft.case.id}]: " + "; ".join(acct.problems), repro)
