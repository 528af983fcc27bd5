"""Wiring on the user's own files: which target layers SGLang feeds the user's draft, on a tiny twin of
the user's target, against the layers the draft's trainer captured; slot by slot, as verdict problems.

Entry points (the verdict's user checks call them):

    check_user_wiring(draft_dir, target_config, trainer, root) -> UserWiring
        `draft_dir`: the draft directory as SGLang reads it (the converted copy when SGLang cannot read
        the user's own); `trainer`: conformance.user.trainer.Trainer (which layers training read).
        UserWiring.problems: verdict Problems (rank WIRING), empty when every slot holds the layer
        training used; .lines(): both layer lists and each slot; .rows(): report rows.
    check_hidden_states(dump_dir, target_config, wiring) -> list[Problem]
        --hidden-states against the target config: the dump's width and its number of layers.
    servable_ids(target_config, boundaries, root) -> tuple[int, ...] | None
        the eagle_config ids with which SGLang's class for this target captures `boundaries`.

SGLang's side is SGLang's own code: the draft config read by resolve_spec_aux_hidden_state_config, the
ids handed over by configure_aux_hidden_state_capture to the class ModelRegistry picks for the
target's architectures, and that class's forward capturing the aux tensor (conformance/wiring/target_twin.py).
The training side is the same weights in transformers (HF hidden_states[b]: the input of layer b, 0 =
the embeddings, N = the last layer's output before the final norm), as every trainer captures them.
A chunk is named by the boundary it equals within the fp32 hidden tolerance, whose noise floor is the
transformers twin's own fp32-vs-fp64 difference at that boundary (conformance/core/tolerances.py).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from conformance.checkpoints.errors import CheckpointError
from conformance.core.compare import OK, StageResult, compare_tensors
from conformance.user.trainer import Trainer
from conformance.core.findings import CONVERT, WIRING, Problem
from conformance.wiring.cases import AUX_STAGE
from conformance.wiring.comparison import TARGET, describe_read
from conformance.wiring.target_twin import TwinRun, TwinUnsupported, build_twin, target_twin


# ---------------------------------------------------------------- file:line in the pinned packages

def package_path(path: str | Path) -> str:
    """`sglang/srt/models/llama.py`: a source path from the package root on (no paths of this machine)."""
    parts = Path(path).parts
    for root in ("sglang", "speculators", "transformers"):
        if root in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(root) - 1:])
    return Path(path).name


def source_ref(obj) -> str:
    """`file:first-last` of a function or class in the installed package (read, not hard-coded)."""
    obj = inspect.unwrap(obj)
    lines, start = inspect.getsourcelines(obj)
    return f"{package_path(inspect.getsourcefile(obj))}:{start}-{start + len(lines) - 1}"


def source_line(module: str, needle: str) -> str:
    """`file:line` of the first line of `module`'s source that contains `needle` (the file alone if none)."""
    import importlib.util

    path = Path(importlib.util.find_spec(module).origin)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return f"{package_path(path)}:{n}"
    return package_path(path)


def boundary_name(b: int, n: int) -> str:
    return "embed" if b == 0 else "final" if b == n else str(b)


def layer_list(boundaries, n: int) -> str:
    return "[" + ", ".join(b if isinstance(b, str) else boundary_name(b, n) for b in boundaries) + "]"


# ---------------------------------------------------------------- naming what SGLang captured

def name_chunk(run: TwinRun, chunk: torch.Tensor) -> tuple[str, StageResult]:
    """The boundary whose transformers state `chunk` equals within tolerance ('?' and the nearest if none)."""
    n = run.twin.num_layers
    results = [compare_tensors(0, AUX_STAGE, chunk, s, torch.float32, precise=p)
               for s, p in zip(run.states, run.precise)]
    for b, r in enumerate(results):
        if r.verdict == OK:
            return boundary_name(b, n), r
    nearest = min(range(len(results)), key=lambda b: results[b].max_abs)
    return "?", results[nearest]


def served_boundaries(run: TwinRun, layers: tuple[int, ...], aux: torch.Tensor | None) -> tuple[str, ...]:
    """Per served slot, the boundary it holds: named from the aux tensor, or for a class whose forward
    cannot run here read off layers_to_capture (the boundaries its decoder loop visits, in layer order)."""
    n = run.twin.num_layers
    if aux is None:
        return tuple(boundary_name(b, n) for b in sorted({b for b in layers if 0 <= b <= n}))
    width = run.states[0].shape[-1]
    return tuple(name_chunk(run, c)[0] for c in aux.split(width, dim=-1))


# ---------------------------------------------------------------- the comparison and its problems

@dataclass
class UserWiring:
    target: str                           # the twin's source, readable
    trained: str                          # how training captured, readable (Trainer.describe)
    num_layers: int = 0
    training: tuple[int, ...] = ()        # boundaries training fed each slot
    read: str = ""                        # what SGLang read from the draft config
    layers_to_capture: tuple[int, ...] | None = None
    serving: tuple[str, ...] | None = None   # per served slot, the boundary it holds
    slots: list[tuple[int, str | None, str | None, StageResult | None]] = field(default_factory=list)
    error: str = ""
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lists(self) -> str:
        n = self.num_layers
        serving = "(none)" if self.serving is None else layer_list(self.serving, n)
        return f"training: {layer_list(self.training, n)}  serving: {serving}"

    def lines(self) -> list[str]:
        out = [self.lists(), f"target: {self.target}", f"trained: {self.trained}",
               f"SGLang read {self.read or 'nothing'}; layers_to_capture "
               f"{'-' if self.layers_to_capture is None else list(self.layers_to_capture)}"]
        out += [self.error] if self.error else []
        for slot, t, s, r in self.slots:
            where = "" if r is None or r.max_abs is None else f"  max abs {r.max_abs:.3e} at {r.abs_index}"
            out.append(f"slot {slot}: training {t or '(none)'}, serving {s or '(none)'}  "
                       f"{'ok' if t == s else '<- differs'}{where}")
        return out

    def rows(self) -> list[dict]:
        return [{"Case": "user wiring", "training captured": layer_list(self.training, self.num_layers),
                 "SGLang read": self.read or "-", "layers_to_capture": str(list(self.layers_to_capture or ())),
                 "SGLang captured": "-" if self.serving is None else layer_list(self.serving, self.num_layers),
                 "outcome": "pass" if self.ok else f"FAIL: {len(self.problems)} problem(s)"}]


def _capture_cause(run: TwinRun) -> str:
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )

    classes = run.classes or (TARGET.sglang_class(run.twin),)
    setters = " via ".join(f"{c.__name__}.set_eagle3_layers_to_capture ({source_ref(c.set_eagle3_layers_to_capture)})"
                           for c in classes)
    return (f"SGLang reads the ids with resolve_spec_aux_hidden_state_config "
            f"({source_ref(resolve_spec_aux_hidden_state_config)}); {setters} turns them into layers_to_capture; "
            "the decoder captures the input of each listed layer")


def find_ids(run: TwinRun, training: tuple[int, ...]) -> tuple[int, ...] | None:
    """eagle_config ids with which SGLang's class captures exactly `training`, tried on the twin (the class's
    own rule, verified by its forward): the output-of-layer ids (b - 1), then the boundaries themselves."""
    n = run.twin.num_layers
    want = tuple(boundary_name(b, n) for b in training)
    for ids in dict.fromkeys((tuple(b - 1 for b in training), tuple(training))):
        try:
            layers, aux = run.capture(TARGET.AuxIds(True, ids))
        except TARGET.CaptureFailed:
            continue
        if served_boundaries(run, layers, aux) == want:
            return ids
    return None


def servable_ids(target_config: Path, boundaries: tuple[int, ...], root: Path) -> tuple[int, ...] | None:
    return find_ids(build_twin(target_twin(Path(target_config)), Path(root)), tuple(boundaries))


def _fix(run: TwinRun, training: tuple[int, ...], use_aux: bool, ids: tuple[int, ...] | None) -> str:
    n = run.twin.num_layers
    ids = find_ids(run, training)
    cls = (run.classes or (TARGET.sglang_class(run.twin),))[0].__name__
    if ids is None:
        return (f"SGLang's {cls} cannot capture {layer_list(training, n)} with any eagle_config ids tried; "
                "retrain on layers it can capture (e.g. its default list) and write those ids")
    flag = "" if use_aux else ' and "use_aux_hidden_state": true'
    return (f'set "eagle_config": {{"eagle_aux_hidden_state_layer_ids": {list(ids)}{flag}}} in the draft\'s '
            f"config.json (verified: SGLang's {cls} then captures {layer_list(training, n)} on the twin)")


def _unstated(trainer: Trainer, serving: tuple[str, ...] | None, n: int) -> str:
    """When nothing says how the draft was trained, the ids were read in SGLang's Llama convention: if training
    did capture what SGLang captures, the user says so and the draft is served as trained."""
    if trainer.name is not None or trainer.stated_ids is not None or not serving or "?" in serving:
        return ""
    layers = ",".join(str(n) if b == "final" else b for b in serving)
    return (f"; or, if training did capture {layer_list(serving, n)} (the trainer is not stated, so the ids were "
            f"read as output-of-layer ids), say so: --trained-aux-layers {layers}")


def check_user_wiring(draft_dir: Path, target_config: Path, trainer: Trainer, root: Path) -> UserWiring:
    """SGLang's capture for this draft on a twin of this target against training's, slot by slot.
    CheckpointError (bad input) when the target config is unreadable."""
    try:
        twin = target_twin(Path(target_config))
    except TwinUnsupported as exc:
        out = UserWiring(Path(target_config).name, trainer.describe())
        out.problems.append(Problem(
            "the aux wiring cannot be checked on this target", "target model", str(exc), str(exc),
            "none here: check which layers SGLang captures for this draft by hand", WIRING, key="wiring:no-twin"))
        return out
    n = twin.num_layers
    training = trainer.training_ids(n)
    out = UserWiring(twin.source, trainer.describe(n), n, tuple(training))
    bad = [b for b in training if not 0 <= b <= n]
    if bad:
        out.problems.append(Problem(
            "the draft was trained on layers this target does not have", "aux layers",
            f"training ids {list(training)} (input of layer i), target has boundaries 0..{n}", trainer.describe(n),
            "check --target-config is the draft's target, or state the trainer (--trainer)", WIRING,
            key="wiring:layers-out-of-range"))
        return out
    run = build_twin(twin, Path(root))
    try:
        aux_ids = TARGET.sglang_aux_layer_ids(Path(draft_dir), Path(draft_dir).parent)
    except TARGET.DraftConfigRefused as exc:
        out.error = f"SGLang refused the draft config: {exc}"
        out.problems.append(Problem("SGLang cannot read the draft's config.json", "config.json", str(exc),
                                    source_line("sglang.srt.model_executor.model_runner_components."
                                                "spec_aux_hidden_state", "AutoConfig"),
                                    "convert the draft to SGLang's format", WIRING, key="wiring:config-refused"))
        return out
    out.read = describe_read(aux_ids)
    try:
        out.layers_to_capture, aux = run.capture(aux_ids)
    except TARGET.CaptureFailed as exc:
        out.error = f"SGLang's target failed while capturing: {exc}"
        aux = None
        out.serving = ()
    else:
        out.serving = served_boundaries(run, out.layers_to_capture, aux)
    chunks = [] if aux is None else list(aux.split(run.states[0].shape[-1], dim=-1))
    for j in range(max(len(out.serving), len(training))):
        t = boundary_name(training[j], n) if j < len(training) else None
        s = out.serving[j] if j < len(out.serving) else None
        r = compare_tensors(0, AUX_STAGE, chunks[j], run.states[training[j]], torch.float32,
                            precise=run.precise[training[j]]) if j < len(chunks) and t is not None else None
        out.slots.append((j, t, s, r))
    if out.error or any(t != s for _, t, s, _ in out.slots):
        differs = [f"slot {j}: training {t or '(none)'}, serving {s or '(none)'}" for j, t, s, _ in out.slots if t != s]
        ids = find_ids(run, training)
        out.problems.append(Problem(
            f"SGLang feeds the draft other target layers than it was trained on ({out.lists()})",
            "aux slots (the draft's input aux_in): " + "; ".join(differs),
            "; ".join(out.lines()[3:]), _capture_cause(run), _fix(run, training, aux_ids.use_aux, ids) + _unstated(
                trainer, out.serving, n), WIRING, key="wiring:aux-layers",
            # the converter writes these ids, given the target and what training captured
            remedy=CONVERT if ids is not None and trainer.stated_ids is not None else ""))
    return out


def check_hidden_states(dump_dir: Path, target_config: Path, wiring: UserWiring) -> list[Problem]:
    """The dump's hidden_states [L, A+1, Ht] (speculators' datagen layout) against the target config: Ht is
    the target's hidden_size, and A the number of aux slots SGLang feeds the draft on this target."""
    from conformance.checkpoints.targets import read_target_config

    hidden = read_target_config(Path(target_config))["hidden_size"]
    slots = len(wiring.serving) if wiring.serving else len(wiring.training)
    files = sorted(Path(dump_dir).glob("hs_*.safetensors"), key=lambda p: p.stem)
    cause = "speculators' datagen writes [seq_len, aux layers + the last, target hidden] (speculators train/data.py)"
    out = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                shape = tuple(f.get_slice("hidden_states").get_shape())
        except Exception as exc:   # safetensors' own words; an unreadable dump is bad input
            raise CheckpointError(path, "tensor hidden_states", f"cannot be read ({exc})") from None
        if len(shape) != 3:
            raise CheckpointError(path, "tensor hidden_states", f"shape {shape}, expected [seq_len, layers, hidden]")
        if shape[2] != hidden:
            out.append(Problem("the hidden-state dump is not from this target (width)", f"{path.name}: hidden_states",
                               f"width {shape[2]}, target hidden_size {hidden} ({Path(target_config).name})", cause,
                               "regenerate the dump from the draft's target, or pass that target's config",
                               WIRING, key="wiring:dump-width"))
        if shape[1] != slots + 1:
            out.append(Problem("the hidden-state dump has another number of layers than SGLang feeds",
                               f"{path.name}: hidden_states", f"{shape[1]} layers = {shape[1] - 1} aux + the last; "
                               f"SGLang feeds {slots} aux slots on this target ({wiring.lists()})", cause,
                               "regenerate the dump with the draft's aux layers", WIRING, key="wiring:dump-layers"))
        if out:
            break   # one file shows it; the rest come from the same run
    return out


# ---------------------------------------------------------------- another server (vLLM), per model runner

def check_server_wiring(impl: str, runner: str | None, draft_dir: Path, target_config: Path, trainer: Trainer,
                        root: Path) -> tuple[UserWiring, dict]:
    """Which target layers another server (an adapter with `served_boundaries`: vLLM) feeds the user's draft, as
    it reads the directory as written, with model runner `runner`, on a twin of the user's target (same class,
    same layer count: what the capture depends on), slot by slot against training's. Returns the comparison and
    the adapter's answer (observed by a forward of the server's target class where it runs here, else derived)."""
    from conformance.adapters import ADAPTERS

    server = f"{impl} ({runner} runner)" if runner else impl
    try:
        twin = target_twin(Path(target_config))
    except TwinUnsupported as exc:
        out = UserWiring(Path(target_config).name, trainer.describe())
        out.problems.append(Problem(
            f"the aux wiring on {server} cannot be checked on this target", "target model", str(exc), str(exc),
            f"none here: check which layers {impl} captures for this draft by hand", WIRING,
            key=f"wiring:{impl}:{runner}:no-twin", impl=impl))
        return out, {}
    n = twin.num_layers
    training = tuple(trainer.training_ids(n))
    out = UserWiring(twin.source, trainer.describe(n), n, training)
    twin_dir = Path(root) / f"{impl}-twin"
    twin_dir.mkdir(parents=True, exist_ok=True)
    (twin_dir / "config.json").write_text(twin.config_text)
    served = ADAPTERS[impl]().served_boundaries(Path(draft_dir), twin_dir / "config.json", n, runner)
    out.read, out.error = served["read"], served["error"]
    out.serving = () if served["served"] is None else tuple(boundary_name(b, n) for b in served["served"])
    for j in range(max(len(out.serving), len(training))):
        t = boundary_name(training[j], n) if j < len(training) else None
        s = out.serving[j] if j < len(out.serving) else None
        out.slots.append((j, t, s, None))
    if out.error or any(t != s for _, t, s, _ in out.slots):
        differs = [f"slot {j}: training {t or '(none)'}, serving {s or '(none)'}" for j, t, s, _ in out.slots if t != s]
        how = ("observed: its target class's forward" if served["observed"]
               else f"derived: {served.get('derived_why', 'no forward')}")
        ids = [i for i in training if 0 <= i <= n]
        out.problems.append(Problem(
            f"{server} feeds the draft other target layers than it was trained on ({out.lists()})",
            "aux slots (the draft's input aux_in): " + "; ".join(differs) + (f"; {out.error}" if out.error else ""),
            f"{impl} read {served['read']} ({how})",
            served.get("reader", ""),
            f"write the trained boundaries as the draft config's top-level eagle_aux_hidden_state_layer_ids "
            f"{ids} (input-of-layer ids, read as written by both of {impl}'s runners)", WIRING,
            key=f"wiring:{impl}:{runner}", impl=impl))
    return out, served


def server_row(impl: str, runner: str | None, wiring: UserWiring, served: dict) -> dict:
    """The report's row for another server's reading of the user's draft (Section.WIRING_SERVERS)."""
    n = wiring.num_layers
    return {"Case": "user wiring" + (f" ({runner} runner)" if runner else ""),
            "training captured": layer_list(wiring.training, n), "SGLang feeds": "-",
            f"{impl} read": wiring.read or "-",
            f"{impl} feeds": f"error: {wiring.error}" if wiring.error else layer_list(wiring.serving or (), n),
            f"{impl} how": "-" if not served else "observed: its target class ran" if served["observed"]
            else f"derived: {served.get('derived_why', '')}",
            f"{impl} outcome": "pass" if wiring.ok else f"FAIL: {len(wiring.problems)} problem(s)"}
