"""Self-tests of the vLLM lane: the harness around vLLM's draft (its worker, its shims) and the lane split.

Planted harness faults in the worker must show as a divergence at attention, where they act: the KV-write
shim writing each row one slot on, and requests given vLLM's null block 0 (worker_run.py: tables start at 1).
The same draft without a plant conforms. These run in the vLLM lane (parametrized with the adapter).
The lane split itself (conformance/plugin.py own_lanes) runs in the default lane, on stand-in items, and so do
the checks of the worker's files (worker.py and every file it imports by name, found from its imports) and of the
vLLM engine worker's (engine_worker.py and its files): each imports only vLLM, torch, safetensors, the standard
library and the worker's own files, and each imports alone, in a fresh interpreter, with vLLM and the project's
packages refused, as its process would find them.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conformance.adapters import ADAPTERS
from conformance.adapters.vllm.engine import WORKER as ENGINE_WORKER
from conformance.adapters.vllm.process import WORKER
from conformance.core.compare import compare_traces
from fixtures.cases import CASES_BY_ID

pytestmark = [pytest.mark.cpu, pytest.mark.meta]

OWN_LANE = [name for name, adapter in ADAPTERS.items() if adapter.lane != "cpu"]
CASE = CASES_BY_ID["gqa"]


@pytest.mark.parametrize("impl", [name for name in OWN_LANE if ADAPTERS[name].served_boundaries is not None])
@pytest.mark.parametrize("plant", ["kv_write_next_slot", "null_block"])
def test_a_planted_harness_fault_shows_at_attention(impl, plant, drafts, repro):
    adapter = ADAPTERS[impl]()
    loaded = adapter.load(drafts.checkpoint(CASE)[adapter.checkpoint_format], torch.float32)
    expected = drafts.trace("reference", CASE, torch.float32, 2)
    clean = compare_traces(loaded.run(drafts.batch(CASE, 2), 2), expected, CASE.id)
    assert clean.first_divergence is None, clean.message(repro)
    planted = compare_traces(loaded.run(drafts.batch(CASE, 2), 2, plant=plant), expected, CASE.id)
    first = planted.first_divergence
    assert first is not None and first.stage == "layers.0.attn_core", (
        f"planted {plant} not caught at attention:\n{planted.message(repro)}")


@pytest.mark.parametrize("impl", [name for name in OWN_LANE if ADAPTERS[name].served_boundaries is not None])
def test_a_retried_run_records_only_its_own_pass(impl, drafts, repro):
    """run() retries after an Inductor codegen error (worker_run.py); the failed attempt stopped inside layer 0,
    its hooks half fired. The retry's trace must be the retry's own: planted through the real retry path, the
    run conforms and records every stage (a recorder left with the failed pass files step 0's fc_in_norm under
    layer 0 and the stage goes missing)."""
    adapter = ADAPTERS[impl]()
    case = CASES_BY_ID["fc_norm"]
    loaded = adapter.load(drafts.checkpoint(case)[adapter.checkpoint_format], torch.float32)
    expected = drafts.trace("reference", case, torch.float32, 2)
    trace = loaded.run(drafts.batch(case, 2), 2, plant="inductor_error_once")
    assert any("torch Inductor codegen failed" in note for note in trace.notes), trace.notes
    retried = compare_traces(trace, expected, case.id)
    assert retried.first_divergence is None, retried.message(repro)


class StandInItem:
    """What own_lanes reads and writes of a pytest item: its parameters and its marker walk (a `cpu` mark set
    on the module, as pytestmark does, and one on the function)."""

    def __init__(self, impl: str):
        self.callspec = SimpleNamespace(params={"impl": impl})
        self.own_markers = [pytest.mark.cpu.mark]
        self.module_markers = [pytest.mark.cpu.mark, pytest.mark.meta.mark]

    def iter_markers_with_node(self, name=None):
        return ((self, m) for m in [*self.own_markers, *self.module_markers] if name is None or m.name == name)

    def add_marker(self, marker):
        self.own_markers.append(marker.mark)

    def names(self) -> set[str]:
        return {m.name for _, m in self.iter_markers_with_node()}


@pytest.mark.parametrize("missing", [False, True], ids=["environment_present", "environment_missing"])
def test_an_own_lane_test_leaves_the_default_lane(missing, monkeypatch, tmp_path):
    from conformance.plugin import own_lanes

    if not OWN_LANE:
        pytest.skip("no adapter has a lane of its own")
    impl, default = OWN_LANE[0], next(n for n, a in ADAPTERS.items() if a.lane == "cpu")
    monkeypatch.setattr(ADAPTERS[impl], "missing", classmethod(lambda cls: "planted: environment missing"
                                                               if missing else None))
    config = SimpleNamespace(lines=[], addinivalue_line=lambda name, line: config.lines.append(line))
    own, other = StandInItem(impl), StandInItem(default)
    own_lanes(config, [own, other])
    lane = ADAPTERS[impl].lane
    assert "cpu" not in own.names() and lane in own.names(), own.names()   # -m cpu never selects it
    assert other.names() == {"cpu", "meta"}, other.names()                 # the default lane is untouched
    assert any(line.startswith(f"{lane}:") for line in config.lines)        # registered (--strict-markers)
    skips = [m for m in own.own_markers if m.name == "skip"]
    assert [m.kwargs["reason"] for m in skips] == (["planted: environment missing"] if missing else [])


@pytest.mark.parametrize("impl", [name for name in OWN_LANE if ADAPTERS[name].served_boundaries is not None])
def test_the_observed_capture_follows_the_target_class(impl, wiring, tmp_path, repro):
    """The served list of a class that runs here is read off its forward, not from the ids: a planted runner that
    hands the target every id plus one (worker_capture.py, plant "ids_one_deeper") moves what the forward
    captures one boundary deeper, away from the ids the derivation reads."""
    from conformance.adapters.vllm.process import Worker
    from conformance.wiring.cases import CASES_BY_ID, N
    from fixtures.targets import TARGETS, write_target_config

    case = CASES_BY_ID["speculators_explicit"]
    where = {"draft": str(wiring.draft_dir(case, "speculators")),
             "target": str(write_target_config(TARGETS[0], tmp_path) / "config.json"),
             "runner": ADAPTERS[impl].runners[0]}
    worker = Worker.get()
    clean = worker.ask("capture", **where, work=str(worker.scratch()))
    planted = worker.ask("capture", **where, work=str(worker.scratch()), plant="ids_one_deeper")
    assert clean["ran"] and clean["served"] == list(case.boundaries), f"{clean} ({repro})"
    # one deeper; a boundary past the last layer's output (N) is never captured
    assert planted["served"] == [b + 1 for b in case.boundaries if b + 1 <= N], f"{planted} ({repro})"


# ---------------------------------------------------------------- the worker's files, in the default lane

ROOT = Path(__file__).resolve().parents[2]
# The folders worker.py puts on sys.path: its own (a script's) and observed_loaders.py's.
WORKER_PATH = (WORKER.parent, ROOT / "conformance" / "loading")
# What the worker's environment gives it besides the standard library and its own files.
WORKER_PACKAGES = {"torch", "safetensors", "vllm"}
# Refused when a file is imported alone: vLLM (imported only where used, so that each file loads without it) and
# the project's packages (they need the project's torch and transformers, not vLLM's).
REFUSED = sorted({"vllm"} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()})


def imports(path: Path) -> list[str]:
    """The top-level names `path` imports, anywhere in it (a lazy import in a function included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            names.append(node.module.split(".")[0])
    return names


def own_file(name: str, folders=WORKER_PATH) -> Path | None:
    return next((f / f"{name}.py" for f in folders if (f / f"{name}.py").exists()), None)


def worker_files(entry: Path = WORKER, folders=WORKER_PATH) -> list[Path]:
    """The entry point and every file it imports by name from the folders on its path, transitively."""
    found, todo = set(), [entry]
    while todo:
        path = todo.pop()
        if path not in found:
            found.add(path)
            todo += [p for p in (own_file(name, folders) for name in imports(path)) if p is not None]
    return sorted(found)


def foreign(path: Path, folders=WORKER_PATH) -> list[str]:
    """What `path` imports that vLLM's environment does not give the worker."""
    return sorted({name for name in imports(path) if name not in sys.stdlib_module_names
                   and name not in WORKER_PACKAGES and own_file(name, folders) is None})


# Run by a fresh interpreter (-I: no PYTHONPATH, no working folder on the path) with every name in REFUSED refused
# by the first finder asked; each file is imported in a child of its own (forked after torch, which every file may
# import, is imported once), with its folders first on the path. Answers {name: its __file__ or the traceback}.
IMPORT_ALONE = """
import importlib, json, os, sys, traceback
refused, files = sys.argv[1].split(","), json.loads(sys.argv[2])

class Refuse:
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in refused:
            raise ModuleNotFoundError(f"{fullname} refused: the worker's files import without it", name=fullname)

sys.meta_path.insert(0, Refuse())
import safetensors.torch, torch
answers = {}
for name, folders in files:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        sys.path[:0] = folders
        try:
            answer = {"file": importlib.import_module(name).__file__}
        except BaseException:
            answer = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as channel:
            channel.write(json.dumps(answer))
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as channel:
        answers[name] = json.loads(channel.read() or '{"error": "the child died"}')
    os.waitpid(pid, 0)
print(json.dumps(answers))
"""


def import_alone(files: dict[Path, tuple], cwd: Path) -> dict[str, dict]:
    """Each file (with the folders it is imported from) imported alone: {its name: {"file"} or {"error"}}."""
    spec = json.dumps([[path.stem, [str(f) for f in folders]] for path, folders in files.items()])
    done = subprocess.run([sys.executable, "-I", "-c", IMPORT_ALONE, ",".join(REFUSED), spec], capture_output=True,
                          text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


WORKER_FILES = worker_files()


def test_the_worker_is_split_into_files_beside_it():
    """worker.py's jobs are files beside it that it imports (none orphaned, none outside the two folders)."""
    beside = set(WORKER.parent.glob("worker*.py"))
    assert beside <= set(WORKER_FILES), f"beside worker.py but not imported by it: {sorted(beside - set(WORKER_FILES))}"
    assert {p.parent for p in WORKER_FILES} <= set(WORKER_PATH), WORKER_FILES
    # first on sys.path, an own file named like a standard module would shadow it for vLLM as well
    assert not [p.name for p in WORKER_FILES if p.stem in sys.stdlib_module_names]


@pytest.mark.parametrize("path", WORKER_FILES, ids=lambda p: p.name)
def test_a_worker_file_imports_only_what_vllms_environment_has(path):
    assert foreign(path) == [], f"{path.name} imports {foreign(path)}: not in vLLM's environment (worker.py)"


@pytest.fixture(scope="module")
def imported_alone(tmp_path_factory):
    # worker.py starts with its own folder on the path, as a script does; it adds the other folder itself
    return import_alone({p: WORKER_PATH[:1] if p == WORKER else WORKER_PATH for p in WORKER_FILES},
                        tmp_path_factory.mktemp("alone"))


@pytest.mark.parametrize("path", WORKER_FILES, ids=lambda p: p.name)
def test_a_worker_file_imports_alone_without_vllm_or_the_project(path, imported_alone):
    answer = imported_alone[path.stem]
    assert "error" not in answer, f"{path.name} does not import alone:\n{answer['error']}"
    assert answer["file"] == str(path), answer   # this file, not a namesake elsewhere on the path


def test_the_worker_file_checks_catch_planted_imports(tmp_path):
    """A planted file beside a planted entry point: a project import at the top, vLLM at the top, and the
    transformers a function imports; each check must name what it catches."""
    (tmp_path / "entry.py").write_text("import worker_planted  # noqa\n")
    planted = tmp_path / "worker_planted.py"
    planted.write_text("import torch\nfrom conformance.core import stages\n\n\ndef later():\n"
                       "    import transformers\n")
    assert worker_files(tmp_path / "entry.py", (tmp_path,)) == [tmp_path / "entry.py", planted]
    assert foreign(planted, (tmp_path,)) == ["conformance", "transformers"]
    answer = import_alone({planted: (tmp_path,)}, tmp_path)["worker_planted"]
    assert "conformance refused" in answer.get("error", ""), answer
    planted.write_text("import torch\nimport vllm\n")
    assert foreign(planted, (tmp_path,)) == []   # the worker's environment has vLLM: only the import alone catches it
    answer = import_alone({planted: (tmp_path,)}, tmp_path)["worker_planted"]
    assert "vllm refused" in answer.get("error", ""), answer


# ---------------------------------------------------------------- the engine worker's files (the vLLM engine lane)

# engine_worker.py (vLLM's serving engine, `make vllm-engine`) runs with the engine environment's python (vLLM's CPU
# build): its own folder on the path, nothing else. It gives the same packages as vLLM's environment.
ENGINE_PATH = (ENGINE_WORKER.parent,)
ENGINE_FILES = worker_files(ENGINE_WORKER, ENGINE_PATH)


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_an_engine_worker_file_imports_only_what_its_environment_has(path):
    assert foreign(path, ENGINE_PATH) == [], (
        f"{path.name} imports {foreign(path, ENGINE_PATH)}: not in the vLLM engine environment (engine_worker.py)")


@pytest.fixture(scope="module")
def engine_imported_alone(tmp_path_factory):
    return import_alone({p: ENGINE_PATH for p in ENGINE_FILES}, tmp_path_factory.mktemp("engine-alone"))


@pytest.mark.parametrize("path", ENGINE_FILES, ids=lambda p: p.name)
def test_an_engine_worker_file_imports_alone_without_vllm_or_the_project(path, engine_imported_alone):
    answer = engine_imported_alone[path.stem]
    assert "error" not in answer, f"{path.name} does not import alone:\n{answer['error']}"
    assert answer["file"] == str(path), answer   # this file, not a namesake elsewhere on the path


def test_the_engine_worker_file_checks_catch_a_planted_import(tmp_path):
    """The engine worker's own files copied, with a project import planted in engine_capture.py (what the engine
    worker imports first) and transformers in a function of it: both checks must name it."""
    for path in ENGINE_FILES:
        (tmp_path / path.name).write_text(path.read_text())
    capture = tmp_path / "engine_capture.py"
    capture.write_text(capture.read_text() + "\nfrom conformance.engine import served  # noqa\n\n\ndef later():\n"
                       "    import transformers  # noqa\n")
    copied = worker_files(tmp_path / ENGINE_WORKER.name, (tmp_path,))
    assert [p.name for p in copied] == [p.name for p in ENGINE_FILES], copied
    assert foreign(capture, (tmp_path,)) == ["conformance", "transformers"]
    answer = import_alone({capture: (tmp_path,)}, tmp_path)["engine_capture"]
    assert "conformance refused" in answer.get("error", ""), answer


def test_a_validation_errors_one_line_names_its_cause():
    """vLLM's config classes are pydantic dataclasses: the first line of what they raise names only the class, so
    the worker's one line adds the first error's message (worker_pipe.first_line); a registry entry matches it.
    Planted: two refusals with the same first line must read differently; other exceptions keep their first line."""
    from pydantic.dataclasses import dataclass

    from conformance.adapters.vllm.worker_pipe import DETAIL, first_line

    @dataclass
    class SpeculativeConfig:
        model: str

        def __post_init__(self):
            raise ValueError(f"Model architectures ['{self.model}'] are not supported for now. " + "x" * 500)

    lines = []
    for model in ("LlamaEagle3DraftModel", "Other"):
        with pytest.raises(Exception) as caught:
            SpeculativeConfig(model=model)
        lines.append(first_line(caught.value))
    assert lines[0].startswith("1 validation error for SpeculativeConfig: Value error, Model architectures "
                               "['LlamaEagle3DraftModel'] are not supported"), lines[0]
    head = "1 validation error for SpeculativeConfig: "
    assert lines[0] != lines[1] and "\n" not in lines[0] and len(lines[0]) <= len(head) + DETAIL + 3
    assert first_line(ValueError("a\nb")) == "a" and first_line(RuntimeError()) == "RuntimeError"
