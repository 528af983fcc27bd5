"""Target-side wiring: which target layers feed the draft in training, and which in SGLang.

Training side: each trainer's own id convention applied to the transformers target's hidden states.
Serving side: SGLang's real target class, fed the ids SGLang itself reads from the draft config.
Compared: the concatenated aux tensor, slot by slot; a mismatch prints both layer lists side by side.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from conformance.adapters.sglang.target import (
    AuxIds, CaptureFailed, DraftConfigRefused, SGLangTarget, build_target, load_target, sglang_aux_layer_ids,
)
from conformance.core.compare import OK, StageResult, compare_tensors
from conformance.core.registry import WIRING_KINDS, Known, applicable
from conformance.core.common import by_id
from fixtures.checkpoint import sglang_config_json, speculators_config_json
from fixtures.targets import (
    TARGET_HIDDEN, TARGET_LAYERS, TargetSpec, make_hf_target, make_target_input, write_target_config,
)
from fixtures.tiny import make_config

N = TARGET_LAYERS
DTYPE = torch.float32     # both targets run in fp32; the tolerance is the table's ("hidden", fp32)
AUX_STAGE = "aux_in"      # the draft stage the captured tensor becomes (its tolerance kind: hidden)


def boundary_name(b: int, n: int = N) -> str:
    """Layer lists name boundaries of the residual stream as HF `hidden_states[b]` does: b is the input
    of decoder layer b (the output of layer b-1), `embed` (0) the embedding output, `final` (N) the last
    layer's output before the final norm."""
    return "embed" if b == 0 else "final" if b == n else str(b)


def layer_list(boundaries, n: int = N) -> str:
    """`[embed, 3, 31]`; entries that are already names stay as they are."""
    return "[" + ", ".join(b if isinstance(b, str) else boundary_name(b, n) for b in boundaries) + "]"


# ---------------------------------------------------------------- training side: each trainer's convention

@dataclass(frozen=True)
class Trainer:
    name: str
    meaning: str                          # what id i means, in boundary terms
    offset: int                           # boundary = id + offset
    default: Callable[[int], tuple]       # the ids it uses when none are given, for an N-layer target
    writes_ids: bool                      # whether its draft config carries the ids at all
    source: str                           # where that is defined

    def boundaries(self, ids: tuple[int, ...] | None, n: int = N) -> tuple[int, ...]:
        return tuple(i + self.offset for i in (self.default(n) if ids is None else ids))


TRAINERS = {t.name: t for t in (
    Trainer("speculators", "input of layer i (0 = embedding output, N = final hidden before the norm)", 0,
            lambda n: (2, n // 2, n - 3), True,
            "speculators models/utils.py:109-117 (default [2, N//2, N-3]; id N, the final hidden, is valid); "
            "the capture at N is the last layer's output before the final norm: the trainer norms it "
            "itself (train/data.py:324-331 splits it off, models/eagle3/core.py:250-253 applies verifier_norm)"),
    Trainer("specforge", "output of layer i", 1, lambda n: (1, n // 2 - 1, n - 4), True,
            "specforge 0.2.0 algorithms/model_providers.py:188-211 (eagle3-semantics.md §2.1): output-of-layer "
            "ids, default [1, N//2-1, N-4], written to eagle_config"),
    Trainer("eagle3", "inputs of layers {2, N//2, N-3}, hard-coded", 0, lambda n: (2, n // 2, n - 3), False,
            "SafeAILab/EAGLE eagle/traineagle3/modeling_llama_kv.py:1139-1140; its config carries no ids"),
)}


@dataclass(frozen=True)
class WiringCase:
    """What the draft was trained on (a trainer and its ids) and, for the seed, what its config says."""

    id: str                                  # readable, unique: appears in test ids and the report
    trainer: str                             # key of TRAINERS
    ids: tuple[int, ...] | None = None       # in the trainer's own convention; None = its default
    summary: str = ""
    config_ids: tuple[int, ...] | None = None  # eagle_config ids as shipped, instead of the format's writer

    @property
    def boundaries(self) -> tuple[int, ...]:
        return TRAINERS[self.trainer].boundaries(self.ids)

    def describe(self) -> str:
        t = TRAINERS[self.trainer]
        ids = "its default" if self.ids is None else list(self.ids)
        return f"{t.name} ids {ids} ({t.meaning}; {t.source})"


TRAINING_CASES: tuple[WiringCase, ...] = (
    WiringCase("eagle3_default", "eagle3", summary="original EAGLE-3: inputs {2, N//2, N-3}, no ids in the config"),
    WiringCase("speculators_default", "speculators", summary="speculators' default ids, written out explicitly"),
    WiringCase("speculators_explicit", "speculators", (1, 4, 8), "explicit ids, first id 1"),
    WiringCase("speculators_embed", "speculators", (0, 4, 8), "id 0: the embedding output"),
    WiringCase("speculators_last_layer", "speculators", (2, 5, N - 1), "id N-1: the input of the last layer"),
    WiringCase("speculators_final", "speculators", (2, 5, N),
               "id N: the final hidden (also SpecForge's output id N-1)"),
    WiringCase("specforge_explicit", "specforge", (2, 5, 8), "SpecForge output-of-layer ids, first id 2"),
)

# The bug that started the project, on a 61-layer DeepSeek-V3-style target (Kimi-K2.5): training fed
# the draft [embed, 3, 31] while SGLang fed [3, 31, 59]. Shrunk to N layers keeping the pattern: ids
# near the start stay, 31 = 61//2 + 1 -> N//2 + 1, 59 = 61 - 2 -> N - 2.
SEED_LAYERS = 61


def shrink(i: int, n: int = N, big: int = SEED_LAYERS) -> int:
    if i < big // 4:
        return i
    return n // 2 + (i - big // 2) if i < 3 * big // 4 else n - (big - i)


SEED_CASES: tuple[WiringCase, ...] = (
    WiringCase("seed_as_shipped", "speculators", tuple(shrink(i) for i in (0, 3, 31)),
               "the seed: trained on [embed, 3, 31], config says [3, 31, 59] (61 layers, shrunk)",
               config_ids=tuple(shrink(i) for i in (3, 31, 59))),
    WiringCase("seed_rewired", "speculators", tuple(shrink(i) for i in (0, 3, 31)),
               "the seed's draft with its config rewired to what it was trained on",
               config_ids=tuple(shrink(i) for i in (0, 3, 31))),
)
CASES_BY_ID = by_id(TRAINING_CASES + SEED_CASES, "wiring case")


# ---------------------------------------------------------------- draft config formats (what SGLang reads)

FORMATS = {
    "speculators": "fixtures.checkpoint.speculators_config_json: ids at the top level, input-of-layer "
                   "convention; no top-level model_type (speculators config.py:314-330 strips it)",
    "sglang": "fixtures.checkpoint.sglang_config_json: eagle_config ids, output-of-layer convention (id - 1)",
    "sglang_input_ids": "eagle_config ids in the input-of-layer convention (the trainer's ids copied verbatim, "
                        "as the DeepSeek/Kimi drafts ship them, e.g. SpecForge kimi-k25-eagle3.json [2, 30, 58])",
    "sglang_top_level": "the SGLang-format config with the ids at the top level (where speculators and vLLM "
                        "keep them) and no eagle_config",
}


def formats_for(case: WiringCase) -> tuple[str, ...]:
    if case.config_ids is not None:
        return ("sglang",)                       # the seed: the config as shipped
    if not TRAINERS[case.trainer].writes_ids:
        return ("speculators", "sglang")         # no ids: the other formats would be the same file
    return tuple(FORMATS)


def draft_config_json(case: WiringCase, fmt: str) -> dict:
    """The draft's config.json in `fmt`, from the project's writers (the draft's own knobs are tiny defaults)."""
    written = case.boundaries if TRAINERS[case.trainer].writes_ids else None
    cfg = make_config(hidden_size=TARGET_HIDDEN, target_hidden_size=TARGET_HIDDEN,
                      num_aux_hidden_states=len(case.boundaries), aux_layer_ids=written)
    if fmt == "speculators":
        return speculators_config_json(cfg)
    out = sglang_config_json(cfg)
    if case.config_ids is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(case.config_ids), "use_aux_hidden_state": True}
    elif fmt == "sglang_input_ids" and written:
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(written)
    elif fmt == "sglang_top_level" and written:
        del out["eagle_config"]
        out["eagle_aux_hidden_state_layer_ids"] = list(written)
    return out


def config_ids(case: WiringCase, fmt: str) -> tuple[int, ...] | None:
    """The eagle_config ids of the case's config in `fmt` (None: no eagle_config)."""
    eagle = draft_config_json(case, fmt).get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else tuple(ids)


# ---------------------------------------------------------------- known wiring behaviour (core/registry.toml)

REFUSED, CAPTURE_FAILED, DEFAULT_LIST = "config refused", "capture failed", "default list"
MISSING, SHALLOWER, DEEPER = "slot missing", "one layer shallower", "one layer deeper"
WRONG, MATCH = "wrong layers", "match"
assert {REFUSED, CAPTURE_FAILED, DEFAULT_LIST, MISSING, SHALLOWER, DEEPER, WRONG} == set(WIRING_KINDS), \
    "the registry's wiring kinds are WiringComparison.kind's"


def wiring_names(target: TargetSpec, case: WiringCase, fmt: str) -> dict[str, object]:
    """What a registry wiring condition reads: the target and its SGLang class, the config format, the
    training case, and the ids the config carries (config_shift: by how much they differ from the
    trained boundaries, when all by the same amount; None otherwise)."""
    ids = config_ids(case, fmt)
    shifts = {i - b for i, b in zip(ids, case.boundaries)} if ids and len(ids) == len(case.boundaries) else set()
    return {"target": target.id, "target_class": target.sglang_class.split(":")[1], "format": fmt, "case": case.id,
            "trainer": case.trainer, "num_layers": N, "trained_on_default": case.boundaries == (2, N // 2, N - 3),
            "config_has_ids": ids is not None, "first_config_id": ids[0] if ids else None,
            "min_config_id": min(ids) if ids else None, "max_config_id": max(ids) if ids else None,
            "config_shift": shifts.pop() if len(shifts) == 1 else None}


def known_wiring(target: TargetSpec, case: WiringCase, fmt: str) -> tuple[Known, ...]:
    """The registry's wiring entries for this case; the first decides (registry.match_wiring)."""
    return applicable("wiring", "sglang", wiring_names(target, case, fmt))


def wiring_matrix(targets) -> list[tuple[TargetSpec, WiringCase, str]]:
    """target x training case x format; the seed cases on DeepSeek-family targets only."""
    return [(t, c, f) for t in targets
            for c in TRAINING_CASES + (SEED_CASES if t.capture_rule == "first_id_is_one" else ())
            for f in formats_for(c)]


# ---------------------------------------------------------------- the comparison

@dataclass
class SlotResult:
    slot: int
    training: str | None      # boundary name, None when training has no such slot
    serving: str | None       # the boundary whose HF state this chunk equals, "?" when none, None when absent
    result: StageResult | None


@dataclass
class WiringComparison:
    case_id: str              # "<target>-<training>-<format>"
    training: tuple[int, ...]
    read: str                 # what SGLang read from the draft config, readable
    layers_to_capture: tuple[int, ...] | None
    serving: tuple[str, ...] | None     # per served slot, the boundary it holds
    error: str = ""           # SGLang refused the config / its forward failed: one line
    kind_of_error: str = ""   # REFUSED | CAPTURE_FAILED
    result: StageResult | None = None   # the whole aux tensor against training's
    slots: list[SlotResult] = field(default_factory=list)
    derived: bool = False     # serving list derived from layers_to_capture (no forward ran)
    trained: str = ""         # how training captured, readable (WiringCase.describe)

    @property
    def ok(self) -> bool:
        if self.error:
            return False
        if self.derived:
            return self.serving == tuple(boundary_name(b) for b in self.training)
        return self.result is not None and self.result.verdict == OK

    @property
    def kind(self) -> str:
        if self.error:
            return self.kind_of_error
        if self.ok:
            return MATCH
        train = tuple(boundary_name(b) for b in self.training)
        if len(self.serving) < len(train):
            return MISSING
        if self.read.startswith("no ids"):
            return DEFAULT_LIST
        serving = [_boundary(s) for s in self.serving]
        if None not in serving and len(serving) == len(self.training):
            if all(s == t - 1 for s, t in zip(serving, self.training)):
                return SHALLOWER
            if all(s == t + 1 for s, t in zip(serving, self.training)):
                return DEEPER
        return WRONG

    def lists(self) -> str:
        serving = "(none)" if self.serving is None else layer_list(self.serving)
        how = " (from layers_to_capture; no forward)" if self.derived else ""
        return f"training: {layer_list(self.training)}  serving: {serving}{how}"

    def message(self, repro: str) -> str:
        head = (f"sglang vs training [{self.case_id}]: the draft is not fed what it was trained on ({self.kind})"
                if not self.ok else f"sglang vs training [{self.case_id}]: same layers in every slot")
        lines = [head, f"  {self.lists()}"] + ([f"  trained with {self.trained}"] if self.trained else []) + [
            f"  SGLang read {self.read}; layers_to_capture "
            f"{'-' if self.layers_to_capture is None else list(self.layers_to_capture)}"]
        if self.error:
            lines.append(f"  {self.error}")
        for s in self.slots:
            where = "" if s.result is None or s.result.max_abs is None else (
                f"  max abs {s.result.max_abs:.3e} at {s.result.abs_index}, max rel {s.result.max_rel:.3e}")
            mark = "ok" if s.training == s.serving else "<- differs"
            lines.append(f"  slot {s.slot}: training {s.training or '(none)'}, serving {s.serving or '(none)'}"
                         f"  {mark}{where}")
        if self.result is not None and self.result.verdict != OK and self.result.detail:
            lines.append(f"  aux tensor: {self.result.detail}")
        lines.append(f"  repro: {repro}")
        return "\n".join(lines)

    def row(self, outcome: str) -> dict:
        """The report's "wiring" row ("Case" first: the report sorts rows by their JSON, keys sorted)."""
        read = f"refused: {self.error}" if self.kind_of_error == REFUSED else self.read
        captured = f"error: {self.error}" if self.kind_of_error == CAPTURE_FAILED else (
            "-" if self.serving is None else layer_list(self.serving) + (" (derived)" if self.derived else ""))
        return {"Case": self.case_id, "training captured": layer_list(self.training), "SGLang read": read,
                "layers_to_capture": "-" if self.layers_to_capture is None else str(list(self.layers_to_capture)),
                "SGLang captured": captured, "outcome": outcome}


def _boundary(name: str) -> int | None:
    return 0 if name == "embed" else N if name == "final" else int(name) if name.isdigit() else None


def describe_read(aux: AuxIds) -> str:
    if not aux.use_aux:
        return "use_aux_hidden_state false"
    return "no ids (the target's default list)" if aux.layer_ids is None else f"eagle_config {list(aux.layer_ids)}"


def identify(chunk: torch.Tensor, states: list[torch.Tensor]) -> tuple[str, StageResult]:
    """The boundary whose training-side state `chunk` equals within tolerance ('?' and the nearest if none)."""
    results = [compare_tensors(0, AUX_STAGE, chunk, s, DTYPE) for s in states]
    for b, r in enumerate(results):
        if r.verdict == OK:
            return boundary_name(b), r
    nearest = min(range(len(results)), key=lambda b: results[b].max_abs)
    return "?", results[nearest]


def compare_capture(case_id: str, training: tuple[int, ...], states: list[torch.Tensor], aux: torch.Tensor,
                    read: str, layers_to_capture) -> WiringComparison:
    """SGLang's captured aux tensor against the training capture (`states`: HF boundaries 0..N)."""
    expected = torch.cat([states[b] for b in training], dim=-1)
    width = states[0].shape[-1]
    chunks = list(aux.split(width, dim=-1))
    labelled = [identify(c, states) for c in chunks]
    slots = []
    for j in range(max(len(chunks), len(training))):
        t = boundary_name(training[j]) if j < len(training) else None
        s, r = labelled[j] if j < len(chunks) else (None, None)
        if j < len(chunks) and j < len(training):
            r = compare_tensors(0, AUX_STAGE, chunks[j], states[training[j]], DTYPE)
        slots.append(SlotResult(j, t, s, r))
    return WiringComparison(case_id, training, read, layers_to_capture, tuple(s for s, _ in labelled),
                            result=compare_tensors(0, AUX_STAGE, aux, expected, DTYPE), slots=slots)


# ---------------------------------------------------------------- session store

@dataclass
class TargetRun:
    spec: TargetSpec
    input_ids: torch.Tensor              # [T]
    states: list[torch.Tensor]           # HF boundaries 0..N, each [T, Ht] (N: before the final norm)
    hf_logits: torch.Tensor              # [T, V]
    sglang: SGLangTarget
    hf: torch.nn.Module                  # the transformers target (tie_last_hidden_states off)


class WiringStore:
    """Targets built once (transformers and SGLang, same weights), draft configs written once per case."""

    def __init__(self, root: Path, seed: int = 0):
        self.root, self.seed = root, seed
        self._targets: dict[str, TargetRun] = {}
        self._capture_only: dict[str, SGLangTarget] = {}
        self._configs: dict[tuple[str, str], Path] = {}
        # SGLang's forward per (target, layers_to_capture): with the same weights and prompt it is a
        # function of those alone, so cases that resolve to the same layers share one forward.
        self._forwards: dict[tuple, tuple[torch.Tensor, torch.Tensor] | CaptureFailed] = {}

    def target(self, spec: TargetSpec) -> TargetRun:
        if spec.id not in self._targets:
            hf, weights = make_hf_target(spec, torch.Generator().manual_seed(self.seed))
            ids = make_target_input(torch.Generator().manual_seed(self.seed + 1))
            with torch.no_grad():
                out = hf(ids[None], output_hidden_states=True)
            states = [h[0].detach().clone() for h in out.hidden_states]
            assert len(states) == spec.text_config["num_hidden_layers"] + 1
            sglang = load_target(spec, write_target_config(spec, self.root / "targets" / spec.id), weights)
            self._targets[spec.id] = TargetRun(spec, ids, states, out.logits[0].detach().clone(), sglang, hf)
        return self._targets[spec.id]

    def draft_dir(self, case: WiringCase, fmt: str) -> Path:
        key = (case.id, fmt)
        if key not in self._configs:
            d = self.root / "drafts" / case.id / fmt
            d.mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text(json.dumps(draft_config_json(case, fmt), indent=2) + "\n")
            self._configs[key] = d
        return self._configs[key]

    def serve(self, spec: TargetSpec, case: WiringCase, fmt: str) -> tuple[WiringComparison, torch.Tensor | None]:
        """SGLang's capture for this draft config on this target, compared with training's; and the aux tensor."""
        comparison, aux = self._serve(spec, case, fmt)
        comparison.trained = case.describe()
        return comparison, aux

    def _serve(self, spec: TargetSpec, case: WiringCase, fmt: str) -> tuple[WiringComparison, torch.Tensor | None]:
        case_id = f"{spec.id}-{case.id}-{fmt}"
        run = self.target(spec)
        try:
            aux_ids = sglang_aux_layer_ids(self.draft_dir(case, fmt), self.root)
        except DraftConfigRefused as exc:
            return WiringComparison(case_id, case.boundaries, "nothing", None, None, f"{fmt}/config.json: {exc}",
                                    REFUSED), None
        run.sglang.set_capture(aux_ids)
        read, layers = describe_read(aux_ids), tuple(run.sglang.layers_to_capture)
        try:
            aux, _ = self.forward(run, aux_ids.use_aux)
        except CaptureFailed as exc:
            return WiringComparison(case_id, case.boundaries, read, layers, None, f"target forward: {exc}",
                                    CAPTURE_FAILED), None
        return compare_capture(case_id, case.boundaries, run.states, aux, read, layers), aux

    def forward(self, run: TargetRun, use_aux: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's (aux, logits) for the target as currently configured; raises CaptureFailed."""
        key = (run.spec.id, use_aux, tuple(run.sglang.layers_to_capture))
        if key not in self._forwards:
            try:
                self._forwards[key] = run.sglang.run(run.input_ids)
            except CaptureFailed as exc:
                self._forwards[key] = exc
        result = self._forwards[key]
        if isinstance(result, CaptureFailed):
            raise result
        return result

    def capture_ids_only(self, spec: TargetSpec, case: WiringCase, fmt: str) -> WiringComparison:
        """For a class whose forward cannot run here: SGLang's ids and the class's own
        set_eagle3_layers_to_capture, with the served list read off layers_to_capture (the boundaries
        its forward visits: 0..N for gpt-oss, gpt_oss.py:708-740, in layer order, each once)."""
        case_id = f"{spec.id}-{case.id}-{fmt}"
        if spec.id not in self._capture_only:
            self._capture_only[spec.id] = build_target(spec, write_target_config(spec, self.root / "targets" / spec.id))
        target = self._capture_only[spec.id]
        try:
            aux_ids = sglang_aux_layer_ids(self.draft_dir(case, fmt), self.root)
        except DraftConfigRefused as exc:
            return WiringComparison(case_id, case.boundaries, "nothing", None, None, f"{fmt}/config.json: {exc}",
                                    REFUSED, derived=True)
        target.set_capture(aux_ids)
        layers = tuple(target.layers_to_capture)
        served = tuple(boundary_name(b) for b in sorted({b for b in layers if 0 <= b <= N}))
        return WiringComparison(case_id, case.boundaries, describe_read(aux_ids), layers, served, derived=True,
                                trained=case.describe())

    # ------------------------------------------------------------ end to end: target -> aux -> draft

    def end_to_end(self, spec: TargetSpec, case: WiringCase, fmt: str, seed: int = 0):
        """(sglang vs speculators Comparison, wiring): the same draft weights, each side fed by its own target.

        Serving: SGLang's target capture -> SGLang's LlamaForCausalLMEagle3 (sglang-format checkpoint).
        Training: the trainer's capture from transformers -> speculators' Eagle3DraftModel (speculators
        format). Each side's draft input ids are its prompt shifted by one plus its own target's next token.
        """
        from conformance.adapters import ADAPTERS
        from conformance.core.compare import compare_traces
        from fixtures.checkpoint import write_checkpoints
        from fixtures.tiny import make_draft_weights
        from reference.eagle3 import DraftBatch

        wiring, serving_aux = self.serve(spec, case, fmt)
        if serving_aux is None:
            raise ValueError(f"{wiring.case_id}: SGLang produced no aux tensor ({wiring.error})")
        run = self.target(spec)
        training_aux = torch.cat([run.states[b] for b in case.boundaries], dim=-1)
        _, sglang_logits = self.forward(run, True)
        cfg = make_config(hidden_size=TARGET_HIDDEN, target_hidden_size=TARGET_HIDDEN,
                          num_aux_hidden_states=len(case.boundaries), aux_layer_ids=case.boundaries)
        dirs = write_checkpoints(cfg, make_draft_weights(cfg, torch.Generator().manual_seed(seed)),
                                 self.root / "end_to_end" / wiring.case_id)
        T = run.input_ids.shape[0]

        def batch(aux, next_token):
            ids = torch.cat([run.input_ids[1:], next_token.reshape(1)])
            return DraftBatch(aux=aux.double(), input_ids=ids, positions=torch.arange(T),
                              seq_ids=torch.zeros(T, dtype=torch.long))

        served = ADAPTERS["sglang"]().load(dirs["sglang"], DTYPE, device=run.sglang.device).run(
            batch(serving_aux, sglang_logits[-1].argmax())).on_cpu()
        trained = ADAPTERS["speculators"]().load(dirs["speculators"], DTYPE).run(
            batch(training_aux, run.hf_logits[-1].argmax()))
        comparison = compare_traces(served, trained, wiring.case_id)
        return comparison, wiring
