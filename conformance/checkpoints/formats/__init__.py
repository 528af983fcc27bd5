"""The draft checkpoint formats, one module each, and how a directory's format is detected.

Every format is read into one Eagle3Config in training semantics (reference/eagle3.py) and tensors
under the canonical names (`layers.0.*`, `fc_norm.j.*`), and written back from them; a round trip
keeps every tensor bit-exact and every knob.

| format        | config.json                                          | tensor names                      |
|---------------|------------------------------------------------------|-----------------------------------|
| speculators   | speculators_model_type eagle3, transformer_layer_config | layers.i.*, fc_norm.j.*        |
|               | (MLA drafts: a DeepseekV3Config layer, the suite's own; speculators has none) |          |
| sglang        | flat, architectures LlamaForCausalLMEagle3           | layers.i.*, fc_norm.j.*           |
| sglang-legacy | same, `use_aux_norm` for fc_norm                     | midlayer.*, aux_norm_low/mid/high |
| specforge     | flat LlamaConfig export: no eagle_config, SpecForge's norm_output | midlayer.*, no embed_tokens |
| eagle         | original EAGLE-3: LlamaForCausalLM + draft_vocab_size (read only) | midlayer.*           |
| nemo          | the target's LlamaConfig, architectures LlamaEagle3DraftModel | model.*, one shard + index |
|               | (MLA drafts: the target's DeepseekV3Config, same architectures) |                           |
| nemo-sglang   | nemo's, architectures renamed by NeMo's serve_sglang (read only) | model.*, fewer layers than stated |
| sglang-mla    | flat MLA draft, architectures Eagle3DeepseekV2ForCausalLM (MLA only) | layers.0.*, midlayer.* |
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.errors import CheckpointError, ConversionError
from conformance.checkpoints.formats import (eagle, nemo, nemo_sglang, sglang, sglang_legacy, sglang_mla, specforge,
                                             speculators)
from conformance.checkpoints.knobs import ParsedConfig
from conformance.checkpoints.schema import LEGACY_FC_NORM
from reference.eagle3 import Eagle3Config

MODULES = {m.NAME: m for m in (speculators, sglang, sglang_legacy, specforge, eagle, nemo, nemo_sglang,
                                     sglang_mla)}
FORMATS = tuple(MODULES)
WRITABLE = tuple(name for name, m in MODULES.items() if hasattr(m, "config_json"))
EAGLE3_ARCH = sglang.ARCHITECTURE


def config_format(raw: dict, file: Path, tensor_names: list[str] | None = None) -> str:
    """The format a config.json (and, for the flat formats, its tensor names) is in."""
    if "speculators_model_type" in raw:
        return speculators.NAME
    arch = raw.get("architectures")
    if not isinstance(arch, list) or not arch:
        raise CheckpointError(file, "field architectures", f"missing or not a list ({arch!r}); cannot tell the format")
    if arch[0] == EAGLE3_ARCH:
        names = tensor_names or []
        if nemo_sglang.detected(raw, names):
            return nemo_sglang.NAME
        if not any(n.startswith(("midlayer.", "model.midlayer.")) for n in names):
            return sglang.NAME
        # midlayer names are SpecForge's module names (and the original EAGLE-3's); SGLang's own legacy
        # checkpoints add `use_aux_norm` / `aux_norm_*`. Read as SpecForge, the only difference is the
        # meaning of norm_output (semantics D27), which matters only when the key is present.
        legacy = "use_aux_norm" in raw or any(n.split(".")[-2] in LEGACY_FC_NORM for n in names if "." in n)
        return sglang_legacy.NAME if legacy else specforge.NAME
    if arch[0] == nemo.ARCHITECTURE:
        return nemo.NAME
    if arch[0] == sglang_mla.ARCHITECTURE:
        return sglang_mla.NAME
    if arch[0] == "LlamaForCausalLM":
        if "draft_vocab_size" in raw or "target_vocab_size" in raw:
            return eagle.NAME
        raise CheckpointError(file, "field architectures", "LlamaForCausalLM without draft_vocab_size: a target "
                                                           "model config, not an EAGLE-3 draft")
    raise CheckpointError(file, "field architectures",
                          f"{arch[0]} is not an EAGLE-3 draft (expected {EAGLE3_ARCH}, {nemo.ARCHITECTURE}, "
                          f"{sglang_mla.ARCHITECTURE}, "
                          "LlamaForCausalLM with draft_vocab_size, or speculators_model_type eagle3)")


def parse_config(raw: dict, file: Path, fmt: str | None = None, tensor_names: list[str] | None = None) -> ParsedConfig:
    return MODULES[fmt or config_format(raw, file, tensor_names)].parse(raw, file)


# MLA drafts (draft_arch "mla"): not written by these formats, each with why (speculators' is written with a
# DeepseekV3Config layer, the reference's own reading; the speculators adapter skips it).
NO_MLA = {
    sglang.NAME: "LlamaForCausalLMEagle3 has a Llama layer (models/llama_eagle3.py:272, 387); SGLang's MLA draft is "
                 "its own class and format, sglang-mla (Eagle3DeepseekV2ForCausalLM, models/kimi_k25_eagle3.py:315)",
    sglang_legacy.NAME: "SGLang's legacy layout is LlamaForCausalLMEagle3's (models/llama_eagle3.py:337-343)",
}


def config_json(cfg: Eagle3Config, fmt: str) -> dict:
    if fmt not in WRITABLE:
        raise ConversionError(f"cannot write format {fmt!r} (writable: {', '.join(WRITABLE)})")
    if cfg.draft_arch == "mla" and fmt in NO_MLA:
        raise ConversionError(f"{fmt} format cannot express draft_arch='mla': {NO_MLA[fmt]}")
    return MODULES[fmt].config_json(cfg)


def unwritable(cfg: Eagle3Config, fmt: str) -> str | None:
    """Why no checkpoint of `cfg` is written in format `fmt` (so an implementation that loads `fmt` cannot run the
    case), or None."""
    try:
        config_json(cfg, fmt)
    except ConversionError as exc:
        return str(exc)
    return None


def from_canonical(name: str, fmt: str) -> str:
    """The name `fmt` stores the canonical tensor `name` under."""
    return MODULES[fmt].stored_name(name)


def weights_writer(fmt: str):
    """How `fmt` lays its tensors out on disk: (stored tensors, directory) -> the files written; one
    model.safetensors unless the format writes its own layout (NeMo's consolidated shard and index)."""
    return getattr(MODULES[fmt], "save_weights", None)
