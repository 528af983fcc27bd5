"""Target-side wiring, the training side and the draft configs: each trainer's aux-id convention, the
wiring cases (defaults, explicit ids, the seed case shrunk to the tiny target), the draft config formats
SGLang reads, and which registry `wiring` entries apply to a case."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from conformance.core.registry import Known, applicable

from conformance.core.areas import WIRING_KINDS
from conformance.core.common import by_id
from conformance.checkpoints import config_json
from fixtures.checkpoint import sglang_config_json, speculators_config_json
from fixtures.targets import (
    TARGET_HIDDEN, TARGET_LAYERS, TargetSpec,
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
    # Without ids in its config: the config formats its drafts come in (the others would be the same file).
    formats: tuple[str, ...] = ("speculators", "sglang")
    # The target classes (architectures[0]) it trains a draft for; None: any. A trainer's adapter with a
    # `training_capture` checks this against its own code (conformance/wiring/test_training_capture.py).
    trains_for: tuple[str, ...] | None = None

    def boundaries(self, ids: tuple[int, ...] | None, n: int = N) -> tuple[int, ...]:
        return tuple(i + self.offset for i in (self.default(n) if ids is None else ids))

    def trains(self, target: TargetSpec) -> bool:
        return self.trains_for is None or target.config["architectures"][0] in self.trains_for


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
    # Its HF target (the co-located default); its SGLang runner hands the same ids to SGLang's target class
    # instead, which reads them as eagle_config ids (conformance/adapters/nemo/wiring.py).
    Trainer("nemo", "output of layer i (its HF target hooks decoder layer i's output)", 1,
            lambda n: (1, n // 2 - 1, n - 4), False,
            "nemo_automodel 0.7.0 speculative/eagle/target.py:42-61 (default [1, N//2-1, N-4], every backend), "
            "target.py:276-285 (a forward hook on decoder layer i keeps its output); its saved config.json "
            "carries no ids (recipes/llm/train_eagle3.py:610-650)",
            formats=("nemo",),
            # its EAGLE-3 draft registry (speculative/eagle/registry.py:66-111): no Kimi-K2.5 wrapper
            trains_for=("LlamaForCausalLM", "Phi3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                        "GptOssForCausalLM", "DeepseekV3ForCausalLM", "Gemma4ForConditionalGeneration",
                        "KimiK3ForCausalLM", "KimiK3ForConditionalGeneration")),
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
    WiringCase("nemo_default", "nemo", summary="NeMo's default [1, N//2-1, N-4] (output of layer i), no ids saved"),
    WiringCase("nemo_explicit", "nemo", (2, 5, 8), "NeMo run with aux_layer_ids [2, 5, 8]: its config saves none"),
    WiringCase("nemo_ids_in_eagle_config", "nemo", (2, 5, 8),
               "NeMo's ids [2, 5, 8] written into eagle_config to serve it (what its SGLang runner hands SGLang)",
               config_ids=(2, 5, 8)),
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
    "nemo": "conformance/checkpoints/formats/nemo.py: NeMo Automodel's saved config.json, the target's config "
            "(num_hidden_layers its depth) with architectures LlamaEagle3DraftModel and no ids",
}
FORMATS_WITHOUT_IDS = ("nemo",)   # only a trainer that writes no ids comes in them


def formats_for(case: WiringCase) -> tuple[str, ...]:
    if case.config_ids is not None:
        return ("sglang",)                       # the seed: the config as shipped
    if not TRAINERS[case.trainer].writes_ids:
        return TRAINERS[case.trainer].formats    # no ids: the other formats would be the same file
    return tuple(f for f in FORMATS if f not in FORMATS_WITHOUT_IDS)


def draft_config_json(case: WiringCase, fmt: str) -> dict:
    """The draft's config.json in `fmt`, from the project's writers (the draft's own knobs are tiny defaults)."""
    written = case.boundaries if TRAINERS[case.trainer].writes_ids else None
    cfg = make_config(hidden_size=TARGET_HIDDEN, target_hidden_size=TARGET_HIDDEN,
                      num_aux_hidden_states=len(case.boundaries), aux_layer_ids=written)
    if fmt == "speculators":
        return speculators_config_json(cfg)
    if fmt == "nemo":   # the target's depth, no ids (the writer takes the ids as that depth's NeMo default)
        return config_json(dataclasses.replace(cfg, aux_layer_ids=TRAINERS["nemo"].boundaries(None)), fmt)
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


def wiring_names(target: TargetSpec, case: WiringCase, fmt: str, runner: str | None = None) -> dict[str, object]:
    """What a registry wiring condition reads: the target and its SGLang class, the config format, the
    training case, the ids the config carries (config_shift: by how much they differ from the
    trained boundaries, when all by the same amount; None otherwise), and the server's model runner where it
    has more than one (`runner`: vLLM's "v1" / "v2"; None for SGLang)."""
    ids = config_ids(case, fmt)
    shifts = {i - b for i, b in zip(ids, case.boundaries)} if ids and len(ids) == len(case.boundaries) else set()
    return {"target": target.id, "target_class": target.sglang_class.split(":")[1], "format": fmt, "case": case.id,
            "trainer": case.trainer, "num_layers": N, "trained_on_default": case.boundaries == (2, N // 2, N - 3),
            "config_has_ids": ids is not None, "first_config_id": ids[0] if ids else None,
            "min_config_id": min(ids) if ids else None, "max_config_id": max(ids) if ids else None,
            "config_shift": shifts.pop() if len(shifts) == 1 else None, "runner": runner}


def runners(impl: str) -> tuple[str | None, ...]:
    """A server's model runners that read the draft config each their own way (its adapter's `runners`, the
    default first), or (None,)."""
    from conformance.adapters import ADAPTERS

    return ADAPTERS[impl].runners or (None,)


def known_wiring(target: TargetSpec, case: WiringCase, fmt: str) -> tuple[Known, ...]:
    """The registry's wiring entries for this case on the default server; the first decides (registry.match_wiring)."""
    from conformance.adapters import DEFAULT_SERVER

    return applicable("wiring", DEFAULT_SERVER, wiring_names(target, case, fmt))


def wiring_matrix(targets) -> list[tuple[TargetSpec, WiringCase, str]]:
    """target x training case x format; the seed cases on DeepSeek-family targets only; a trainer's cases only on
    the targets it trains a draft for."""
    return [(t, c, f) for t in targets
            for c in TRAINING_CASES + (SEED_CASES if t.capture_rule == "first_id_is_one" else ())
            if TRAINERS[c.trainer].trains(t) for f in formats_for(c)]


