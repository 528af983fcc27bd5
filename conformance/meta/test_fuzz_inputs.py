"""The fuzz campaign: bad input never crashes the verdict.

Hypothesis draws mutants of valid inputs of every kind the verdict reads (conformance/meta/input_mutants.py):
config.json in each checkpoint format (wrong types, missing and extra keys, nested blocks, absurd sizes),
the safetensors files (header corruption, dtype, shape and name changes, truncation, non-finite values),
model.safetensors.index.json, the JSONL training samples, the hidden-state dump and the target config.
Each feeds the verdict's own input path:
  - in process, every mutant: configure_user_inputs (what pytest_configure runs before anything loads),
    then, for inputs it accepts, what the run loads from them (the user's case and its batch, the copies
    each implementation reads, the reference's forward on them);
  - through a real subprocess, a sample: `pytest --draft-checkpoint ...` or the entry point.
Every mutant ends in a clean result or the suite's one-line bad-input error (exit 4): one line, naming an
input file and a field, never the safety net's "could not be validated" (a validation bug); never a
traceback, an INTERNALERROR or exit 3; the inputs byte-identical afterwards.

Profiles (the Hypothesis profile loaded, conformance/plugin.py): `ci`, in `make test`, derandomized (the
same mutants every run); `nightly` (`make nightly`), random and many more. REGRESSIONS are the bugs
the campaign found, each replayed first with the message its fix gives.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from conformance.checkpoints import INDEX_FILE
from conformance.session.harness import LoadFailed
from conformance.meta.input_mutants import DATA, DUMP, INPUTS, Mutant, digests, mutants, write_bases
from conformance.user import store as user_store
from conformance.user.store import UserDraftStore
from conformance.user.user_draft import INPUTS_KEY, UNEXPECTED, configure_user_inputs
from conformance.user.verdict import EXIT_BAD_INPUT, EXIT_NOT_CHECKED, EXIT_NOT_SERVED, EXIT_SERVED

pytestmark = [pytest.mark.cpu, pytest.mark.meta]
ROOT = Path(__file__).resolve().parents[2]
VERDICT_EXITS = (EXIT_SERVED, EXIT_NOT_SERVED, EXIT_NOT_CHECKED)
STEPS = 2   # the reference's forward on an accepted mutant: step 0 and one teacher-forced step


@dataclass(frozen=True)
class Profile:
    in_process: int      # mutants drawn (Hypothesis examples)
    subprocess: int      # of them, run again through a real pytest / entry-point process
    full_runs: int       # of those, accepted ones through the whole verdict (a minute each)
    derandomize: bool
    forked: bool         # all but two of the sample forked from one interpreter (forked_runs.py)
    inputs: tuple = INPUTS


# ci leaves out training data without a dump: the aux states then come from a transformers target as deep as
# the highest aux id the mutant says (conformance/checkpoints/hidden_states.py), seconds per mutant.
CI_INPUTS = tuple(i for i in INPUTS if i != (DATA,))
PROFILES = {"ci": Profile(200, 10, 0, True, True, CI_INPUTS), "dev": Profile(200, 10, 0, False, True),
            "nightly": Profile(5000, 40, 4, False, False)}


def profile() -> tuple[str, Profile]:
    name = settings.get_current_profile_name()
    return (name, PROFILES[name]) if name in PROFILES else ("ci", PROFILES["ci"])


# ---------------------------------------------------------------- the verdict's input path, in process

@dataclass(frozen=True)
class Outcome:
    bad: str | None      # the one-line usage error, or None: accepted and loaded


class Options:
    """The two members of pytest's config that configure_user_inputs reads."""

    def __init__(self, options: dict[str, str]):
        self.options, self.stash = options, pytest.Stash()

    def getoption(self, name):
        return self.options.get(name)


def in_process(mutant: Mutant, root: Path, scratch: Path) -> Outcome:
    """configure_user_inputs on the mutant's inputs, then what a run loads from inputs it accepts."""
    options = Options(mutant.options(root))
    try:
        configure_user_inputs(options)
    except pytest.UsageError as exc:
        return Outcome(str(exc))
    load(options.stash[INPUTS_KEY], scratch)
    return Outcome(None)


def load(inputs, scratch: Path) -> None:
    """The user's case, its samples and aux states, the copies each implementation reads, and the reference's
    forward on its own copy (speculators' format: a round trip through this suite's converter), which must be
    finite. --target-config's twin (SGLang's class of the target, for a conversion's ids) is SGLang's, left to
    the engine's own checks: the conversion here writes the Llama convention's ids."""
    store = UserDraftStore(scratch, dataclasses.replace(inputs, target_file=None))
    store.report_rows()
    store.checkpoint(store.case)
    try:
        trace = store.trace("reference", store.case, torch.float64, STEPS)
    except LoadFailed as exc:
        raise AssertionError(f"validation accepted what the reference cannot load: {exc}") from None
    bad = sorted({stage for step in trace.steps for stage, t in step.items()
                  if t.is_floating_point() and not bool(torch.isfinite(t).all())})
    assert not bad, f"validation accepted inputs on which the reference computes NaN/inf: {bad[:5]}"


def check(outcome: Outcome, root: Path, before: dict, after: dict) -> None:
    """One line naming an input file and a field, from the validation itself; the inputs untouched."""
    assert before == after, f"the run changed input files: {sorted(k for k in before if before[k] != after.get(k))}"
    if outcome.bad is None:
        return
    message = outcome.bad
    assert "\n" not in message, f"not one line:\n{message}"
    assert UNEXPECTED not in message, f"a validation bug, caught by the safety net: {message}"
    file, _, rest = message.partition(": ")
    field, _, problem = rest.partition(": ")
    assert Path(file).is_relative_to(root), f"names {file}, not an input file: {message}"
    assert field and problem, f"names no field: {message}"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return write_bases(tmp_path_factory.mktemp("fuzz-bases"))


@pytest.fixture
def lazy_sglang(monkeypatch):
    """UserDraftStore imports SGLang's lazily failing modules for the SGLang models it builds; none is built
    here (8 s of import in a process that may have no other use for SGLang)."""
    monkeypatch.setattr(user_store, "SGLANG_LAZY_IMPORTS", ())


def run(mutant: Mutant, by_id: dict, root: Path) -> Outcome:
    inputs = mutant.write(by_id, root / "in")
    try:
        before = digests(inputs)
        outcome = in_process(mutant, inputs, root / "scratch")
        check(outcome, inputs, before, digests(inputs))
    finally:   # 5,000 copies of the inputs would fill a disk
        shutil.rmtree(root, ignore_errors=True)
    return outcome


# ---------------------------------------------------------------- the bugs found, replayed

@dataclass(frozen=True)
class Regression:
    id: str
    mutant: Mutant
    words: str    # what the one line says after the file


def config(*ops, base="sglang", inputs=()) -> Mutant:
    return Mutant(base, inputs, tuple(("json", "draft/config.json", *op) for op in ops))


REGRESSIONS = [
    # An INTERNALERROR and exit 3 before: `"sliding_attention" in True` (knobs.py).
    Regression("layer_types_true", config(("set", ("layer_types",), True)),
               "config.json: field layer_types: expected a list of strings, got True"),
    # An INTERNALERROR and exit 3 before: `ckpt_dir / 3` (weights.py).
    Regression("weight_map_value_not_a_string",
               Mutant("sharded", (), (("json", f"draft/{INDEX_FILE}", "set", ("weight_map", "fc.weight"), 3),)),
               "model.safetensors.index.json: field weight_map.fc.weight: expected the file name of a shard"),
    # A shard outside the draft's directory was read.
    Regression("weight_map_value_outside_the_directory",
               Mutant("sharded", (), (("json", f"draft/{INDEX_FILE}", "set", ("weight_map", "fc.weight"),
                                       "../model.safetensors"),)),
               "field weight_map.fc.weight: expected the file name of a shard in draft, got '../model.safetensors'"),
    # Never typed before: a failure inside a check later (exit 1), from the reference's RoPE.
    Regression("rope_theta_in_rope_parameters_a_string",
               config(("add", (), "rope_parameters", {"rope_type": "default", "rope_theta": "1e4"})),
               "config.json: field rope_parameters.rope_theta: expected a positive number, got '1e4'"),
    Regression("rope_theta_in_speculators_rope_parameters_a_string",
               config(("set", ("transformer_layer_config", "rope_parameters", "rope_theta"), "1e4"),
                      base="speculators"),
               "field transformer_layer_config.rope_parameters.rope_theta: expected a positive number, got '1e4'"),
    Regression("yarn_beta_a_string",
               config(("set", ("rope_scaling",), {"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"})),
               "field rope_scaling.beta_fast: expected a positive number, got '32'"),
    # NaN and 1e999 (inf) are read by Python's JSON reader and were accepted as an epsilon or a base.
    Regression("nan_rms_norm_eps", config(("set", ("rms_norm_eps",), float("nan"))),
               "field rms_norm_eps: NaN is not a JSON number"),
    Regression("infinite_rope_theta", config(("set", ("rope_theta",), float("inf"))),
               "field rope_theta: Infinity is not a JSON number"),
    Regression("rope_theta_1e999", Mutant("sglang", (), (("text", "draft/config.json", "replace",
                                                          '"rope_theta": 10000.0', '"rope_theta": 1e999'),)),
               "field rope_theta: inf is not a finite number"),
    # Absurd sizes: a schema of 2**31 layers was built (minutes, gigabytes), a tiny target 10**9 layers deep.
    Regression("absurd_layer_count", config(("set", ("num_hidden_layers",), 2 ** 31 - 1)),
               "tensor layers.1.input_layernorm.weight: missing (needed because num_hidden_layers is 2147483647)"),
    Regression("absurd_aux_layer_id", config(("set", ("eagle_config", "eagle_aux_hidden_state_layer_ids"),
                                              [1, 3, 10 ** 9])),
               "field eagle_config.eagle_aux_hidden_state_layer_ids: layer id 1000000000 is outside [-1, 1024]"),
    Regression("absurd_context", config(("set", ("max_position_embeddings",), 2 ** 31)),
               "field max_position_embeddings: 2147483648 is absurdly large"),
    # A RecursionError in json's reader (an INTERNALERROR before).
    Regression("deeply_nested_config", Mutant("sglang", (), (("text", "draft/config.json", "deep", 100_000),)),
               "config.json: line 1: not valid JSON here (nested too deeply)"),
    Regression("deeply_nested_jsonl_line", Mutant("sglang", (DATA,), (("line", DATA, "raw", 1,
                                                                       "[" * 100_000 + "]" * 100_000),)),
               "train.jsonl: line 2: not valid JSON here (nested too deeply)"),
    # A dump in fp8: torch.isfinite is not implemented for it (a RuntimeError inside the validation).
    Regression("dump_in_fp8", Mutant("sglang", (DATA, DUMP), (("tensor", f"{DUMP}/hs_0.safetensors", "cast",
                                                               "hidden_states", "float8_e4m3fn"),)),
               "hs_0.safetensors: tensor hidden_states: dtype float8_e4m3fn, expected a float dtype"),
    Regression("float_token_ids", Mutant("sglang", (DATA, DUMP), (("tensor", f"{DUMP}/hs_1.safetensors", "cast",
                                                                   "token_ids", "float64"),)),
               "hs_1.safetensors: tensor token_ids: float64 of shape (6,), expected integer ids"),
]


@pytest.mark.parametrize("regression", REGRESSIONS, ids=lambda r: r.id)
def test_a_bug_the_campaign_found_stays_fixed(regression, bases, lazy_sglang, tmp_path):
    outcome = run(regression.mutant, {b.id: b for b in bases}, tmp_path)
    assert outcome.bad is not None and regression.words in outcome.bad, outcome


# Issue 23's wrong point 7, as a user met it: the inputs that ended in an INTERNALERROR and exit 3, or in a
# failure inside a check, each through a real process (pytest from the repository, the entry point from an
# empty directory): exit 4 and the one line naming the file and the field, no traceback.
CRASHED = ("layer_types_true", "weight_map_value_not_a_string", "rope_theta_in_rope_parameters_a_string")


def test_what_crashed_is_one_line_through_real_processes(bases, lazy_sglang, tmp_path):
    by_id = {b.id: b for b in bases}
    picked = [r for r in REGRESSIONS if r.id in CRASHED]
    sample = [(r.mutant, run(r.mutant, by_id, tmp_path / f"m{i}")) for i, r in enumerate(picked)]
    results = through_processes(sample, by_id, tmp_path / "sub", forked=False)
    assert len(results) == len(CRASHED)
    for regression, (mutant, expected), (inputs, result) in zip(picked, sample, results):
        assert expected.bad is not None and regression.words in expected.bad, (regression.id, expected)
        check_process(mutant, expected, inputs, result)   # exit 4, exactly that one line, no INTERNALERROR
        assert "Traceback" not in result.output, result.output[-4000:]


def test_the_safety_net_is_one_line_naming_the_file(bases, monkeypatch, tmp_path):
    """An exception of the validation itself (a bug, planted here) is one line naming the file, and the check
    of the campaign calls it a bug."""
    from conformance.user import user_draft

    def broken(path):
        raise TypeError("planted")

    monkeypatch.setattr(user_draft, "load_samples", lambda *a: broken(a))
    mutant = Mutant("sglang", (DATA,), ())
    root = mutant.write({b.id: b for b in bases}, tmp_path / "in")
    outcome = in_process(mutant, root, tmp_path / "scratch")
    assert outcome.bad == f"{root / DATA}: file: {UNEXPECTED}: TypeError: planted)", outcome
    with pytest.raises(AssertionError, match="a validation bug"):
        check(outcome, root, {}, {})


# ---------------------------------------------------------------- the campaign

def test_no_mutant_crashes_the_verdict(bases, lazy_sglang, tmp_path, capsys):
    """The profile's mutants in process, then a sample of them through real processes."""
    name, chosen = profile()
    by_id = {b.id: b for b in bases}
    seen: list[tuple[Mutant, Outcome]] = []
    counter = iter(range(10 ** 9))
    start = time.perf_counter()

    @settings(max_examples=chosen.in_process, derandomize=chosen.derandomize, database=None, deadline=None,
              phases=(Phase.generate,) if chosen.derandomize else (Phase.generate, Phase.shrink),
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(mutants(bases, chosen.inputs))
    def fuzz(mutant):
        outcome = run(mutant, by_id, tmp_path / f"m{next(counter)}")
        seen.append((mutant, outcome))

    fuzz()
    middle = time.perf_counter()
    assert len(seen) >= chosen.in_process, f"{len(seen)} mutants run, the {name} profile asks {chosen.in_process}"
    sample = subprocess_sample(seen, chosen)
    results = through_processes(sample, by_id, tmp_path / "sub", forked=chosen.forked)
    for (mutant, expected), (root, result) in zip(sample, results):
        check_process(mutant, expected, root, result)
    end = time.perf_counter()
    accepted = sum(o.bad is None for _, o in seen)
    with capsys.disabled():   # the figures, to the terminal only
        print(f"\nfuzz ({name}): {len(seen)} mutants in process ({accepted} accepted, {len(seen) - accepted} "
              f"bad input) in {middle - start:.1f} s; {len(sample)} through subprocesses in {end - middle:.1f} s")


def subprocess_sample(seen: list, chosen: Profile) -> list[tuple[Mutant, Outcome]]:
    """Rejected mutants of as many kinds of file as there are (the field that names them), and, for a
    profile with full runs, accepted ones."""
    rejected = [(m, o) for m, o in seen if o.bad is not None]
    by_field: dict[str, list] = {}
    for m, o in rejected:
        file, field = o.bad.split(": ")[:2]
        by_field.setdefault(f"{Path(file).name}: {field.split(' ')[0]}", []).append((m, o))
    picked, groups = [], list(by_field.values())
    while len(picked) < chosen.subprocess - chosen.full_runs and any(groups):
        for group in groups:
            if group and len(picked) < chosen.subprocess - chosen.full_runs:
                picked.append(group.pop(0))
    return picked + [(m, o) for m, o in seen if o.bad is None][:chosen.full_runs]


def through_processes(sample: list, by_id: dict, root: Path, forked: bool) -> list[tuple[Path, "Run"]]:
    """Each mutant written afresh and run by a real process: alternately `python -m pytest` from the repository
    and the entry point (`python -m conformance.cli check`) from an empty directory. The first two start an
    interpreter of their own, as a user's command does; with `forked`, the others are forked from one that has
    imported the libraries once (conformance/meta/forked_runs.py), two at a time, beside those two."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    jobs = []
    for i, (mutant, _) in enumerate(sample):
        inputs = mutant.write(by_id, root / f"p{i}")
        options = mutant.options(inputs)
        if i % 2 == 0:
            module, cwd = "pytest", ROOT
            argv = ["-p", "no:cacheprovider", *(f"{k}={v}" for k, v in options.items())]
        else:
            module, cwd = "conformance.cli", root / f"cwd{i}"
            cwd.mkdir()
            flags = {"--training-data": "--data", "--hidden-states": "--hidden", "--target-config": "--target-config"}
            argv = ["check", options.pop("--draft-checkpoint"), *(f"{flags[k]}={v}" for k, v in options.items()),
                    "--report", str(root / f"report{i}")]
        jobs.append(dict(module=module, argv=argv, cwd=str(cwd), output=str(root / f"out{i}.txt"), inputs=inputs,
                         before=digests(inputs)))

    def fresh(job) -> int:
        with open(job["output"], "w") as out:
            return subprocess.run([sys.executable, "-m", job["module"], *job["argv"]], cwd=job["cwd"], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode

    def from_one_interpreter(batch) -> list[int]:
        wire = [{k: job[k] for k in ("module", "argv", "cwd", "output")} for job in batch]
        done = subprocess.run([sys.executable, "-m", "conformance.meta.forked_runs"], input=json.dumps(wire),
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-4000:]
        return [r["returncode"] for r in json.loads(done.stdout)]

    own, shared = (jobs[:2], jobs[2:]) if forked else (jobs, [])
    with ThreadPoolExecutor(3 if shared else 2) as pool:   # the interpreter to fork from starts beside the two
        forks = pool.submit(from_one_interpreter, shared) if shared else None
        codes = list(pool.map(fresh, own)) + (forks.result() if forks else [])
    out = []
    for job, code in zip(jobs, codes):
        assert digests(job["inputs"]) == job["before"], f"the run changed input files of {job['argv']}"
        out.append((job["inputs"], Run(code, Path(job["output"]).read_text(errors="replace"))))
    return out


@dataclass(frozen=True)
class Run:
    returncode: int
    output: str


def check_process(mutant: Mutant, expected: Outcome, inputs: Path, result: Run) -> None:
    out = result.output
    assert "INTERNALERROR" not in out, f"{mutant}:\n{out[-4000:]}"
    if expected.bad is None:   # the whole verdict ran: a verdict, 0, 1 or 6 (a failed check prints its traceback;
        # without --target-config and --sglang-args a run is incomplete: 6 names what was not checked)
        assert result.returncode in VERDICT_EXITS, f"{mutant}: exit {result.returncode}\n{out[-4000:]}"
        assert out.count("\nVERDICT: ") == 1, f"{mutant}: no verdict\n{out[-4000:]}"
        return
    lines = [line for line in out.splitlines() if line.strip()]
    assert result.returncode == EXIT_BAD_INPUT, f"{mutant}: exit {result.returncode}, expected 4\n{out[-4000:]}"
    # The same line as in process: the process's inputs are another copy, written by the same operations.
    again = in_process(mutant, inputs, inputs.parent / f"{inputs.name}-scratch")
    assert lines == [f"ERROR: {again.bad}"], f"{mutant}: {lines}"
