"""Target-side wiring, the comparison: each served aux slot named by the transformers boundary it equals,
slot by slot against the training convention; a mismatch prints both layer lists side by side."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from conformance.adapters import ADAPTERS, DEFAULT_SERVER
from conformance.core.areas import Mismatch
from conformance.core.compare import OK, StageResult, compare_tensors

from conformance.wiring.cases import (
    AUX_STAGE, CAPTURE_FAILED, DEEPER, DEFAULT_LIST, DTYPE, MATCH, MISSING, N, REFUSED, SHALLOWER, WRONG,
    boundary_name, layer_list,
)

# The default server's real target classes with aux capture (SGLang's: conformance/adapters/sglang/target.py).
TARGET = ADAPTERS[DEFAULT_SERVER].target_capture

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
    error_class: str = ""     # the class of the exception the server raised (with `error`: its one-line message)

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

    @property
    def observed(self) -> Mismatch:
        """What the registry's wiring entries match: the kind, and for an error its exception class and message."""
        return Mismatch(self.kind, self.error_class or None, self.error)

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


def describe_read(aux: TARGET.AuxIds) -> str:
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


