"""pytest wiring: options, the GPU gate, session fixtures, the repro line and the report.

A plugin module rather than the root conftest.py, so that the installed package carries it: pytest loads it
by its `pytest11` entry point (pyproject.toml) wherever the package is installed, the root conftest.py in a
repository that is not, `eagle3-conformance` (conformance/cli.py) with `-p`. All three name it by its module
name, `conformance.plugin`: pytest registers a module once per name, and refuses the same module a second time
under another name. Its pytest-xdist hooks are in conformance/plugin_xdist.py, registered only with xdist."""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from conformance.session.report import Report

from conformance.adapters import DEFAULT_SERVER as SERVE_WITH_DEFAULT, versions
from conformance.session.report_render import terminal_lines
from conformance.user.trainer import CHOICES as TRAINER_CHOICES


# Hypothesis profiles: `ci` (the default: derandomized, so every run draws the same examples), `dev`
# (random, for exploring) and `nightly` (many more examples). Select with --hypothesis-profile NAME.
# ci does not shrink: a failing example is reported at once (its labelled draws print the config),
# and the same example is drawn again on every run.
CI_PHASES = (Phase.explicit, Phase.reuse, Phase.generate)
_HYPOTHESIS = dict(deadline=None, print_blob=True,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
settings.register_profile("ci", max_examples=12, derandomize=True, phases=CI_PHASES, **_HYPOTHESIS)
settings.register_profile("dev", max_examples=25, **_HYPOTHESIS)
settings.register_profile("nightly", max_examples=400, **_HYPOTHESIS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    group = parser.getgroup("eagle3-conformance")
    group.addoption("--report", metavar="DIR", default=None,
                    help="write report.json, report.md and stage_error.png to DIR (also when tests fail)")
    group.addoption("--stage-table", action="store_true",
                    help="print the per-stage max abs/rel error table at the end (implied by --report, except on "
                         "your draft: --draft-checkpoint)")
    group.addoption("--require-gpu", action="store_true",
                    help="fail, instead of skipping, gpu tests when CUDA is not available (and the CUDA engine "
                         "lane's, -m \"engine and gpu\", when SGLang's CUDA kernels are not installed: "
                         "requirements-gpu.lock)")
    group.addoption("--draft-checkpoint", metavar="DIR", default=None,
                    help="your EAGLE-3 draft (speculators, SGLang, legacy SGLang, SpecForge or EAGLE-3 format): runs "
                         "only the checks on your inputs and ends with one verdict (exit 0 served as trained, "
                         "1 not, 4 bad input, 6 not checked: an input a check needs was not given, the verdict "
                         "names the option)")
    group.addoption("--trainer", default="auto", choices=TRAINER_CHOICES,
                    help="how the draft was trained, i.e. what its aux-layer ids mean, when the checkpoint does not "
                         "say it (default: detected from the checkpoint)")
    group.addoption("--trained-aux-layers", metavar="LAYERS", default=None,
                    help="the target layers training captured, one per aux slot, e.g. embed,3,31 (the input of "
                         "layer i; embed = the embeddings), when the checkpoint's config.json was rewritten for "
                         "serving and no longer says it (replaces what the ids say)")
    group.addoption("--with-matrix", action="store_true",
                    help="with --draft-checkpoint: run the built-in matrix too (its known divergences stay xfails)")
    group.addoption("--training-data", metavar="FILE", default=None,
                    help="JSONL training samples (input_ids, loss_mask, seq_len, n_prompt_tokens, n_response_tokens, "
                         "source): the draft's inputs (needs --draft-checkpoint)")
    group.addoption("--hidden-states", metavar="DIR", default=None,
                    help="the samples' aux hidden states in speculators' datagen layout (hs_<i>.safetensors); "
                         "default: a tiny random target for tiny drafts, else seeded random")
    group.addoption("--target-config", metavar="FILE", default=None,
                    help="the target model's config.json, for the wiring and embedding checks")
    group.addoption("--sglang-args", metavar="ARGS", default=None,
                    help="an SGLang server command line (e.g. \"--speculative-eagle-topk 1 --speculative-num-steps 3 "
                         "--speculative-num-draft-tokens 4\"): resolved by SGLang's own ServerArgs; the report lists "
                         "requested vs effective speculative settings, and a setting served differently fails")
    group.addoption("--serve-with", default=SERVE_WITH_DEFAULT, choices=serve_with_choices(),
                    help="the server(s) your draft is checked against: " + ", ".join(serve_with_choices()) +
                         f" (default {SERVE_WITH_DEFAULT}; a server in an environment of its own, e.g. vLLM, needs "
                         "it built: make venv-vllm)")
    group.addoption("--bench-baselines", metavar="DIR", default=None,
                    help="benchmark baselines root: stored and compared under DIR/<machine class>/ "
                         "(sets --benchmark-storage; see conformance/throughput/throughput.py)")


def serve_with_choices() -> tuple[str, ...]:
    from conformance.user.serving import BOTH, servers

    return (*servers(), BOTH)


def pytest_report_header(config):
    return "versions under test: " + ", ".join(f"{k} {v}" for k, v in versions().items())


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest --draft-checkpoint DIR` outside the suite's configuration (from any directory, the plugin loaded by
    its `pytest11` entry point, no test paths given): pytest would collect that directory and find no check.
    The run is then the one `eagle3-conformance check` makes: the same arguments, on the package's checks with
    its configuration (conformance/cli.py suite_args)."""
    if not outside_the_suite(config):
        return None
    from conformance.cli import suite_args

    args = suite_args()
    if any(plugin is sys.modules[__name__] for plugin, _ in config.pluginmanager.list_plugin_distinfo()):
        # Loaded by its entry point, which loads it in that run too: without the cli's `-p conformance.plugin`,
        # which would import it by name (pytest warns that it cannot rewrite a module already imported).
        at = args.index("-p")
        args = args[:at] + args[at + 2:]
    return int(pytest.main([*config.invocation_params.args, *args]))


def outside_the_suite(config) -> bool:
    """A --draft-checkpoint run without test paths whose configuration is not the suite's pytest.ini (another
    directory's, or none) or that started below the suite's root (pytest would collect only that folder)."""
    from conformance.cli import INI

    if not config.getoption("--draft-checkpoint") or config.option.file_or_dir or hasattr(config, "workerinput"):
        return False
    ours = config.inipath is not None and config.inipath.resolve() == INI.resolve()
    return not ours or config.invocation_params.dir != config.rootpath


@pytest.hookimpl(tryfirst=True)   # before -m deselects: the lane markers decide it
def pytest_collection_modifyitems(config, items):
    """The one place that decides skips: gpu tests need CUDA, the CUDA engine lane's (`engine` and `gpu`) SGLang's
    CUDA kernels too; an implementation's own lane needs its environment."""
    own_lanes(config, items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        cuda_kernels(config, [item for item in gpu_items if item.get_closest_marker("engine")])
        return
    if config.getoption("--require-gpu"):
        raise pytest.UsageError(f"--require-gpu: {len(gpu_items)} gpu tests selected "
                                "but torch.cuda.is_available() is False")
    skip = pytest.mark.skip(reason="gpu: torch.cuda.is_available() is False")
    for item in gpu_items:
        item.add_marker(skip)


def cuda_kernels(config, engine_items) -> None:
    """The CUDA engine lane on a CUDA host without SGLang's CUDA kernels (requirements-gpu.lock): each test skips
    with the line naming what is missing, and --require-gpu refuses the run with it."""
    if not engine_items:
        return
    from conformance.adapters import ADAPTERS, DEFAULT_SERVER

    if (why := ADAPTERS[DEFAULT_SERVER].engine_cuda.missing()) is None:
        return
    if config.getoption("--require-gpu"):
        raise pytest.UsageError(f"--require-gpu: {len(engine_items)} engine gpu tests selected but {why}")
    skip = pytest.mark.skip(reason=why)
    for item in engine_items:
        item.add_marker(skip)


def own_lanes(config, items) -> None:
    """A test of an implementation whose adapter has a lane of its own (`lane`, e.g. "vllm": its own
    environment), parametrized with it (`impl`), with one of its registry entries or with a benchmark case of
    that lane's sweep (`case.lane`, the reference's figures beside it included), carries that lane's
    marker instead of `cpu` (wherever `cpu` was set: function, module), so `-m cpu` never selects it and
    `-m vllm` does; without that environment it skips with the adapter's one line."""
    from conformance.adapters import ADAPTERS

    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        impl = params.get("impl", getattr(params.get("entry"), "impl", None))
        adapter = ADAPTERS.get(impl) if isinstance(impl, str) else None
        lane = getattr(params.get("case"), "lane", None)   # a benchmark case of a lane's own sweep
        if adapter is None and lane not in (None, "cpu"):
            adapter = next(a for a in ADAPTERS.values() if a.lane == lane)
        if adapter is None or adapter.lane == "cpu":
            continue
        lane = adapter.lane
        config.addinivalue_line("markers", f"{lane}: the tests of implementations whose adapter's lane is {lane!r}")
        item.iter_markers_with_node = _without_cpu(item.iter_markers_with_node)
        item.add_marker(getattr(pytest.mark, lane))
        if why := adapter.missing():
            item.add_marker(pytest.mark.skip(reason=why))


def _without_cpu(iter_markers_with_node):
    """An item's marker walk (which -m reads) without `cpu`, wherever in the node chain it was set."""
    def walk(name=None):
        return ((node, mark) for node, mark in iter_markers_with_node(name) if mark.name != "cpu")
    return walk


# ---------------------------------------------------------------- session state

_REPORT = Report()
REPORT_PARTS = "eagle3_report"   # workeroutput key of a pytest-xdist worker's findings


@pytest.fixture(scope="session")
def report() -> Report:
    return _REPORT


@pytest.fixture(scope="session")
def drafts(tmp_path_factory):
    from conformance.session.harness import DraftStore

    return DraftStore(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture
def repro(request) -> str:
    """The one-line command that reruns exactly this test (inputs are seeded, so the node id suffices); on a
    user's draft, the user's own check narrowed to it, pasteable from any directory."""
    if request.config.getoption("--draft-checkpoint"):
        from conformance.user.commands import repro as user_repro

        return user_repro(request.config, request.node.nodeid)
    return f"python -m pytest {shlex.quote(request.node.nodeid)}"


def pytest_sessionfinish(session, exitstatus):
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:   # a pytest-xdist worker: the controller writes the one report
        worker_output[REPORT_PARTS] = json.dumps(_REPORT.parts())
        return
    directory = session.config.getoption("--report")
    if directory and not _REPORT.empty:
        _REPORT.write(Path(directory))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _REPORT.empty:
        return
    tr, directory = terminalreporter, config.getoption("--report")
    # On a user's draft the verdict is the answer: the table only when asked for (it stays in report.md).
    if config.getoption("--stage-table") or (directory and not config.getoption("--draft-checkpoint")):
        tr.section("eagle3 conformance: per implementation pair and stage")
        for line in terminal_lines(_REPORT.to_json()):
            tr.write_line(line)
    if directory:
        written = Path(config.invocation_params.dir, directory, "report.md").resolve()
        tr.write_line(f"report written to {written} (and report.json, stage_error.png)")


# ---------------------------------------------------------------- benchmarks

# Throughput plugin: enables benchmarks when `-m benchmark` selects them, machine info for
# baselines, and the tokens/s + roofline table (conformance/throughput/throughput.py).
pytest_plugins = ("conformance.throughput.throughput",)


# ---------------------------------------------------------------- bring your own draft

def pytest_configure(config):
    """--draft-checkpoint and friends are validated before anything runs: a problem is one line
    naming the file and the field, and a usage error (exit code 4), not a test failure. The verdict
    plugin focuses such a run on the user checks and turns their findings into one verdict."""
    from conformance.user.serving import unavailable
    from conformance.user.user_draft import configure_user_inputs
    from conformance.user.verdict import USER_MARK, VerdictPlugin

    config.addinivalue_line("markers", f"{USER_MARK}: a check on the user's own inputs "
                                       "(--draft-checkpoint runs only these)")
    if config.pluginmanager.hasplugin("xdist"):   # a development tool, not one of the suite's needs
        from conformance.plugin_xdist import XdistHooks

        config.pluginmanager.register(XdistHooks(_REPORT, REPORT_PARTS), "conformance.plugin_xdist")
    if config.getoption("--draft-checkpoint") and (why := unavailable(config.getoption("--serve-with"))):
        raise pytest.UsageError(why)   # bad input: exit 4, one line, how to build it
    configure_user_inputs(config)
    config.pluginmanager.register(VerdictPlugin(config, _REPORT), "eagle3-verdict")
    worker = getattr(config, "workerinput", None)
    if worker is not None and "OMP_NUM_THREADS" not in os.environ:
        # A pytest-xdist worker shares the cores with the others: torch's default (one thread per core) in every
        # worker oversubscribes them, and its threads spin at barriers while another process holds the core.
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(worker["workercount"])))


@pytest.fixture(scope="session")
def verdict(request):
    """The session's Verdict on the user's draft: checks add their problems to it."""
    from conformance.user.verdict import VERDICT_KEY

    return request.config.stash[VERDICT_KEY]


@pytest.fixture(scope="session")
def user_draft(request, tmp_path_factory):
    """A UserDraftStore whose case `user_draft` is --draft-checkpoint (or, without it, a fixture draft)."""
    from conformance.user.store import make_user_store

    return make_user_store(request.config, tmp_path_factory.mktemp("user_draft"))


@pytest.fixture(scope="session")
def target_config(request) -> dict | None:
    """--target-config, parsed (model_type, architectures, hidden_size, num_hidden_layers, vocab_size), or None."""
    from conformance.user.user_draft import TARGET_KEY

    return request.config.stash.get(TARGET_KEY, None)


# ---------------------------------------------------------------- target-side wiring

@pytest.fixture(scope="session")
def wiring(tmp_path_factory):
    """A WiringStore: tiny targets (transformers and SGLang, same weights) and draft configs, built once."""
    from conformance.wiring.wiring import WiringStore

    return WiringStore(tmp_path_factory.mktemp("wiring"))


# ---------------------------------------------------------------- training accuracy vs accept length

@pytest.fixture(scope="session")
def trained_draft():
    """The tiny draft trained with speculators' training code (conformance/acceptance/trained_draft.py), cached."""
    from conformance.acceptance.trained_draft import trained_draft as build

    return build()


@pytest.fixture(scope="session")
def acceptance(trained_draft, tmp_path_factory):
    """Its predicted accept length, the simulation requests and each implementation's runs, once."""
    from conformance.acceptance.acceptance import AcceptanceStore

    return AcceptanceStore(trained_draft, tmp_path_factory.mktemp("acceptance"))


@pytest.fixture(scope="session")
def acceptance_of(acceptance, tmp_path_factory):
    """trainer -> the AcceptanceStore of the tiny draft that trainer's own training path trained (the same
    recipe, target and data; conformance/acceptance/trained_draft.py TRAINERS); the default trainer's is
    `acceptance`. Each built once (and cached on disk) when first asked for."""
    from conformance.acceptance.acceptance import AcceptanceStore
    from conformance.acceptance.trained_draft import recipe_for, trained_draft

    stores = {acceptance.trained.trainer: acceptance}

    def of(trainer: str):
        if trainer not in stores:
            stores[trainer] = AcceptanceStore(trained_draft(recipe_for(trainer)),
                                              tmp_path_factory.mktemp(f"acceptance-{trainer}"))
        return stores[trainer]
    return of


@pytest.fixture(scope="session")
def sglang_args(request) -> str:
    """--sglang-args, or the chain settings the trained draft conforms to."""
    from conformance.adapters import ADAPTERS, DEFAULT_SERVER

    return request.config.getoption("--sglang-args") or ADAPTERS[DEFAULT_SERVER].server_settings.DEFAULT_SGLANG_ARGS
