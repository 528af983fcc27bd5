"""SGLang's legacy names: layer 0 as `midlayer.*`, fc_norm as `aux_norm_low/mid/high` with the
`use_aux_norm` flag (llama_eagle3.py:184-187, 337-343); otherwise SGLang's flat config."""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.formats import sglang
from conformance.checkpoints.formats.flat import parse_flat
from conformance.checkpoints.knobs import ParsedConfig
from conformance.checkpoints.schema import stored_name as _stored_name
from reference.eagle3 import Eagle3Config

NAME = "sglang-legacy"


def parse(raw: dict, file: Path) -> ParsedConfig:
    return parse_flat(raw, file, NAME)


def stored_name(name: str) -> str:
    return _stored_name(name, midlayer=True, legacy_fc_norm=True)


def config_json(cfg: Eagle3Config) -> dict:
    out = sglang.config_json(cfg)
    out["use_aux_norm"] = out.pop("fc_norm")   # SGLang's legacy flag (llama_eagle3.py:184-187)
    return out
