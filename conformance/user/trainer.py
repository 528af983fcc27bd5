"""Who trained the user's draft, and so which target layers its aux slots were trained on.

A draft's aux-layer ids mean different layers to different trainers (eagle3-semantics.md §2.1):
speculators and the original EAGLE-3 count "input of layer i" (0 = the embeddings), SpecForge, NeMo
Automodel and SGLang's `eagle_config` count "output of layer i". The checkpoint says who trained it when
its format does (speculators' config.json, the original EAGLE-3 export, SpecForge's midlayer names, NeMo's
`LlamaEagle3DraftModel`, or NeMo's saved layout under SGLang's class name); a flat SGLang-format draft does
not, and `--trainer` states it. A config.json rewritten for serving no longer
holds the ids training used; `--trained-aux-layers embed,3,31` states those layers themselves. The ids
here are always in the training convention (input of layer i), as reference.eagle3.Eagle3Config holds them.
"""
from __future__ import annotations

from dataclasses import dataclass

from conformance.checkpoints.directory import DraftCheckpoint
from conformance.checkpoints.errors import load_json
from conformance.checkpoints.knobs import CONFIG_FILE

TRAINERS = ("speculators", "specforge", "eagle3", "nemo")
CHOICES = ("auto", *TRAINERS)
TRAINED_OPTION = "--trained-aux-layers"


class OptionError(ValueError):
    """A command-line option's value no check can use (one line; a usage error, exit code 4)."""

# What each trainer's ids mean and its default list for an N-layer target, in the training convention.
TRAINER_MEANING = {
    "speculators": "input of layer i, 0 = embeddings (speculators models/utils.py:110-116)",
    "specforge": "output of layer i (SpecForge algorithms/model_providers.py:188-211)",
    "eagle3": "input of layers {2, N//2, N-3}, hard-coded (EAGLE modeling_llama_kv.py:1139-1140)",
    "nemo": "output of layer i, default [1, N//2-1, N-4] (NeMo Automodel speculative/eagle/target.py:42-61, "
            ":276-285); its config.json saves no ids (recipes/llm/train_eagle3.py:610-650)",
    None: "SGLang's eagle_config convention, output of layer i (spec_aux_hidden_state.py:185-196)",
}
TRAINER_DETECTED_FROM = {
    "speculators": f"{CONFIG_FILE}: speculators_model_type",
    "eagle3": f"{CONFIG_FILE}: architectures LlamaForCausalLM with draft_vocab_size (the original EAGLE-3 export)",
    "specforge": "tensor names midlayer.* without SGLang's legacy use_aux_norm (SpecForge's export)",
    "nemo": f"{CONFIG_FILE}: architectures LlamaEagle3DraftModel (NeMo Automodel's recipe, "
            "recipes/llm/train_eagle3.py:613)",
}
FORMAT_TRAINER = {"speculators": "speculators", "eagle": "eagle3", "specforge": "specforge", "nemo": "nemo"}
# NeMo's saved directory after its own SGLang export renamed the class (speculative/serve_sglang.py:133-155
# rewrites architectures to LlamaForCausalLMEagle3 and keeps every other key): still NeMo's, by the key only its
# recipe writes (train_eagle3.py:648, parallel_drafting) and LlamaEagle3DraftModel's `model.`-prefixed tensors
# (draft_llama.py:768-831; lm_head, d2t and t2d are its own).
NEMO_KEY, NEMO_PREFIX = "parallel_drafting", "model."
NEMO_RENAMED = (f"{CONFIG_FILE}: {NEMO_KEY} (only NeMo Automodel's recipe writes it, recipes/llm/train_eagle3.py:648) "
                f"and {NEMO_PREFIX}-prefixed tensors (its LlamaEagle3DraftModel, draft_llama.py:768-831), "
                "architectures renamed for SGLang (as its speculative/serve_sglang.py:133-155 does)")
# How far each trainer's stored ids sit from "input of layer i", wherever in config.json they were written
# (speculators: input of layer i; SpecForge: output of layer i = input of layer i + 1). The original EAGLE-3
# ignores stored ids (hard-coded defaults); an unnamed trainer's ids are read as this suite's parser read them.
TRAINER_ID_SHIFT = {"speculators": 0, "specforge": 1, "nemo": 1}
# Trainers whose config.json states the target's depth (NeMo copies the target's config, num_hidden_layers
# included, train_eagle3.py:610): with no ids saved, their format's parser reads the ids as that depth's default.
DEPTH_IN_CONFIG = ("nemo",)
# The adapter that runs each trainer's own training forward on the user's draft. A draft is judged against
# its trainer's implementation only, not another trainer's loader; a trainer without an adapter (the original
# EAGLE-3) keeps speculators'. A draft whose trainer is neither stated nor detected runs no trainer's
# implementation: training semantics are the reference's, and one trainer's refusal of a file another may have
# written says nothing about how it is served (possible_trainers says which could have written it).
TRAINER_ADAPTER = {"speculators": "speculators", "specforge": "specforge", "nemo": "nemo"}
DEFAULT_TRAINER = "speculators"


def other_trainers(trainer: "Trainer | None", name: str | None = None) -> frozenset[str]:
    """The training adapters that do not run on a draft trained by `trainer` (or the trainer named `name`):
    every one when `trainer` names none."""
    if trainer is not None and trainer.name is None:
        return frozenset(TRAINER_ADAPTER.values())
    name = trainer.name if trainer is not None else name
    name = name if name in TRAINER_ADAPTER else DEFAULT_TRAINER
    return frozenset(adapter for who, adapter in TRAINER_ADAPTER.items() if who != name)


def default_ids(num_layers: int) -> tuple[int, ...]:
    """Every trainer's default: inputs of layers 2, N//2, N-3 (SpecForge's outputs 1, N//2-1, N-4)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Trainer:
    name: str | None          # None: the checkpoint does not say and --trainer was not given
    source: str               # how we know
    stored_ids: tuple[int, ...] | None   # the ids as written in config.json
    stored_where: str                    # which key they were read from
    parsed_ids: tuple[int, ...] | None   # the ids as this suite's format reader converted them
    stated_ids: tuple[int, ...] | None = None   # --trained-aux-layers: the layers training read, as stated

    @property
    def meaning(self) -> str:
        return TRAINER_MEANING[self.name]

    def training_ids(self, num_layers: int | None = None) -> tuple[int, ...] | None:
        """The target layers training read (input of layer i); None when that needs the target's
        layer count and it is not known."""
        if self.stated_ids is not None:
            return self.stated_ids
        if self.stored_ids is None and self.name in DEPTH_IN_CONFIG and self.parsed_ids is not None:
            return self.parsed_ids
        if self.stored_ids is None or (self.name in TRAINERS and self.name not in TRAINER_ID_SHIFT):
            return default_ids(num_layers) if num_layers else None
        if self.name in TRAINER_ID_SHIFT:
            return tuple(i + TRAINER_ID_SHIFT[self.name] for i in self.stored_ids)
        return self.parsed_ids

    def describe(self, num_layers: int | None = None) -> str:
        who = self.name or "not stated"
        ids = self.training_ids(num_layers)
        where = f"{self.stored_where} {list(self.stored_ids)}" if self.stored_ids is not None else "no ids stored"
        if self.stated_ids is not None:
            return (f"{self.name or 'not named'} ({self.source}); {where}; training captured "
                    f"{layer_names(self.stated_ids)} (inputs of layers {list(self.stated_ids)}), stated by "
                    f"{TRAINED_OPTION}")
        trained = f"trained on inputs of layers {list(ids)}" if ids is not None else \
            "trained on the trainer's default layers of the target (needs --target-config)"
        if self.stored_ids is None and self.name in DEPTH_IN_CONFIG and ids == self.parsed_ids and ids:
            trained += (f" (its default for the {ids[-1] + 3}-layer target its {CONFIG_FILE} names in "
                        f"num_hidden_layers; a run with other aux_layer_ids: state them with {TRAINED_OPTION})")
        return f"{who} ({self.source}); {where}, read as {self.meaning}: {trained}"


def possible_trainers(cfg) -> str:
    """Which trainers' implementations can express this draft's configuration (their adapters' own limits and the
    registry's load entries for the installed versions), for a draft whose trainer is not known; one line."""
    import dataclasses

    from conformance.adapters import ADAPTERS
    from conformance.core import registry
    from conformance.core.areas import SERVER_FLAGS

    names = {**dataclasses.asdict(cfg), **{flag: None for flag in SERVER_FLAGS}}
    can, cannot = [], []
    for trainer, impl in TRAINER_ADAPTER.items():
        who = f"{trainer} {registry.installed_version(impl) or '(not installed)'}"
        refused = registry.applicable("load", impl, names)
        why = ADAPTERS[impl]().unsupported(cfg) or (f"its loader refuses it: {refused[0].id}" if refused else "")
        (cannot if why else can).append(f"{who} ({why})" if why else who)
    return ("judged against training semantics (the reference), no trainer's implementation run; by what each "
            f"trainer's implementation here can express, it could have been trained by "
            f"{' or '.join(can) if can else 'none of them'}" + (f", not by {', '.join(cannot)}" if cannot else ""))


def layer_names(ids) -> str:
    return "[" + ", ".join("embed" if i == 0 else str(i) for i in ids) + "]"


def parse_trained_layers(text: str, num_aux: int, config_file: str, num_layers: int | None = None,
                         target_file: str = "") -> tuple[int, ...]:
    """--trained-aux-layers `embed,3,31`: the target layers training captured, one per aux slot, as
    boundaries (input of layer i; embed = 0, the embeddings). OptionError (one line) on anything else."""
    where = f"{TRAINED_OPTION} {text!r}"
    parts = [p.strip() for p in text.split(",")]
    ids = []
    for part in parts:
        if part == "embed":
            ids.append(0)
        elif part.isdigit():
            ids.append(int(part))
        else:
            raise OptionError(f"{where}: {part!r} is not a layer (expected comma-separated layers: embed or an "
                             "integer i >= 0, the input of layer i, e.g. embed,3,31)")
    if len(ids) != num_aux:
        raise OptionError(f"{where}: {len(ids)} layers, but the draft's fc reads {num_aux} aux states "
                         f"({config_file}: num_aux_hidden_states)")
    if len(set(ids)) != len(ids):
        raise OptionError(f"{where}: a layer is named twice")
    if num_layers is not None and max(ids) > num_layers:
        raise OptionError(f"{where}: layer {max(ids)} is beyond the target's {num_layers} layers "
                         f"({target_file}: num_hidden_layers; the last boundary is {num_layers})")
    return tuple(ids)


def _stored_ids(raw: dict) -> tuple[tuple[int, ...] | None, str]:
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    for ids, where in ((eagle.get("eagle_aux_hidden_state_layer_ids"), "eagle_config.eagle_aux_hidden_state_layer_ids"),
                       (raw.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids")):
        if isinstance(ids, list) and ids:
            return tuple(ids), where
    return None, ""


def nemo_renamed(raw: dict, ckpt: DraftCheckpoint) -> bool:
    """NeMo's saved directory under another class name: its recipe's own key and its draft's tensor names."""
    names = [info.stored_name for info in ckpt.tensors.values()]
    drafted = [n for n in names if n not in ("lm_head.weight", "d2t", "t2d")]
    return NEMO_KEY in raw and bool(drafted) and all(n.startswith(NEMO_PREFIX) for n in drafted)


def resolve_trainer(ckpt: DraftCheckpoint, option: str | None = "auto",
                    stated: tuple[int, ...] | None = None) -> Trainer:
    """--trainer when given, else what the checkpoint's format says (or nothing, for SGLang's format);
    `stated`: the layers --trained-aux-layers names, which replace whatever the ids say."""
    raw = load_json(ckpt.path / CONFIG_FILE)
    if ckpt.format == "speculators":   # speculators keeps its ids at the top level only
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        stored, where = (tuple(ids), "eagle_aux_hidden_state_layer_ids") if ids else (None, "")
    else:
        stored, where = _stored_ids(raw)
    parsed = ckpt.config.aux_layer_ids
    if option and option != "auto":
        name, source = option, "stated by --trainer"
    elif ckpt.format in FORMAT_TRAINER:
        name = FORMAT_TRAINER[ckpt.format]
        source = f"detected: {TRAINER_DETECTED_FROM[name]}"
    elif nemo_renamed(raw, ckpt):
        name, source = "nemo", f"detected: {NEMO_RENAMED}"
    elif stated is not None:
        name, source = None, f"{ckpt.format} format does not say"
    else:
        name, source = None, f"{ckpt.format} format does not say; state it with --trainer"
    return Trainer(name, source, stored, where, tuple(parsed) if parsed else None, stated)
