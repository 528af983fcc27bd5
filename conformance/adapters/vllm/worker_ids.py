"""Target-side wiring, read by vLLM's model runners (part of worker.py, in vLLM's environment): the aux layer ids
each runner hands the target for a draft config, by that runner's own function, and the target's default."""
from __future__ import annotations

import json
from pathlib import Path

from worker_config import draft_config_reading, engine_config


def aux_layers(req: dict) -> dict:
    """The aux layer ids vLLM's model runner `req["runner"]` hands the target for this draft config (no weights
    are read): vLLM's config path (EngineArgs -> create_engine_config, with its speculators-format translator),
    then that runner's reading (runner_aux_layers) on that config, else the target's
    get_eagle3_default_aux_hidden_state_layers (model_executor/models/interfaces.py:1751-1772; DeepSeek-V2/V3:
    deepseek_v2.py:1958-1960) for its number of layers. All are vLLM's own functions, called on stand-ins that
    hold only what they read (the speculative config; the target's layer list). Also what keeps vLLM off its V2
    runner for this config (config/vllm.py:3053-3087; empty: a server with Triton runs V2)."""
    from types import SimpleNamespace

    from vllm.model_executor.models.interfaces import SupportsEagle3

    target = json.loads(Path(req["target"]).read_text())
    vllm_config = engine_config(Path(req["draft"]), "float32", 1, Path(req["work"]), target)
    spec = vllm_config.speculative_config
    ids = runner_aux_layers(req["runner"], spec)
    text = target.get("text_config", target)
    layers = SimpleNamespace(model=SimpleNamespace(layers=[None] * text["num_hidden_layers"]))
    default = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(layers)
    return {"ids": None if ids is None else list(ids), "default": list(default),
            "reading": draft_config_reading(spec.draft_model_config.hf_config),
            "v2_unsupported": list(vllm_config._get_v2_model_runner_unsupported_features())}


def runner_aux_layers(runner: str, spec):
    """The aux ids a model runner reads from the draft config, by that runner's own function: V1
    GPUModelRunner._get_eagle3_aux_layers_from_config (v1/worker/gpu_model_runner.py:5190-5221: the top-level
    key, else eagle_config's), V2 get_eagle3_aux_layers_from_config (v1/worker/gpu/spec_decode/eagle/
    eagle3_utils.py:116-152: the top-level key, else eagle_config's `layer_ids`, never its
    eagle_aux_hidden_state_layer_ids). None: the target's default."""
    from types import SimpleNamespace

    if runner == "v2":
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        return get_eagle3_aux_layers_from_config(spec)
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
