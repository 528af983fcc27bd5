"""The serving side of the user's verdict: the target's aux wiring and the server flags, on the draft as
SGLang reads it (the directory as written, or this suite's conversion), each computed once per run.

The checks themselves are conformance/user/wiring.py (a tiny twin of --target-config) and
conformance/user/settings.py (--sglang-args through SGLang's own ServerArgs); this module
only hands them the user's files.
"""
from __future__ import annotations

import json
from pathlib import Path

from conformance.adapters import DEFAULT_SERVER
from conformance.checkpoints.knobs import CONFIG_FILE
from reference.eagle3 import Eagle3Config

# --serve-with: the servers a user's draft is checked against (every adapter that serves: is_server).
BOTH = "both"


def servers() -> list[str]:
    """The serving implementations (their adapters' `is_server`)."""
    from conformance.adapters import ADAPTERS, ALL_IMPLEMENTATIONS

    return [impl for impl in ALL_IMPLEMENTATIONS if ADAPTERS[impl].is_server]


def served_with(config) -> list[str]:
    """The servers --serve-with selects (the default without a pytest config)."""
    choice = config.getoption("--serve-with") if config is not None else DEFAULT_SERVER
    return servers() if choice == BOTH else [choice]


def unavailable(choice: str) -> str | None:
    """One line when a server --serve-with names cannot run here (its own environment not built): bad input,
    since a verdict against a server that never ran would say nothing about it. None when all can."""
    from conformance.adapters import ADAPTERS

    named = servers() if choice == BOTH else [choice]
    for impl in (impl for impl in named if impl in ADAPTERS):   # an unknown name is pytest's own usage error
        if why := ADAPTERS[impl].missing():
            return f"--serve-with {choice}: {impl} cannot run here: {why}"
    return None


STAND_IN = ("no --target-config: --sglang-args resolved against a stand-in Llama target of the draft's widths, "
            "vocabulary and context (SGLang picks auto settings and the context by the target)")


def served_dir(store) -> Path:
    return store.checkpoint(store.case)["sglang"]


def user_wiring(store):
    """check_user_wiring on --target-config's twin: the layers SGLang captures for this draft vs training's."""
    from conformance.user.wiring import check_user_wiring

    inputs = store.inputs
    return store.serving("wiring", lambda: check_user_wiring(served_dir(store), inputs.target_file, inputs.trainer,
                                                             store.root / "twins"))


def user_settings(store):
    """check_user_settings with --sglang-args; raises CommandLineError when SGLang refuses the flags."""
    from conformance.user.settings import check_user_settings

    inputs = store.inputs
    target = inputs.target_file or stand_in_target(inputs.config, store.root / "stand-in-target")
    return store.serving("settings", lambda: check_user_settings(inputs.sglang_args, served_dir(store), target,
                                                                 inputs.checkpoint, store.root / "settings"))


def stand_in_target(cfg: Eagle3Config, root: Path) -> Path:
    """A Llama target config as wide as the draft's target side, with its vocabulary and context, for
    ServerArgs when the user gave no target config."""
    heads = cfg.num_attention_heads if cfg.target_hidden_size % cfg.num_attention_heads == 0 else 1
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.target_hidden_size,
              "intermediate_size": 4 * cfg.target_hidden_size, "num_hidden_layers": 32,
              "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": cfg.vocab_size,
              "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
              "rope_theta": cfg.rope_theta, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return root / CONFIG_FILE
