"""SGLang's MLA EAGLE-3 draft format: the flat config TorchSpec exports for the drafts Kimi-K2.5/K2.6 are
served with (`lightseekorg/kimi-k2.5-eagle3-mla`, fixtures/data/real-configs/mla/), `architectures:
[Eagle3DeepseekV2ForCausalLM]`, SGLang's class for it (sglang/srt/models/kimi_k25_eagle3.py, its EntryClass).

The decoder layer is DeepSeek's latent attention, stated by a DeepSeek model_type (kimi_k2, deepseek_v3, ...) and
its MLA widths (kv_lora_rank, ...), read as transformers' DeepseekV3Config names them (knobs.layer_knobs); aux
ids in `eagle_config` in SGLang's convention, as every flat format. The tensors come in either of TorchSpec's
export layouts (tools/convert_to_hf.py: `layers.0.*` with `--vllm`, `midlayer.*` without); both are read under the
canonical names (schema.to_canonical). The suite writes it for its MLA cases (config_json): the published config's
keys, `layers.0.*` names, every knob SGLang never reads written anyway, so a round trip keeps it.
"""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.errors import ConversionError
from conformance.checkpoints.formats import sglang
from conformance.checkpoints.formats.flat import parse_flat
from conformance.checkpoints.knobs import MLA_MODEL_TYPES, ParsedConfig
from reference.eagle3 import Eagle3Config

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


def config_json(cfg: Eagle3Config) -> dict:
    """config.json as TorchSpec exports an MLA draft (fixtures/data/real-configs/mla/): SGLang's flat keys, the
    class and model_type of the published draft, DeepseekV3Config's MLA widths. DeepseekV3Config has no GQA and no
    head_dim of its own (head_dim is the rope slice, knobs.layer_knobs), so neither is written."""
    if cfg.draft_arch != "mla":
        raise ConversionError(f"{NAME} format cannot express draft_arch={cfg.draft_arch!r}: {ARCHITECTURE} is "
                              "an MLA draft (models/kimi_k25_eagle3.py:315)")
    out = sglang.config_json(cfg)
    for key in ("head_dim", "num_key_value_heads"):
        del out[key]
    out.update(architectures=[ARCHITECTURE], model_type="kimi_k2", num_key_value_heads=cfg.num_attention_heads,
               # null, not absent: an absent q_lora_rank reads as DeepseekV3Config's default, 1536, in SGLang
               q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
               # SGLang's MLA never reads it (written for round trips)
               rope_interleave=cfg.rope_interleave)
    return out
