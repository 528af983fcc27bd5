"""A target model's config.json: the few facts the draft depends on."""
from __future__ import annotations

from pathlib import Path

from conformance.checkpoints.errors import Fields, load_json


def read_target_config(path: Path) -> dict:
    """hidden_size, num_hidden_layers, vocab_size, model_type and architectures (text_config for
    multimodal wrappers); a missing or mistyped field raises a one-line CheckpointError."""
    raw = load_json(Path(path))
    f = Fields(raw, Path(path))
    text = f.sub("text_config") if not f.has("hidden_size") else None
    g = text if text is not None else f
    arch = raw.get("architectures") or []
    return {"model_type": raw.get("model_type", ""), "architectures": list(arch) if isinstance(arch, list) else [],
            "hidden_size": g.int("hidden_size"), "num_hidden_layers": g.int("num_hidden_layers"),
            "vocab_size": g.int("vocab_size")}
