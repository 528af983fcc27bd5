"""Bring your own draft, the serving side: which target layers SGLang feeds this draft on the user's
target (--target-config), whether the hidden-state dump is from that target (--hidden-states), and what
the user's server flags do to this draft (--sglang-args); then, last of the user checks (this module
is collected after test_user_draft.py), that the user's files are untouched.

Each check runs on the draft as SGLang reads it (the directory as written, or this suite's conversion)
and adds what it finds to the verdict; without its option it is skipped, and the verdict's headline names
it and the option (conformance/user/verdict.py not_checked: exit 6, never "served as trained").
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conformance.core.sections import Section
from conformance.adapters import DEFAULT_SERVER
from conformance.user.serving import STAND_IN, served_with, servers, user_settings, user_wiring
from conformance.user.test_user_draft import fail, report_once
from conformance.user.user_draft import digest
from conformance.user.verdict import not_applicable, not_checked
from conformance.core.findings import OTHER, SETTINGS, Problem

pytestmark = [pytest.mark.cpu, pytest.mark.user]
TARGET_WIRING = "target wiring"


def fail_all(problems: list[Problem], verdict, nodeid: str, message: str, repro: str = ""):
    """Every problem into the verdict; the check fails with the first."""
    __tracebackhide__ = True
    for problem in problems[1:]:
        verdict.add(problem, nodeid)
    fail(problems[0], verdict, nodeid, message, repro)


def test_user_draft_target_wiring(user_draft, report, verdict, request, repro):
    """SGLang's own resolution of the draft's config and its own capture on a tiny twin of --target-config
    (same class, same layer count), slot by slot against the layers training captured."""
    if user_draft.inputs.target_file is None:   # which layers SGLang captures depends on the target's class and depth
        not_checked(TARGET_WIRING, "--target-config")
    report_once(user_draft, report, verdict)
    wiring = user_wiring(user_draft)
    for row in wiring.rows():
        report.add_row(Section.WIRING, row)
    if wiring.problems:
        fail_all(wiring.problems, verdict, request.node.nodeid, "\n".join(wiring.lines()), repro)


def other_servers() -> list[tuple[str, str | None]]:
    """(server, model runner) for each server other than the default whose adapter reads the target wiring."""
    from conformance.adapters import ADAPTERS
    from conformance.wiring.cases import runners

    return [(impl, runner) for impl in servers() if impl != DEFAULT_SERVER
            and ADAPTERS[impl].served_boundaries is not None for runner in runners(impl)]


@pytest.mark.parametrize("impl,runner", other_servers(), ids=lambda v: str(v))
def test_user_draft_target_wiring_on_other_servers(impl, runner, user_draft, report, verdict, request, repro):
    """--serve-with vllm (or both): the layers vLLM feeds the draft as it reads the directory as written, with
    each of its model runners (V2: a CUDA server's default; V1), on a twin of --target-config, slot by slot
    against training's (conformance/user/wiring.py check_server_wiring)."""
    from conformance.user.wiring import check_server_wiring, server_row

    if impl not in served_with(request.config):
        not_applicable(f"--serve-with does not name {impl}")
    inputs = user_draft.inputs
    if inputs.target_file is None:   # which layers the server captures depends on the target's class and depth
        not_checked(TARGET_WIRING, "--target-config")
    report_once(user_draft, report, verdict)
    wiring, served = user_draft.serving(
        f"wiring:{impl}:{runner}", lambda: check_server_wiring(impl, runner, inputs.checkpoint.path,
                                                                inputs.target_file, inputs.trainer,
                                                                user_draft.root / "twins"))
    report.add_row(Section.WIRING_SERVERS, server_row(impl, runner, wiring, served))
    if wiring.problems:
        fail_all(wiring.problems, verdict, request.node.nodeid, "\n".join(wiring.lines()), repro)


def test_user_draft_hidden_states_fit_the_target(user_draft, report, verdict, request, repro):
    """The --hidden-states dump's width and layer count against --target-config and the slots SGLang feeds."""
    from conformance.user.wiring import check_hidden_states

    inputs = user_draft.inputs
    if inputs.hidden_states is None:
        not_applicable("no --hidden-states: no dump to hold against the target")
    if inputs.target_file is None:
        not_checked("the hidden-state dump against the target", "--target-config")
    report_once(user_draft, report, verdict)
    problems = check_hidden_states(inputs.hidden_states, inputs.target_file, user_wiring(user_draft))
    if problems:
        fail_all(problems, verdict, request.node.nodeid, f"{problems[0].what}: {problems[0].evidence}", repro)


def test_user_draft_server_flags(user_draft, report, verdict, request, repro):
    """--sglang-args through SGLang's own ServerArgs with this draft and target: every setting that changes
    what this draft computes."""
    from conformance.user.settings import CommandLineError

    inputs = user_draft.inputs
    if inputs.sglang_args is None:
        not_checked("server flags", "--sglang-args")
    report_once(user_draft, report, verdict)
    if inputs.target_file is None:
        report.add_row(Section.USER_DRAFT, {"item": "note", "value": STAND_IN})
    try:
        settings = user_settings(user_draft)
    except CommandLineError as exc:   # SGLang's resolution refuses these flags for this draft and target
        fail(Problem("SGLang refuses to start with these server flags for this draft", "server flags", str(exc),
                     "SGLang's ServerArgs resolution (its own words above)", "change the flag it names", SETTINGS,
                     key="settings:refused"), verdict, request.node.nodeid, str(exc), repro)
    for row in settings.rows():
        report.add_row(Section.SETTINGS, row)
    if settings.problems:
        fail_all(settings.problems, verdict, request.node.nodeid,
                 "\n".join(f"{p.what}: {p.evidence}" for p in settings.problems), repro)


def test_user_draft_files_are_untouched(user_draft, verdict, request):
    """Runs after every check above: every input file still has the bytes it had when validated."""
    digests = user_draft.inputs.digests
    changed = [p for p, want in digests.items() if not Path(p).is_file() or digest(Path(p)) != want]
    assert digests, "no input files were recorded"
    if changed:
        fail(Problem("the run changed input files", ", ".join(Path(p).name for p in changed), f"{len(changed)} changed",
                     "this suite (it must only read them)", "report it", OTHER, key="untouched"),
             verdict, request.node.nodeid, f"input files changed during the run: {changed}")
