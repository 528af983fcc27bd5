"""SGLang's effective speculative settings for the trained tiny draft: requested vs effective.

`--sglang-args "..."` (default: conformance.adapters.sglang.settings.DEFAULT_SGLANG_ARGS) is parsed and
resolved by SGLang's own ServerArgs on CPU; the test fails on any setting SGLang serves differently
from what was asked for or trained (eagle3-semantics.md §5). The seed's command line, whose 16
draft tokens run as 2, must make that test fail with that message.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.adapters.sglang import SGLangAdapter
from conformance.adapters.sglang.compat import has_server_arg
from conformance.adapters.sglang.settings import CommandLineError, MISMATCH, draft_facts, effective_settings, findings
from conformance.core.sections import Section
from conformance.acceptance.trained_draft import CACHE_ENV

SEED_ARGS = "--speculative-eagle-topk 1 --speculative-num-steps 1 --speculative-num-draft-tokens 16"
MORE_STEPS_THAN_TRAINED = "--speculative-eagle-topk 1 --speculative-num-steps 7 --speculative-num-draft-tokens 8"
ROOT = Path(__file__).resolve().parents[2]


def _settings(trained, command_line: str):
    facts = draft_facts(trained.checkpoints["speculators"], trained.checkpoints["sglang"], trained.target_dir,
                        trained.config)
    try:
        return effective_settings(command_line, trained.target_dir, trained.checkpoints["sglang"], facts)
    except CommandLineError as exc:
        pytest.fail(str(exc), pytrace=False)


def _record(report, section: Section, settings) -> None:
    for row in settings.rows():
        report.add_row(section, row)


def predicted_row(settings, prediction) -> dict:
    """What the training metrics predict at the effective settings: 1 + sum_{k<K} full_acc_k, K the
    effective chain steps (the seed's 1 step: 1 + full_acc_0, the field's '74.7% -> 1.75')."""
    steps, topk = settings.effective["speculative_num_steps"], settings.effective["speculative_eagle_topk"]
    if topk != 1:
        value = f"not predicted: tree drafting (topk {topk})"
    elif steps > len(prediction.full_acc):
        value = f"not predicted: K = {steps} beyond the {len(prediction.full_acc)} trained steps"
    else:
        value = f"{prediction.accept_length(steps):.3f} at K = {steps} (at most {steps + 1} per round)"
    return {"command line": settings.command_line, "setting": "predicted accept length (1 + sum full_acc_k)",
            "requested": "", "effective": value, "verdict": "note",
            "why": "speculators' held-out metrics of this draft (conformance/acceptance/acceptance.py)"}


@pytest.mark.cpu
def test_sglang_effective_settings_match_requested(trained_draft, sglang_args, report, repro):
    settings = _settings(trained_draft, sglang_args)
    _record(report, Section.SETTINGS, settings)
    lines = [f.line() for f in settings.mismatches]
    assert not lines, (f"sglang vs requested [trained_draft, --sglang-args {sglang_args!r}]: "
                       f"{len(lines)} setting(s) served differently\n  " + "\n  ".join(lines)
                       + f"\n  repro: {repro} --sglang-args {shlex.quote(sglang_args)}")


@pytest.mark.cpu
def test_seed_command_line_is_flagged(trained_draft, acceptance, report):
    """The seed's flags: topk 1 and 1 step with 16 draft tokens resolve to 2 draft tokens; the report
    adds what the training metrics predict at those effective settings."""
    settings = _settings(trained_draft, SEED_ARGS)
    section = Section.SETTINGS_SEED
    _record(report, section, settings)
    report.add_row(section, predicted_row(settings, acceptance.prediction))
    flagged = {f.setting: f for f in settings.mismatches}
    tokens = flagged.get("speculative_num_draft_tokens")
    assert tokens is not None and (tokens.requested, tokens.effective) == (16, 2), (
        f"sglang [{SEED_ARGS}]: expected num_draft_tokens 16 -> 2 to be flagged, got "
        f"{[f.line() for f in settings.findings]}")


@pytest.mark.cpu
def test_more_steps_than_trained_are_flagged(trained_draft, report):
    settings = _settings(trained_draft, MORE_STEPS_THAN_TRAINED)
    _record(report, Section.SETTINGS_MORE_STEPS, settings)
    steps = [f for f in settings.mismatches if f.setting == "speculative_num_steps"]
    assert steps and steps[0].effective > trained_draft.trained_steps, (
        f"sglang [{MORE_STEPS_THAN_TRAINED}]: 7 steps for a draft trained for {trained_draft.trained_steps} "
        f"TTT steps not flagged: {[f.line() for f in settings.findings]}")


CHAIN = "--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 "
# eagle3-semantics.md §5: flags SGLang accepts and then serves differently from what they ask for.
SILENT = (
    ("token_map", CHAIN + "--speculative-token-map hot.pt", "speculative_token_map"),                   # S12
    ("rejection_sampling", CHAIN + "--speculative-use-rejection-sampling",
     "speculative_use_rejection_sampling"),                                                               # S8, S9
    ("draft_window", CHAIN + "--speculative-draft-window-size 4", "speculative_draft_window_size"),      # S11
    ("sink_size", CHAIN + "--speculative-draft-window-size 4 --speculative-draft-sink-size 2",
     "speculative_draft_sink_size"),                                                                      # S11
)


@pytest.mark.cpu
@pytest.mark.parametrize("command_line,setting", [pytest.param(c, s, id=i) for i, c, s in SILENT])
def test_silent_serving_behaviour_is_flagged(command_line, setting, trained_draft, report):
    if not has_server_arg(setting):   # a flag newer than the installed release: its parser refuses it
        pytest.skip(f"sglang {SGLangAdapter.version()} has no --{setting.replace('_', '-')} (compat.has_server_arg)")
    settings = _settings(trained_draft, command_line)
    for f in settings.mismatches:
        report.add_row(Section.SETTINGS_SILENT, {
            "command line": command_line, "setting": f.setting, "requested": str(f.requested),
            "effective": str(f.effective), "why": f.why})
    assert setting in {f.setting for f in settings.mismatches}, (
        f"sglang [{command_line}]: {setting} not flagged: {[f.line() for f in settings.findings]}")


@pytest.mark.cpu
def test_embedding_replaced_by_the_targets_is_flagged(trained_draft):
    """S13: SGLang serves an EAGLE-3 draft with the target's embedding. The trained draft's is the
    target's (a note); a draft with its own embedding is flagged."""
    facts = draft_facts(trained_draft.checkpoints["speculators"], trained_draft.checkpoints["sglang"],
                        trained_draft.target_dir, trained_draft.config)
    settings = _settings(trained_draft, CHAIN)
    verdicts = {}
    for label, embed in (("same", facts.draft_embed), ("own", facts.draft_embed + 0.01)):
        facts.draft_embed = embed
        found = findings(settings.requested, settings.effective, [], facts, "LlamaForCausalLM")
        verdicts[label] = next(f.verdict for f in found if f.setting == "embed_tokens")
    assert verdicts == {"same": "note", "own": MISMATCH}, f"embed_tokens verdicts: {verdicts}"


@pytest.mark.cpu
@pytest.mark.meta
@pytest.mark.parametrize("command_line", ["--bogus-flag 3", "--speculative-num-steps three",
                                          "--speculative-eagle-topk 1 --speculative-use-block-verification"])
def test_bad_command_line_is_one_line(command_line, trained_draft):
    """Refused by SGLang's parser or by its resolution: one line naming --sglang-args, no traceback."""
    facts = draft_facts(trained_draft.checkpoints["speculators"], trained_draft.checkpoints["sglang"],
                        trained_draft.target_dir, trained_draft.config)
    with pytest.raises(CommandLineError) as caught:
        effective_settings(command_line, trained_draft.target_dir, trained_draft.checkpoints["sglang"], facts)
    message = str(caught.value)
    assert message.startswith("--sglang-args:") and "\n" not in message, message


@pytest.mark.cpu
def test_auto_chosen_settings_are_reported(trained_draft, report):
    """No speculative numbers: SGLang chooses them itself for the target's architecture
    (speculative_hook.py:1159-1174); each is reported as auto-chosen with what SGLang runs."""
    settings = _settings(trained_draft, "--max-running-requests 8")
    _record(report, Section.SETTINGS_NOTHING_REQUESTED, settings)
    auto = {f.setting: f.effective for f in settings.findings if f.why.startswith("auto-chosen")}
    assert set(auto) == {"speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"} and \
        all(v is not None for v in auto.values()), f"auto-chosen settings not reported: {settings.findings}"
    if auto["speculative_eagle_topk"] > 1:
        assert any("tree drafting" in f.why for f in settings.findings), "topk > 1 without the tree-drafting note"


@pytest.mark.cpu
@pytest.mark.meta
def test_seed_command_line_fails_the_settings_test(trained_draft, tmp_path):
    """pytest run as a user would, with the seed's --sglang-args: the settings test fails (exit code
    1) naming the effective draft tokens, and the report states them."""
    node = "conformance/settings/test_sglang_settings.py::test_sglang_effective_settings_match_requested"
    env = {**os.environ, CACHE_ENV: str(trained_draft.root.parent), "OMP_NUM_THREADS": "1"}   # beside the workers
    done = subprocess.run(
        [sys.executable, "-m", "pytest", node, "-q", "--sglang-args", SEED_ARGS,
         "--report", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    expected = "speculative_num_draft_tokens: requested 16, effective 2"
    assert done.returncode == 1 and expected in out, (
        f"pytest --sglang-args {SEED_ARGS!r}: exit code {done.returncode} (want 1), "
        f"{'with' if expected in out else 'without'} {expected!r}\n{out[-3000:]}")
    rows = [line for line in (tmp_path / "report.md").read_text().splitlines()
            if "| speculative_num_draft_tokens |" in line]
    assert rows and "| 16 | 2 | " + MISMATCH in rows[0], f"report.md does not state 16 -> 2: {rows}"
