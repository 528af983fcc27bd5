"""SGLang's MLA EAGLE-3 draft format (read only): the flat config TorchSpec exports for the drafts Kimi-K2.5/K2.6 are
served with (`lightseekorg/kimi-k2.5-eagle3-mla`, fixtures/data/real-configs/mla/), `architectures:
[Eagle3DeepseekV2ForCausalLM]`, SGLang's class for it (sglang/srt/models/kimi_k25_eagle3.py, its EntryClass).

The decoder layer is DeepSeek's latent attention, stated by a DeepSeek model_type (kimi_k2, deepseek_v3, ...) and
its MLA widths (kv_lora_rank, ...), read as transformers' DeepseekV3Config names them (knobs.layer_knobs); aux
ids in `eagle_config` in SGLang's convention, as every flat format. The tensors come in either of TorchSpec's
export layouts (tools/convert_to_hf.py: `layers.0.*` with `--vllm`, `midlayer.*` without); both are read under the
canonical names (schema.to_canonical). The suite never writes this format: the reference and NeMo read MLA drafts
from their own formats, and SGLang is checked on the user's directory itself (conformance/user/mla.py).
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.formats.flat import parse_flat
from conformance.checkpoints.knobs import MLA_MODEL_TYPES, ParsedConfig

NAME = "sglang-mla"
ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


def format_checks(knobs: dict, problems: list, notes: list) -> None:
    """The class is SGLang's MLA draft: a config that does not describe an MLA layer cannot be one."""
    if knobs["draft_arch"] != "mla":
        problems.append(("field kv_lora_rank", f"missing, or model_type not one of {', '.join(MLA_MODEL_TYPES)}: "
                                               f"{ARCHITECTURE} is an MLA draft (kimi_k25_eagle3.py), and its "
                                               "latent widths are what it is built from"))


def parse(raw: dict, file: Path) -> ParsedConfig:
    return parse_flat(raw, file, NAME, format_checks=format_checks)


def stored_name(name: str) -> str:
    return name
