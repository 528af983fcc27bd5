"""The verdict as a user gets it: `pytest --draft-checkpoint=DIR` in a real subprocess, on planted drafts.

Each problem class is one tiny draft trained with one knob SGLang serves differently (PLANTS in
conformance/user/example_draft.py), written in SGLang's format so that nothing else is wrong with it:
exit code 1, the verdict line, and the named cause (its registry entry, its file:line) and fix. A
speculators-format directory fails with SGLang's own refusal as problem 1 and nothing else; a clean draft
in every format SGLang reads as written exits 0 "served as trained"; bad input exits 4 with one line.
The seed, from files: a draft trained on [embed, 3, 31] whose config.json was rewritten to ids SGLang
turns into [3, 31, 59] on the real Kimi-K2.5 config is exactly that slot-by-slot problem, and the draft
rewired as the verdict says exits 0; the seed's server flags on a user draft show the 16 -> 2 draft
tokens. The runs are independent subprocesses, two at a time.
The seed and the clean drafts run in test_verdict_seed.py; the cases and the runs are in verdict_runs.py.
"""
from __future__ import annotations

import json
import shutil
from concurrent.futures import Future

import pytest
from safetensors.torch import load_file, save_file

from conformance.meta.verdict_runs import KIMI, PLANTED, check_verdict, run_pytest, start_runs
from conformance.user.example_draft import PLANTS, write_example
from conformance.user.servable import conversion_findings, directory_problem, served_ids
from conformance.user.verdict import DIRECTORY, FORWARD, LOADING, OTHER, Problem, Verdict

pytestmark = [pytest.mark.cpu, pytest.mark.meta]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Future]:
    yield from start_runs(tmp_path_factory.mktemp("verdict"), PLANTED)


@pytest.mark.parametrize("case", PLANTED, ids=lambda c: c.id)
def test_the_verdict_names_the_problem(case, runs):
    check_verdict(case, runs)


def test_bad_input_exits_4_with_one_line(tmp_path):
    """A file no implementation can use: a NaN weight. A usage error before any check runs."""
    draft, _, _ = write_example(tmp_path, "sglang")
    weights = load_file(str(draft / "model.safetensors"))
    weights["fc.weight"][1, 2] = float("nan")
    save_file(weights, str(draft / "model.safetensors"), metadata={"format": "pt"})
    result = run_pytest(f"--draft-checkpoint={draft}")
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 4, f"exit {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert len(lines) == 1 and "model.safetensors: tensor fc.weight: nan at index (1, 2)" in lines[0], lines


@pytest.mark.parametrize("option,words", [
    ("--trained-aux-layers=embed,x,31", "'x' is not a layer"),
    ("--trained-aux-layers=embed,3", "2 layers, but the draft's fc reads 3 aux states"),
    (f"--trained-aux-layers=embed,3,62 --target-config={KIMI}", "layer 62 is beyond the target's 61 layers"),
    ("--sglang-args=--speculative-num-steps=three", "--speculative-num-steps: invalid int value"),
], ids=["not_a_layer", "count", "beyond_target", "sglang_args"])
def test_bad_options_exit_4_with_one_line(option, words, tmp_path):
    draft, _, _ = write_example(tmp_path, "sglang")
    result = run_pytest(f"--draft-checkpoint={draft}", *option.split(" "))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 4, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert len(lines) == 1 and words in lines[0], lines


def test_every_plant_is_checked():
    assert {c.plant for c in PLANTED if c.plant} == set(PLANTS)


# ---------------------------------------------------------------- the parts, in process

def problem(key: str, rank: int = FORWARD, impl: str = "sglang", known: str = "", seen: str = "") -> Problem:
    return Problem(f"what {key}", "where", "evidence", "cause", "fix", rank, key=key, impl=impl, known=known, seen=seen)


def test_a_failed_check_that_named_no_problem_is_one():
    verdict = Verdict()
    verdict.failed["t.py::test_x"] = "AssertionError: boom"
    verdict.finish()
    assert verdict.headline() == "NOT served as trained: 1 problem" and not verdict.served
    assert verdict.ordered()[0].rank == OTHER and verdict.ordered()[0].evidence == "AssertionError: boom"


def test_one_cause_seen_by_several_checks_is_one_problem_and_ranks_order_them():
    verdict = Verdict()
    verdict.add(problem("entry", known="entry", seen="fp32/1-step"), "t::a")
    verdict.add(problem("entry", known="entry", seen="bf16/1-step"), "t::b")
    verdict.add(problem("directory", rank=DIRECTORY), "t::c")
    verdict.finish()
    first, second = verdict.to_json({})["problems"]
    assert first["what"] == "what directory" and second["checks"] == ["t::a", "t::b"], (first, second)
    assert second["evidence"] == "evidence; also in: bf16/1-step", second


def test_an_unregistered_divergence_folds_into_its_implementations_loading_problem():
    verdict = Verdict()
    verdict.add(problem("sglang:forward:0:fc_out"), "t::a")
    verdict.add(problem("sglang-registered", known="sglang-registered"), "t::b")
    verdict.add(problem("sglang:accounting", rank=LOADING), "t::c")
    verdict.finish()
    kept = {p.key: p for p in verdict.ordered()}
    assert set(kept) == {"sglang:accounting", "sglang-registered"}, kept
    assert "then the forward departs at where" in kept["sglang:accounting"].evidence


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A speculators-format example and its conversion by the command the verdict names."""
    from conformance.user.convert import main

    root = tmp_path_factory.mktemp("conversion")
    draft, _, _ = write_example(root / "in", "speculators")
    assert main([str(draft), str(root / "sglang")]) == 0
    return draft, root / "sglang"


def test_the_named_conversion_makes_the_directory_servable(converted):
    draft, out = converted
    refused = directory_problem(draft, "speculators", draft.name)
    assert refused is not None and "Unrecognized model" in refused.evidence, refused
    assert directory_problem(out, "sglang", out.name) is None


def test_an_original_eagle3_export_is_not_a_draft_class_sglang_builds(converted, tmp_path):
    """SGLang reads an `architectures: [LlamaForCausalLM]` config fine, then would build a target model."""
    _, out = converted
    eagle = shutil.copytree(out, tmp_path / "eagle")
    config = json.loads((eagle / "config.json").read_text())
    (eagle / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    found = directory_problem(eagle, "eagle", eagle.name)
    assert found is not None and "SGLang builds LlamaForCausalLM, not LlamaForCausalLMEagle3" in found.evidence, found
    assert "python -m conformance.user.convert eagle eagle-sglang" in found.fix, found


def test_the_conversion_check_names_what_a_conversion_lost(converted, tmp_path):
    """A conversion that drops a norm tensor, shifts the aux ids and loses fc_norm: each one named."""
    from conformance.checkpoints.directory import open_checkpoint
    from conformance.loading.accounting import account
    from conformance.user.trainer import resolve_trainer

    draft, out = converted
    intended = served_ids(resolve_trainer(open_checkpoint(draft)), None, tmp_path / "twins")
    good = {impl: account(impl, out) for impl in ("reference", "sglang")}
    assert conversion_findings(draft, out, intended, good) == []
    bad = shutil.copytree(out, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]   # speculators' ids verbatim
    config["fc_norm"] = False
    (bad / "config.json").write_text(json.dumps(config))
    weights = load_file(str(bad / "model.safetensors"))
    weights.pop("fc_norm.1.weight")
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    accounts = {"reference": good["reference"], "sglang": account("sglang", bad)}
    findings = conversion_findings(draft, bad, intended, accounts)
    text = "\n".join(findings)
    assert "tensor fc_norm.1.weight: missing from the conversion" in text, text
    assert "SGLang reads eagle_config ids [2, 4, 5]" in text and "must give it [1, 3, 4]" in text, text
    assert "fc_norm: SGLang builds False, training has True" in text, text
