"""The verdict as a user gets it: `pytest --draft-checkpoint=DIR`, on planted drafts, and every command it prints
pasted from another directory.

Each problem class is one tiny draft trained with one knob SGLang serves differently (PLANTS in
conformance/user/example_draft.py), written in SGLang's format so that nothing else is wrong with it:
exit code 1, the verdict line, and the named cause (its registry entry, its file:line) and fix. A
speculators-format directory fails with SGLang's own refusal as problem 1 and nothing else; a clean draft
in every format SGLang reads as written, without the optional inputs, exits 6 with a headline naming what
was not checked and the option that checks it, and with --target-config and --sglang-args exits 0 "served
as trained"; bad input exits 4 with one line, and so does a --serve-with server that cannot run here.
A tree SGLang drafts otherwise (the registry's tree entry) is a problem; a draft that does not say its
trainer is judged against the reference, never blamed for a trainer's refusal, with the trainers that
could have written it named. A flag that changes the draft SGLang builds, none of them speculative_* (an fp8
KV cache, a rope override meant for the target, a quantization SGLang derives for the draft) is a problem
naming the setting and the user's flag behind it. A valid file two implementations read differently (a tie
flag with a pruned vocabulary and its own head; vLLM's reading of an absent key, in vLLM's lane) is one
problem naming each reading and the key to write. Where users run it, from a directory outside the repository
and without pytest-xdist: pytest with the space form of --draft-checkpoint (its plugin loaded by its pytest11
entry point) and the entry point `eagle3-conformance check`.
The seed, from files: a draft trained on [embed, 3, 31] whose config.json was rewritten to ids SGLang
turns into [3, 31, 59] on the real Kimi-K2.5 config is exactly that slot-by-slot problem, and the draft
rewired as the verdict says exits 0; the seed's server flags on a user draft show the 16 -> 2 draft
tokens. Every case that exits 1 prints commands: each `repro:` line, run from another directory, fails again
with the same problem; where the verdict prints fixes, they run from there too and the check it prints after them
no longer names the problems they fix.

The runs are independent pytest sessions, two at a time, each in a child forked from one process that has done
the imports a user run does (conformance/meta/preloaded.py: 25 s a run become 3-5); the printed commands run the
same way, as the shell splits them. The cases that are about how a user's process starts (`how`) are real
processes, and two cases' printed commands are also pasted into a real shell
(test_the_printed_commands_work_in_a_real_shell).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import shlex
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conformance.meta.preloaded import Preloaded
from conformance.meta.test_report_story import report_contradictions
from conformance.user.commands import CONVERTED
from conformance.user.example_draft import DROPPED_TENSOR, PLANTS, write_example
from conformance.user.servable import conversion_findings, directory_problem, served_ids
from conformance.user.verdict import EXIT_NOT_SERVED, EXIT_SERVED, Verdict
from conformance.core import registry
from conformance.core.findings import DIRECTORY, FORWARD, LOADING, OTHER, Problem
from fixtures.real_configs import REAL_CONFIGS

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2
HEADLINE = re.compile(r"^VERDICT: (served as trained|NOT served as trained: (\d+) problems?|"
                      r"not checked: (.+); what ran is served as trained)$", re.M)
NOT_CHECKED = 6   # the verdict's exit code for a run a missing input left incomplete (conformance/user/verdict.py)
LLAMA = REAL_CONFIGS / "target" / "meta-llama--Meta-Llama-3.1-8B.json"   # Llama class: id + 1, context 131072
# A chain within what the example draft covers: its 2048 positions (the Llama target's context is longer).
CHAIN_ARGS = ("--speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 "
              "--context-length 2048")
TREE_ARGS = "--speculative-eagle-topk 2 --speculative-num-steps 3 --speculative-num-draft-tokens 6"
WIRING, FLAGS = "target wiring (give --target-config)", "server flags (give --sglang-args)"
KIMI = REAL_CONFIGS / "target" / "moonshotai--Kimi-K2.5.json"     # 61 layers: SGLang's DeepSeek class
SEED_ARGS = "--speculative-eagle-topk 1 --speculative-num-steps 1 --speculative-num-draft-tokens 16"
TRAINED_ON = "--trained-aux-layers=embed,3,31"


def run_pytest(*args: str, timeout: int = 600, module: str = "pytest", cwd: Path = ROOT,
               **env: str) -> subprocess.CompletedProcess:
    """pytest (or `module`: the entry point) as a user runs it, from the repository root (or `cwd`), one thread per
    process; `env`: further environment variables."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    plugins = ("-p", "no:cacheprovider") if module == "pytest" else ()
    return subprocess.run([sys.executable, "-m", module, *plugins, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# How a user runs the verdict (Plant.how): make check's `pytest --draft-checkpoint=DIR` from the repository; from
# a directory outside it, `pytest -m cpu --draft-checkpoint DIR` (the option's space form; the plugin loaded by
# its pytest11 entry point) or the entry point `eagle3-conformance check DIR`, both with pytest-xdist disabled
# (a development tool a serving environment need not have, Makefile DEV_TOOLS).
MAKE_CHECK, PYTEST_OUTSIDE, ENTRY_POINT_OUTSIDE = "make check", "pytest outside", "entry point outside"
NO_XDIST = ("-p", "no:xdist")


def run_as_user(how: str, draft: Path, args: tuple[str, ...], report: Path, outside: Path,
                preloaded: Preloaded) -> subprocess.CompletedProcess:
    """The verdict on `draft` as `how` runs it, its report in `report`; `outside`: an empty directory outside the
    repository. make check's run is the same pytest session started from the preloaded process."""
    if how == MAKE_CHECK:
        return preloaded.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--draft-checkpoint={draft}",
                              f"--report={report}", *args])
    outside.mkdir(parents=True)
    if how == PYTEST_OUTSIDE:
        return run_pytest(*NO_XDIST, "-m", "cpu", "--draft-checkpoint", str(draft), "--report", str(report), *args,
                          cwd=outside)
    return run_pytest("check", str(draft), *args, "--report", str(report), "--", *NO_XDIST, module="conformance.cli",
                      cwd=outside)


@dataclass(frozen=True)
class Plant:
    id: str
    fmt: str
    plant: str | None
    exit: int
    problems: int | None      # the exact count, when the draft has exactly one thing wrong
    named: tuple[str, ...]    # what the verdict block must name: the cause's entry and file:line, the fix
    args: tuple[str, ...] = ()           # the run's options besides --draft-checkpoint
    eagle_ids: tuple[int, ...] | None = None   # config.json's eagle_config ids, rewritten for serving
    unchecked: tuple[str, ...] = ()      # exit 6: what the headline names as not checked, in order
    knobs: tuple[tuple[str, object], ...] = ()   # further config overrides of the example draft
    absent: tuple[str, ...] = ()         # what the verdict block must not say
    written: tuple[tuple[str, object], ...] = ()   # config.json keys rewritten as a user wrote them (ABSENT: removed)
    lane: str | None = None              # an implementation's own lane it needs (its tests' marker: plugin.own_lanes)
    how: str = MAKE_CHECK                # how the user runs it (run_as_user)


PLANTED = [
    Plant("norm_before_residual", "sglang", "norm_before_residual", 1, 1,
          ("sglang-residual-never-normed", "llama_eagle3.py:97-99", "stage `layers.0.residual`",
           "retrain without it: norm_before_residual false")),
    Plant("two_layers", "sglang", "two_layers", 1, None,
          ("sglang-hidden-norm-on-later-layers", "llama_eagle3.py:103-105", "retrain without it: num_hidden_layers 1")),
    Plant("attention_bias", "sglang", "attention_bias", 1, None,
          ("sglang-qkv-bias-dropped", "llama_eagle3.py:67-75", "retrain without it: attention_bias false")),
    Plant("sliding_window", "sglang", "sliding_window", 1, 1,
          ("sglang-config-window-ignored", "llama_eagle3.py:286-299", "--speculative-draft-window-size 3")),
    Plant("fc_skip", "sglang", "fc_skip", 1, 1,
          ("sglang-fc-skipped-when-widths-coincide", "llama_eagle3.py:238", "1 * 40 == 40")),
    Plant(DROPPED_TENSOR, "sglang", DROPPED_TENSOR, 1, None,
          ("dropped silently: fc.bias", "llama_eagle3.py:363, 373", "speculators 0.9.0 cannot load this draft"),
          ("--trainer=speculators",)),   # stated: only then is the trainer's refusal a problem
    Plant("speculators_format", "speculators", None, 1, 1,
          ("1. SGLang cannot read this directory as written", "Unrecognized model in draft",
           "transformers/models/auto/configuration_auto.py", "convert it into draft-sglang beside it",
           "-m conformance.user.convert ")),
]
CLEAN = [Plant(f"clean_{fmt}", fmt, None, NOT_CHECKED, 0, (), unchecked=(WIRING, FLAGS))
         for fmt in ("sglang", "sglang-legacy", "specforge")]
CLEAN += [Plant("clean_sglang_every_input", "sglang", None, 0, 0, (),
                (f"--target-config={LLAMA}", f"--sglang-args={CHAIN_ARGS}"))]
SEED = [
    Plant("kimi_seed", "sglang", None, 1, 1,
          ("1. SGLang feeds the draft other target layers than it was trained on (training: [embed, 3, 31]  "
           "serving: [3, 31, 59])", "slot 0: training embed, serving 3  <- differs",
           "slot 1: training 3, serving 31  <- differs", "slot 2: training 31, serving 59  <- differs",
           "deepseek_v2.py:", '"eagle_aux_hidden_state_layer_ids": [0, 3, 31]'),
          (f"--target-config={KIMI}", TRAINED_ON), (3, 31, 59)),
    Plant("kimi_rewired", "sglang", None, NOT_CHECKED, 0, (), (f"--target-config={KIMI}", TRAINED_ON), (0, 3, 31),
          unchecked=(FLAGS,)),
    Plant("seed_flags", "sglang", None, 1, 1,
          ("draft tokens silently reduced: 16 asked, 2 served", "speculative_num_draft_tokens is adjusted",
           "sglang/srt/arg_groups/speculative_hook.py:", "--speculative-num-draft-tokens"),
          (f"--sglang-args={SEED_ARGS}",)),
]
ISSUE_23 = [
    # A tree of 3 steps: the registry's tree entry applies, a problem with its reason and a chain as the fix.
    Plant("tree_flags", "sglang", None, 1, 1,
          ("sglang-tree-kv-follows-row-slots", "cache_locs.py:262-268", "--speculative-eagle-topk 1"),
          (f"--sglang-args={TREE_ARGS}",), absent=("--speculative-eagle-topk > 1",)),   # the old tree advice
    # SGLang's format does not say who trained it: judged against the reference, speculators' refusal of
    # target_hidden_size != hidden_size is no problem, and the trainers that could have written it are named.
    Plant("trainer_unknown", "sglang", None, NOT_CHECKED, 0,
          ("could have been trained by specforge 0.2.0", "not by speculators 0.9.0 (its loader refuses it: "
           "speculators-fc-ignores-target-hidden-size)"), unchecked=(WIRING, FLAGS),
          knobs=(("target_hidden_size", 32),), absent=("cannot load this draft",)),
]
# Issue 23's wrong points 9 and 10, where users run it: from a directory outside the repository, without
# pytest-xdist, pytest with the space form of --draft-checkpoint (the plugin crashed on xdist's hook, or was not
# loaded at all) and the entry point, each on a clean draft. (Wrong point 7, bad input that crashed, is
# meta/test_fuzz_inputs.py's regressions through real processes; 8 is meta/test_registry.py's exact matches.)
ISSUE_23 += [
    Plant("pytest_outside_the_repository", "sglang", None, NOT_CHECKED, 0, (), unchecked=(WIRING, FLAGS),
          how=PYTEST_OUTSIDE),
    Plant("entry_point_outside_the_repository", "sglang", None, 0, 0, (),
          ("--target-config", str(LLAMA), "--sglang-args", CHAIN_ARGS), how=ENTRY_POINT_OUTSIDE),
]
# Server settings that change the draft whatever the flag is called, none of them speculative_*: SGLang builds
# the draft with the target's flags (conformance/user/settings.py, the draft SGLang builds).
ROPE_SCALING = '{"rope_scaling": {"rope_type": "linear", "factor": 2.0}}'
SETTINGS = [
    Plant("kv_cache_fp8", "sglang", None, 1, 1,
          ("the draft's KV cache stores keys and values in torch.float8_e4m3fn",
           "server setting: kv_cache_dtype (from --kv-cache-dtype)", "sglang/srt/model_executor/model_runner.py:",
           "fix:      drop --kv-cache-dtype"),
          (f"--target-config={LLAMA}", f"--sglang-args={CHAIN_ARGS} --kv-cache-dtype fp8_e4m3")),
    Plant("rope_override_reaches_the_draft", "sglang", None, 1, 1,
          ("the draft's config is served otherwise (rope_parameters.rope_type, rope_parameters.factor)",
           "RotaryEmbedding -> LinearScalingRotaryEmbedding", "sglang/srt/configs/model_config.py:",
           "fix:      drop --json-model-override-args"),
          (f"--target-config={LLAMA}", f"--sglang-args={CHAIN_ARGS} --json-model-override-args '{ROPE_SCALING}'")),
    Plant("quantization_derived_for_the_draft", "sglang", None, 1, 1,
          ("the draft's weights are quantized at load (fp8)",
           "server setting: speculative_draft_model_quantization (from --quantization)",
           "sglang/srt/arg_groups/serving_hook.py:", "give --speculative-draft-model-quantization explicitly"),
          (f"--target-config={LLAMA}", f"--sglang-args={CHAIN_ARGS} --quantization fp8")),
]
ABSENT = "<absent>"
READINGS = [
    # A valid file read two ways: a tie flag with a pruned vocabulary and its own lm_head.weight. SGLang ties its
    # embedding as the head, speculators (the stated trainer) reads the stored head: one problem naming both
    # readings, each entry's file:line and the key to write, never bad input.
    Plant("tie_pruned_own_head", "sglang", None, 1, 1,
          ("sglang-ties-lm-head-to-embedding", "sglang 0.5.23: embed_tokens", "speculators 0.9.0: lm_head.weight",
           "llama_eagle3.py:303-304", "speculators/model.py:578", 'fix:      "tie_word_embeddings": false'),
          ("--trainer=speculators",), written=(("tie_word_embeddings", True),)),
    # vLLM is given the user's speculators config as written: without norm_before_residual it reads true where
    # speculators reads false (vLLM's own lane).
    Plant("absent_norm_before_residual_vllm", "speculators", None, 1, None,
          ("vllm-absent-norm-before-residual-is-true", "vllm 0.33.0: true", "speculators 0.9.0: false",
           "algos.py:33-35", '"norm_before_residual": false', "vllm: the directory as written"),
          ("--serve-with=vllm",), written=(("norm_before_residual", ABSENT),), lane="vllm"),
]
CASES = PLANTED + CLEAN + SEED + ISSUE_23 + SETTINGS + READINGS


def runnable(case: Plant) -> bool:
    """A case of an implementation's own lane runs only where that lane's environment is built."""
    from conformance.adapters import ADAPTERS

    return case.lane is None or not next(a for a in ADAPTERS.values() if a.lane == case.lane).missing()


@pytest.fixture(scope="module")
def preloaded(tmp_path_factory):
    process = Preloaded(tmp_path_factory.mktemp("preloaded"))
    yield process
    process.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request, preloaded) -> dict[str, Future]:
    """Every selected case's run, started at once, WORKERS at a time: (CompletedProcess, seconds)."""
    root = tmp_path_factory.mktemp("verdict")
    pool = ThreadPoolExecutor(WORKERS)

    def run(case: Plant, draft: Path):
        start = time.perf_counter()
        report = root / case.id / "report"
        result = run_as_user(case.how, draft, case.args, report, root / f"{case.id}-cwd", preloaded)
        return result, time.perf_counter() - start, report

    # The drafts are written here, one after the other: only the subprocesses run in threads (a first import
    # of a transformers class from two threads at once can fail inside its lazy module).
    selected = {item.callspec.params["case"].id for item in request.session.items
                if getattr(item, "function", None) in USING_RUNS}
    cases = [case for case in CASES if case.id in selected and runnable(case)]   # `-k` runs only what it selects
    drafts = {}
    for case in cases:
        drafts[case.id], _, _ = write_example(root / case.id, case.fmt, plant=case.plant, knobs=dict(case.knobs))
        if case.eagle_ids is not None:
            write_eagle_ids(drafts[case.id], case.eagle_ids)
        if case.written:
            write_keys(drafts[case.id], case.written)
    futures = {case.id: pool.submit(run, case, drafts[case.id]) for case in cases}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def write_eagle_ids(draft: Path, ids) -> None:
    """config.json rewritten for serving: eagle_config ids only, nothing else changed."""
    config = json.loads((draft / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    (draft / "config.json").write_text(json.dumps(config, indent=2))


def write_keys(draft: Path, written) -> None:
    """config.json with top-level keys set (or removed: ABSENT) as a user wrote them, nothing else changed."""
    config = json.loads((draft / "config.json").read_text())
    for key, value in written:
        if value == ABSENT:
            del config[key]
        else:
            config[key] = value
    (draft / "config.json").write_text(json.dumps(config, indent=2))


def verdict_block(stdout: str) -> str:
    return stdout[stdout.index("VERDICT: "):] if "VERDICT: " in stdout else ""


def registry_ids(report: Path) -> list[str]:
    """The registry entries the verdict's problems are (report.json; the terminal names them in words)."""
    problems = json.loads((report / "report.json").read_text())["verdict"]["problems"]
    return [p["registry_id"] for p in problems if p["registry_id"]]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_verdict_names_the_problem(case, runs):
    result, seconds, report = runs[case.id].result()
    out = result.stdout + result.stderr
    assert result.returncode == case.exit, \
        f"exit {result.returncode}, expected {case.exit} ({seconds:.0f} s):\n{out[-6000:]}"
    assert not (found := report_contradictions(report)), "report.md or the chart says otherwise:\n" + "\n".join(found)
    heads = HEADLINE.findall(result.stdout)
    assert len(heads) == 1, f"expected one verdict line:\n{out[-6000:]}"
    block = verdict_block(result.stdout)
    for words in case.named:
        assert words in block or words in registry_ids(report), f"{words!r} not in the verdict:\n{block}"
    for words in case.absent:
        assert words not in block, f"{words!r} in the verdict:\n{block}"
    if case.exit == 0:
        assert heads[0][0] == "served as trained", heads
        return
    if case.exit == NOT_CHECKED:
        assert heads[0][2] == ", ".join(case.unchecked), heads
        return
    count = int(heads[0][1])
    assert count >= 1 and (case.problems is None or count == case.problems), f"{heads[0][0]}:\n{verdict_block(out)}"
    for n in range(1, count + 1):   # each problem numbered, with its five parts
        item = block.split(f"\n{n}. ", 1)[1]
        assert all(f"   {part}:" in item for part in ("where", "evidence", "cause", "fix")), item


NOT_SERVED = [c for c in CASES if c.exit == 1]
FIXES = re.compile(r"^fix (?P<numbers>[\d, ]+) and check again \(paste from any directory\):$", re.M)
PROBLEM = re.compile(r"^(\d+)\. (.+)$", re.M)
REPRO = re.compile(r"^(?P<failed>.+) \(in the verdict below\)\n  repro: (?P<command>.+)$", re.M)


@dataclass(frozen=True)
class Printed:
    """The commands a run printed: each failed check with its `repro:` line, and the verdict's fixes."""
    problems: dict[int, str]              # the verdict's numbered problems
    repros: list[tuple[str, str]]         # (the failed check's words, its repro command)
    fixed: list[int]                      # the problems the fix commands fix
    fixes: list[str]                      # the fix commands, the check of the fixed draft last

    @classmethod
    def of(cls, stdout: str) -> "Printed":
        block = verdict_block(stdout)
        fixed, fixes = [], []
        if m := FIXES.search(block):
            fixed = [int(n) for n in m["numbers"].split(", ")]
            for line in block[m.end():].splitlines()[1:]:
                if not line.startswith("  "):
                    break
                fixes.append(line.strip())
        problems = {int(n): what for n, what in PROBLEM.findall(block)}
        return cls(problems, [(m["failed"], m["command"]) for m in REPRO.finditer(stdout)], fixed, fixes)

    @property
    def commands(self) -> list[str]:
        return [command for _, command in self.repros] + self.fixes


@pytest.mark.parametrize("case", NOT_SERVED, ids=lambda c: c.id)
def test_every_printed_command_is_pasteable(case, runs):
    """Every `repro:` and fix command the run printed is the user's own check with the user's own options and
    names its files by absolute paths that exist (test_the_printed_commands_do_what_they_say runs them)."""
    result, _, report = runs[case.id].result()
    assert not (found := unpasteable(result.stdout, case.args, report)), "\n".join(found)


def unpasteable(stdout: str, args: tuple[str, ...], report: Path) -> list[str]:
    """What keeps a printed command from being pasted from another directory and doing what it says."""
    commands = Printed.of(stdout).commands
    found = [] if commands else [f"no repro or fix command printed:\n{stdout[-3000:]}"]
    for command in commands:
        words = shlex.split(command)
        if not (Path(words[0]).is_absolute() and Path(words[0]).exists()):
            found.append(f"{command}: {words[0]} is not an absolute path to a program")
        paths = [w.split("=", 1)[-1] for w in words[1:]]
        # the directories a check or the converter takes, and every option's file
        named = [w for w in words[words.index("check") + 1:][:1]] if "check" in words else \
            [w for w in words[words.index("conformance.user.convert") + 1:] if not w.startswith("-")] \
            if "conformance.user.convert" in words else []
        named += [w.split("=", 1)[1] for w in words if w.startswith("--") and "/" in w.split("=", 1)[-1]]
        found += [f"{command}: {w} is relative" for w in named if not w.startswith("/")]
        found += [f"{command}: no such file {w}" for w in paths if w.startswith("/") and not Path(w).exists()
                  and not w.endswith(CONVERTED) and Path(w) != report]   # what a fix writes, the report it writes
        if " check " not in command and "conformance.user.convert" not in command:
            found.append(f"{command}: neither the user's check nor this suite's converter")
        found += [f"{command} drops {option}" for option in args if " check " in command
                  and option.partition("=")[0] != "--sglang-args" and option.partition("=")[2] not in command]
    return found


@pytest.mark.parametrize("case", NOT_SERVED, ids=lambda c: c.id)
def test_the_terminal_is_the_verdict_without_noise(case, runs):
    """No captured output or library logs, no warnings summary, none of the suite's own file paths or registry
    ids, no tolerance formula: the verdict is the last thing printed, on two screens at most."""
    result, _, _ = runs[case.id].result()
    out = result.stdout
    for noise in ("Captured", "DEBUG", "warnings summary", "short test summary", "conformance/user/test_",
                  "allowed: atol", "per implementation pair and stage"):
        assert noise not in out, f"{noise!r} in the terminal:\n{out}"
    for known in REGISTRY_IDS:
        assert known not in out, f"registry id {known!r} in the terminal:\n{out}"
    assert out.rstrip().splitlines()[-1].startswith("  ") and verdict_block(out).count("\n") > 8, out[-3000:]
    assert len(out.splitlines()) < 100, f"{len(out.splitlines())} lines:\n{out}"


def test_an_unpasteable_command_is_caught(tmp_path):
    """The repro lines this suite printed before (a bare test id, checking a built-in draft) and a relative fix."""
    draft = tmp_path / "draft"
    draft.mkdir()
    python = shlex.quote(sys.executable)
    printed = ("check failed (in the verdict below)\n"
               f"  repro: {python} -m pytest 'conformance/user/test_user_draft.py::test_user_draft_step0[sglang]'\n"
               "VERDICT: NOT served as trained: 1 problem\n"
               "fix 1 and check again (paste from any directory):\n"
               f"  {python} -m conformance.user.convert draft draft-sglang\n"
               f"  {python} -m conformance.cli check {draft}-sglang --report={tmp_path / 'report'}\n")
    found = unpasteable(printed, (f"--target-config={tmp_path / 'config.json'}",), tmp_path / "report")
    assert any("neither the user's check" in f for f in found), found
    assert any("draft-sglang is relative" in f for f in found), found
    assert any("drops --target-config" in f for f in found), found
    (tmp_path / "config.json").write_text("{}")
    fixed = (printed.replace(" draft draft-sglang", f" {draft} {draft}-sglang")
             .replace("-m pytest 'conformance/user/test_user_draft.py::test_user_draft_step0[sglang]'",
                      f"-m conformance.cli check {draft} --target-config={tmp_path / 'config.json'}")
             .replace(" --report=", f" --target-config={tmp_path / 'config.json'} --report="))
    assert unpasteable(fixed, (f"--target-config={tmp_path / 'config.json'}",), tmp_path / "report") == []



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


def test_a_server_that_cannot_run_is_bad_input(tmp_path):
    """--serve-with vllm without vLLM's environment: exit 4, one line saying how to build it, both from pytest
    (make check) and from the entry point, never a verdict on checks that were all skipped."""
    draft, _, _ = write_example(tmp_path, "sglang")
    missing = str(tmp_path / "no-venv-vllm")   # VLLM_VENV: where the vLLM lane looks for its environment
    runs = {"pytest": run_pytest(f"--draft-checkpoint={draft}", "--serve-with=vllm", VLLM_VENV=missing),
            "entry point": run_pytest("check", str(draft), "--serve-with", "vllm", "--report", str(tmp_path / "r"),
                                      module="conformance.cli", VLLM_VENV=missing)}
    for name, result in runs.items():
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        assert result.returncode == 4, f"{name}: exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr}"
        assert len(lines) == 1 and "--serve-with vllm" in lines[0] and "make venv-vllm" in lines[0], (name, lines)


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
    assert "convert it into eagle-sglang beside it" in found.fix, found


def test_the_conversion_check_names_what_a_conversion_lost(converted, tmp_path):
    """A conversion that drops a norm tensor, shifts the aux ids and loses fc_norm: each one named."""
    from conformance.checkpoints.directory import open_checkpoint
    from conformance.adapters import account
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


# ---------------------------------------------------------------- the printed commands, run (last: a repro writes the
# user's report directory again, as it does for the user)

REGISTRY_IDS = [entry.id for entry in registry.REGISTRY]
SHELL_PASTED = ("speculators_format", "seed_flags")   # a conversion and changed server flags: pasted into a shell


@pytest.mark.parametrize("case", NOT_SERVED, ids=lambda c: c.id)
def test_the_printed_commands_do_what_they_say(case, runs, preloaded, tmp_path):
    """From a directory of its own: each `repro:` line fails again with its problem; the fixes exit 0 and the check
    after them no longer names a problem they fix (a fix that is no command, such as retraining, prints none)."""
    result, _, _ = runs[case.id].result()
    printed = Printed.of(result.stdout)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert printed.repros, f"no repro line:\n{result.stdout[-6000:]}"
    for failed, command in printed.repros:
        again = preloaded.run(shlex.split(command), cwd=elsewhere)
        assert again.returncode == EXIT_NOT_SERVED and failed in Printed.of(again.stdout).problems.values(), \
            f"{command}\nexit {again.returncode}, expected {EXIT_NOT_SERVED} naming {failed!r}:\n{again.stdout[-6000:]}"
    assert_fixes_fix(printed, lambda command: preloaded.run(shlex.split(command), cwd=elsewhere))


def assert_fixes_fix(printed: Printed, run) -> None:
    if not printed.fixes:
        return
    assert printed.fixed and set(printed.fixed) <= set(printed.problems), printed
    *fixes, check = printed.fixes
    assert " check " in check, check
    # what the fixes write (the converter's copy beside the draft), removed after: each paste starts as the user's
    written = [Path(w) for command in fixes for w in shlex.split(command) if w.endswith(CONVERTED)]
    assert not any(path.exists() for path in written), written
    try:
        for command in fixes:
            done = run(command)
            assert done.returncode == 0, \
                f"{command}\nexit {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        again = run(check)
    finally:
        for path in written:
            shutil.rmtree(path, ignore_errors=True)
    out = again.stdout + again.stderr
    assert again.returncode in (EXIT_SERVED, NOT_CHECKED), f"{check}\nexit {again.returncode}:\n{out[-6000:]}"
    left = set(Printed.of(again.stdout).problems.values())
    assert not {printed.problems[n] for n in printed.fixed} & left, f"{check}: still {left}"


@pytest.mark.parametrize("case", [c for c in NOT_SERVED if c.id in SHELL_PASTED], ids=lambda c: c.id)
def test_the_printed_commands_work_in_a_real_shell(case, runs, tmp_path):
    """The same commands as a user pastes them: a shell, a new interpreter, another directory."""
    result, _, _ = runs[case.id].result()
    printed = Printed.of(result.stdout)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def shell(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)

    failed, command = printed.repros[0]
    again = shell(command)
    assert again.returncode == EXIT_NOT_SERVED and failed in Printed.of(again.stdout).problems.values(), \
        f"{command}\nexit {again.returncode}:\n{again.stdout[-6000:]}{again.stderr[-3000:]}"
    assert_fixes_fix(printed, shell)


USING_RUNS = (test_the_verdict_names_the_problem, test_every_printed_command_is_pasteable,
              test_the_terminal_is_the_verdict_without_noise, test_the_printed_commands_do_what_they_say,
              test_the_printed_commands_work_in_a_real_shell)
